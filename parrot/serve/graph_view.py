"""A read-only view of a session for people: its DAG as nodes and edges, and the engines' load.

Nodes are the session's calls (semantic calls, one node per completion chain, and native calls) and the
semantic variables they read and write. Each call has a state (`waiting`, `running`, `done`, `failed`),
a `detail` saying why it waits, its timings (queue, time to first token, time per output token, total;
seconds from when it became runnable: inputs set and output needed), the engine it ran on, its prompt
tokens split into cached and computed (and the prefix context it forked from), and the error of a
failure. The engine contexts the session made or forked are listed with the calls that forked them.
`layer` is the node's topological depth (variables nobody in the session produced: 0), which the /ui
page uses as its column. Everything here only reads the serve core's state; call it on the core's
event loop.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from parrot.serve.graph import CompletionChain
from parrot.serve.variables import SemanticVariable, VariableState

if TYPE_CHECKING:
    from parrot.serve.core import ParrotServeCore
    from parrot.serve.executor import NativeNode
    from parrot.serve.session import Session

PREVIEW_CHARS = 400
_VAR_STATE = {VariableState.PENDING: "waiting", VariableState.READY: "done", VariableState.FAILED: "failed"}


def _preview(text: str | None) -> str | None:
    if text is None:
        return None
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "…"


def _var_node(var: SemanticVariable, session_id: str) -> dict[str, Any]:
    return {"id": f"var:{var.id}", "kind": "variable", "var_id": var.id, "label": var.name,
            "state": _VAR_STATE[var.state], "constant": var.is_constant, "global": var.session_id is None,
            "shared": var.session_id is None or var.session_id != session_id,
            "chars": len(var.content) if var.content is not None else None,
            "preview": _preview(var.content), "error": var.error, "type": var.type}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _tasks_of(core: ParrotServeCore, session_id: str) -> dict[str, tuple[str, Any]]:
    """Chain id -> ("queued" | "running", task) for the session's tasks in the global scheduler."""
    out: dict[str, tuple[str, Any]] = {}
    for status, tasks in (("queued", core.scheduler.queue), ("running", list(core.scheduler.running.values()))):
        for task in tasks:
            chain = getattr(task.payload, "chain", None)
            if isinstance(chain, CompletionChain) and chain.session_id == session_id:
                out[chain.id] = (status, task)
    return out


def _cached_prefix(chain: CompletionChain) -> list[str]:
    """Labels of the prompt's variables wholly inside the prefix context the chain forked from."""
    run = chain.run
    forked, bounds = run.get("forked_tokens") or 0, run.get("boundaries")
    if not forked or not bounds:
        return []
    nonempty = [v for v in chain.prefix_vars if v.content]  # each non-empty piece ends at one boundary
    if len(nonempty) != len(bounds):
        return []
    return [_var_label(v) for v, b in zip(nonempty, bounds, strict=True) if b <= forked]


def _var_label(var: SemanticVariable) -> str:
    """A variable's name; constant text is named by its start."""
    if not var.is_constant:
        return var.name
    text = " ".join((var.content or "").split())
    return "“" + (text if len(text) <= 24 else text[:23] + "…") + "”"


def _chain_node(chain: CompletionChain, session: Session, task: tuple[str, Any] | None,
                now: float) -> dict[str, Any]:
    out = chain.output_var
    run = chain.run
    needed = chain.id in session.executor.criteria or "criterion" in run  # (one that ran was needed)
    state, detail = "waiting", None
    if out.is_failed:
        state, detail = "failed", "failed"
    elif out.is_ready:
        state, detail = "done", "done"
    elif task is not None and task[0] == "running":
        state = "running"
        detail = "generating" if task[1].payload.streamed else "prefilling"
    elif task is not None:
        detail = "queued for an engine"
    elif chain.started:
        detail = "dispatching"
    elif any(not v.is_ready for v in chain.dependency_vars):
        detail = "waiting for inputs"
    else:
        detail = "not requested yet" if not needed else "ready"
    created = run.get("created")
    if created is None and task is not None:
        created = task[1].payload.created
    dispatched = run.get("dispatched")
    queue = None
    if created is not None:
        queue = (dispatched - created) if dispatched is not None else (now - created if task else None)
    total = run.get("latency_s")
    if total is None and created is not None and state in ("waiting", "running") and task is not None:
        total = now - created
    engine = run.get("engine") or (task[1].engine if task is not None else None)
    prompt, cached = run.get("prompt_tokens"), run.get("cached_tokens")
    req = session.requests.get(chain.request_id, {})
    return {
        "id": f"call:{chain.id}", "kind": "call", "call_type": "semantic", "request_id": chain.request_id,
        "chain_index": chain.index, "label": out.name, "state": state, "detail": detail, "needed": needed,
        "criterion": (task[1].criterion if task else None) or session.executor.criteria.get(chain.id)
        or run.get("criterion"),
        "engine": engine,
        "timings": {"queue_s": _round(queue), "ttft_s": _round(run.get("ttft_s")), "tpot_s": _round(run.get("tpot_s")),
                    "total_s": _round(total)},
        "tokens": {"prompt": prompt, "cached": cached,
                   "computed": prompt - cached if prompt is not None and cached is not None else None,
                   "output": run.get("output_tokens"),
                   "forked_from": run.get("forked_from"), "forked_tokens": run.get("forked_tokens"),
                   "cached_prefix": _cached_prefix(chain)},
        "template": _preview(req.get("template")),
        "error": out.error if out.is_failed else None,
    }


def _native_node(node: NativeNode) -> dict[str, Any]:
    outs = list(node.outputs.values())
    failed = next((v for v in outs if v.is_failed), None)
    if failed is not None:
        state, detail = "failed", "failed"
    elif outs and all(v.is_ready for v in outs):
        state, detail = "done", "done"
    elif any(not v.is_ready for v in node.inputs.values()):
        state, detail = "waiting", "waiting for inputs"
    else:
        state, detail = "waiting", "not requested yet" if not node.needed else "ready"
    return {"id": f"call:{node.request_id}", "kind": "call", "call_type": "native", "request_id": node.request_id,
            "chain_index": 0, "label": node.call.name, "state": state, "detail": detail, "needed": node.needed,
            "criterion": node.criterion, "engine": None,
            "timings": {"queue_s": None, "ttft_s": None, "tpot_s": None, "total_s": None},
            "tokens": None, "template": None, "error": failed.error if failed is not None else None}


def session_graph(core: ParrotServeCore, session: Session) -> dict[str, Any]:
    """The session's DAG (every call it made, finished ones included) with states, and the engines."""
    now = time.perf_counter()
    sid = session.session_id
    tasks = _tasks_of(core, sid)
    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, str]] = []
    variables: dict[str, SemanticVariable] = {}
    calls_in: dict[str, list[str]] = {}  # call node id -> input variable ids
    producer: dict[str, str] = {}  # variable id -> call node id
    for chain in session.executor.history:
        node = _chain_node(chain, session, tasks.get(chain.id), now)
        nodes.append(node)
        deps = chain.dependency_vars
        calls_in[node["id"]] = [v.id for v in deps]
        for v in deps:
            variables.setdefault(v.id, v)
            edges.append({"from": f"var:{v.id}", "to": node["id"]})
        variables.setdefault(chain.output_var.id, chain.output_var)
        producer[chain.output_var.id] = node["id"]
        edges.append({"from": node["id"], "to": f"var:{chain.output_var.id}"})
    for native in session.executor.native_history:
        node = _native_node(native)
        nodes.append(node)
        calls_in[node["id"]] = [v.id for v in native.inputs.values()]
        for v in native.inputs.values():
            variables.setdefault(v.id, v)
            edges.append({"from": f"var:{v.id}", "to": node["id"]})
        for v in native.outputs.values():
            variables.setdefault(v.id, v)
            producer[v.id] = node["id"]
            edges.append({"from": node["id"], "to": f"var:{v.id}"})
    var_nodes = [_var_node(v, sid) for v in variables.values()]
    for vn in var_nodes:
        vn["producer"] = producer.get(vn["var_id"])
    nodes.extend(var_nodes)
    _layers(nodes, calls_in, producer)
    calls = [n for n in nodes if n["kind"] == "call"]
    return {
        "session_id": sid,
        "idle_s": round(session.idle_seconds(), 3),
        "now": time.time(),
        "nodes": nodes,
        "edges": edges,
        "counts": {"calls": len(calls), "variables": len(var_nodes),
                   **{s: sum(1 for n in calls if n["state"] == s) for s in ("waiting", "running", "done", "failed")}},
        "engines": engines_view(core),
        "contexts": _contexts_view(core, sid, calls),
        "prefix_hit_rate": round(core.contexts.hit_rate, 4),
    }


def _contexts_view(core: ParrotServeCore, sid: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine contexts the session made, and the global ones it forked (a shared system prompt), with
    the calls that forked each."""
    forks: dict[str, list[str]] = {}
    for n in calls:
        ctx_id = (n.get("tokens") or {}).get("forked_from")
        if ctx_id:
            forks.setdefault(ctx_id, []).append(n["id"])
    mine = [c for c in core.contexts.contexts() if c.session_id == sid]
    chosen = {id(c): c for c in mine}
    for c in [*mine, *(c for c in core.contexts.contexts() if c.context_id in forks)]:
        while c is not None:  # the prefixes it was forked from
            chosen.setdefault(id(c), c)
            c = c.parent
    return [{"context_id": c.context_id, "engine": c.engine, "tokens": c.num_tokens,
             "parent": c.parent.context_id if c.parent is not None else None,
             "owner": "global" if c.session_id is None else ("session" if c.session_id == sid else "other"),
             "children": c.children, "in_use": c.in_use, "hits": c.hits, "forked_by": forks.get(c.context_id, [])}
            for c in sorted(chosen.values(), key=lambda c: (c.engine, c.num_tokens))]


def _layers(nodes: list[dict[str, Any]], calls_in: dict[str, list[str]], producer: dict[str, str]) -> None:
    """Set each node's `layer`: a variable without producer is 0, a call is one past its deepest input,
    a produced variable one past its producer (the graph is a DAG). Walked with an explicit stack: an app's
    chain may be thousands of calls deep."""
    memo: dict[str, int] = {}

    def inputs(node_id: str) -> list[str]:
        if node_id.startswith("var:"):
            p = producer.get(node_id[4:])
            return [p] if p is not None else []
        return [f"var:{v}" for v in calls_in.get(node_id, [])]

    for n in nodes:
        if n["id"] not in memo:  # post-order over an explicit stack; `path` holds the node's ancestors only
            stack, path = [(n["id"], iter(inputs(n["id"])))], {n["id"]}
            while stack:
                node_id, todo = stack[-1]
                nxt = next((i for i in todo if i not in memo and i not in path), None)  # (on the path: a cycle)
                if nxt is not None:
                    stack.append((nxt, iter(inputs(nxt))))
                    path.add(nxt)
                    continue
                stack.pop()
                path.discard(node_id)
                known = [memo.get(i, 0) for i in inputs(node_id)]
                memo[node_id] = ((known[0] + 1 if known else 0) if node_id.startswith("var:")
                                 else 1 + max(known, default=-1))
        n["layer"] = memo[n["id"]]


def engines_view(core: ParrotServeCore) -> list[dict[str, Any]]:
    """Every registered engine: liveness, tasks the serve core runs there, its last reported runtime, and
    (an engine process this server started: `parrot serve --engines N`) its process's state, restarts and
    last exit code."""
    processes = {str(p["name"]): p for p in core.engine_processes.status()} if core.engine_processes else {}
    out = []
    for st in core.engines.status():
        rt = st.runtime
        used = rt.total_pages - rt.free_pages if rt is not None else None
        out.append({
            "name": st.name, "url": st.url, "model": st.model, "live": st.live, "reason": st.reason,
            "tasks": core.scheduler.load(st.name),
            "running": rt.running if rt else None, "waiting": rt.waiting if rt else None,
            "kv_pages_used": used, "kv_pages_total": rt.total_pages if rt else None,
            "kv_usage": round(used / rt.total_pages, 4) if rt is not None and rt.total_pages else None,
            "contexts": rt.num_contexts if rt else None, "cached_tokens": rt.num_cached_tokens if rt else None,
            "recent_step_ms": rt.recent_step_ms if rt else None,
            "process": {k: v for k, v in processes[st.name].items() if k != "name"} if st.name in processes else None,
        })
    return out


def sessions_view(core: ParrotServeCore) -> list[dict[str, Any]]:
    """A summary line per live session (for the all-sessions view: admin only)."""
    out = []
    for s in list(core.sessions.values()):
        tasks = _tasks_of(core, s.session_id)
        states = [_chain_node(c, s, tasks.get(c.id), time.perf_counter())["state"] for c in s.executor.history]
        states += [_native_node(n)["state"] for n in s.executor.native_history]
        out.append({"session_id": s.session_id, "idle_s": round(s.idle_seconds(), 3), "calls": len(states),
                    **{k: states.count(k) for k in ("waiting", "running", "done", "failed")}})
    return out
