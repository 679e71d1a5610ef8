"""The compute graph of a session: completion chains and the semantic variables between them.

Nodes come from a request's chunks: `ConstantFill` (constant text, held in a constant variable),
`PlaceholderFill` (an input placeholder's variable) and `PlaceholderGen` (an output placeholder's
variable, with its sampling settings). A request's nodes form a `RequestChain`, split into
`CompletionChain`s (fills followed by one gen): the unit of scheduling.

The `ComputeGraph` is bipartite: edges go from a variable to each chain that reads it and from a chain
to the variable it produces. Chain i+1 of a request reads chain i's output (its prompt continues after
that generation), so it depends on it. Inserting a request that would close a cycle, or that generates
into a variable that already has a producer or a value, is refused and leaves the graph unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from parrot.errors import ConflictError, InvalidRequestError
from parrot.serve.variables import SemanticVariable, VariableState


@dataclass(eq=False)
class ConstantFill:
    var: SemanticVariable


@dataclass(eq=False)
class PlaceholderFill:
    var: SemanticVariable


@dataclass(eq=False)
class PlaceholderGen:
    var: SemanticVariable
    sampling_config: dict[str, Any] | None = None


FillNode = ConstantFill | PlaceholderFill
Node = ConstantFill | PlaceholderFill | PlaceholderGen


def _node_json(node: Node) -> dict[str, Any]:
    return {"type": type(node).__name__, "var_id": node.var.id, "var_name": node.var.name}


def _unique(vars_: Iterable[SemanticVariable]) -> list[SemanticVariable]:
    seen: dict[str, SemanticVariable] = {}
    for v in vars_:
        seen.setdefault(v.id, v)
    return list(seen.values())


@dataclass(eq=False)
class CompletionChain:
    """Fill nodes then one gen node: one completion. `prev` is the request's previous chain (or None)."""

    fills: list[FillNode]
    gen: PlaceholderGen
    request_id: str
    session_id: str
    index: int = 0
    prev: CompletionChain | None = None
    started: bool = False
    id: str = field(default="")
    run: dict[str, Any] = field(default_factory=dict)  # how the serve core ran it (engine, times, tokens)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{self.request_id}/{self.index}"

    def __repr__(self) -> str:
        return f"CompletionChain(id={self.id!r}, output={self.gen.var.id!r})"

    @property
    def nodes(self) -> list[Node]:
        return [*self.fills, self.gen]

    @property
    def input_vars(self) -> list[SemanticVariable]:
        """The variables of this chain's own fills, in order, each once."""
        return _unique(f.var for f in self.fills)

    @property
    def output_var(self) -> SemanticVariable:
        return self.gen.var

    @property
    def dependency_vars(self) -> list[SemanticVariable]:
        """What must be READY before this chain runs: its inputs and the previous chain's output."""
        deps = self.input_vars
        if self.prev is not None:
            deps = _unique([self.prev.output_var, *deps])
        return deps

    @property
    def prefix_vars(self) -> list[SemanticVariable]:
        """The variables whose contents, concatenated, are this chain's prompt (previous chains included)."""
        head = [*self.prev.prefix_vars, self.prev.output_var] if self.prev is not None else []
        return [*head, *(f.var for f in self.fills)]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "request_id": self.request_id, "session_id": self.session_id,
                "started": self.started, "nodes": [_node_json(n) for n in self.nodes],
                "output_var": self.output_var.id, "depends_on": [v.id for v in self.dependency_vars]}


@dataclass(eq=False)
class RequestChain:
    """The completion chains of one request, in template order."""

    request_id: str
    session_id: str
    chains: list[CompletionChain]

    @classmethod
    def build(cls, request_id: str, session_id: str, nodes: Sequence[Node]) -> RequestChain:
        """Split nodes into completion chains at each gen node. Fills after the last gen are dropped
        (they generate nothing)."""
        chains: list[CompletionChain] = []
        fills: list[FillNode] = []
        for node in nodes:
            if isinstance(node, PlaceholderGen):
                prev = chains[-1] if chains else None
                chains.append(CompletionChain(fills, node, request_id, session_id, len(chains), prev))
                fills = []
            else:
                fills.append(node)
        return cls(request_id, session_id, chains)

    @property
    def output_vars(self) -> list[SemanticVariable]:
        return [c.output_var for c in self.chains]


class ComputeGraph:
    """Chains and variables of one session, as a DAG. Thread-safe (one lock)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._chains: dict[str, CompletionChain] = {}  # insertion order
        self._vars: dict[str, SemanticVariable] = {}
        self._producer: dict[str, CompletionChain] = {}  # var id -> chain
        self._consumers: dict[str, dict[str, CompletionChain]] = {}  # var id -> chain id -> chain

    def __len__(self) -> int:
        return len(self._chains)

    def __contains__(self, chain: object) -> bool:
        return isinstance(chain, CompletionChain) and self._chains.get(chain.id) is chain

    @property
    def chains(self) -> list[CompletionChain]:
        with self._lock:
            return list(self._chains.values())

    @property
    def variables(self) -> list[SemanticVariable]:
        with self._lock:
            return list(self._vars.values())

    # -- insertion ------------------------------------------------------------------------------------
    def insert(self, request_chain: RequestChain, via: Callable[[str], Iterable[str]] | None = None) -> None:
        """Add a request's chains and their edges. Raises `ConflictError` if an output variable already
        has a producer or a value, `InvalidRequestError` if the request would close a cycle, also one through
        calls outside this graph: `via(var_id)` gives the variables computed from that one by them (native
        calls not run yet); the graph is unchanged then."""
        new = request_chain.chains
        with self._lock:
            outputs: dict[str, CompletionChain] = {}
            for chain in new:
                if chain.id in self._chains:
                    raise ConflictError(f"completion chain {chain.id!r} is already in the graph")
                var = chain.output_var
                if var.state is not VariableState.PENDING:
                    raise ConflictError(f"output variable {var.name!r} ({var.id}) is already {var.state.value}")
                if var.id in self._producer or var.id in outputs:
                    raise ConflictError(f"output variable {var.name!r} ({var.id}) already has a producer")
                outputs[var.id] = chain
            self._check_acyclic(new, outputs, via)
            for chain in new:
                self._chains[chain.id] = chain
                out = chain.output_var
                self._vars.setdefault(out.id, out)
                self._producer[out.id] = chain
                if out.producer is None:
                    out.producer = chain.request_id
                for var in chain.dependency_vars:
                    self._vars.setdefault(var.id, var)
                    self._consumers.setdefault(var.id, {})[chain.id] = chain

    def _check_acyclic(self, new: Sequence[CompletionChain], new_outputs: dict[str, CompletionChain],
                       via: Callable[[str], Iterable[str]] | None = None) -> None:
        """A cycle through the new chains exists iff some new chain reaches itself; the old graph is a DAG (and
        the calls of `via` make only new variables from existing ones: no cycle among themselves)."""
        new_consumers: dict[str, list[CompletionChain]] = {}
        for chain in new:
            for var in chain.dependency_vars:
                new_consumers.setdefault(var.id, []).append(chain)

        def successors(chain: CompletionChain) -> list[CompletionChain]:
            """The chains reading the chain's output, directly or through `via`'s calls."""
            out: list[CompletionChain] = []
            todo, seen = [chain.output_var.id], {chain.output_var.id}
            while todo:
                vid = todo.pop()
                out += [*self._consumers.get(vid, {}).values(), *new_consumers.get(vid, [])]
                for nxt in via(vid) if via is not None else ():
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            return out

        white, grey, black = 0, 1, 2
        color: dict[int, int] = {}
        for root in new:
            if color.get(id(root), white) != white:
                continue
            color[id(root)] = grey
            stack: list[tuple[CompletionChain, list[CompletionChain]]] = [(root, successors(root))]
            while stack:
                chain, todo = stack[-1]
                if not todo:
                    color[id(chain)] = black
                    stack.pop()
                    continue
                nxt = todo.pop()
                c = color.get(id(nxt), white)
                if c == grey:
                    raise InvalidRequestError(
                        f"request {new[0].request_id!r} would create a dependency cycle through variable "
                        f"{chain.output_var.name!r} ({chain.output_var.id})")
                if c == white:
                    color[id(nxt)] = grey
                    stack.append((nxt, successors(nxt)))

    # -- queries --------------------------------------------------------------------------------------
    def producers_of(self, var: SemanticVariable) -> list[CompletionChain]:
        """The chain generating `var` (a list of zero or one)."""
        with self._lock:
            chain = self._producer.get(var.id)
            return [chain] if chain is not None else []

    def consumers_of(self, var: SemanticVariable) -> list[CompletionChain]:
        """The chains that read `var` directly (as a fill, or as the previous chain's output)."""
        with self._lock:
            return list(self._consumers.get(var.id, {}).values())

    def ready_chains(self) -> list[CompletionChain]:
        """Chains not started whose dependencies are all READY, in insertion order."""
        with self._lock:
            return [c for c in self._chains.values()
                    if not c.started and all(v.state is VariableState.READY for v in c.dependency_vars)]

    def mark_started(self, chain: CompletionChain) -> None:
        with self._lock:
            chain.started = True

    def upstream_chains(self, var: SemanticVariable) -> list[CompletionChain]:
        """Every chain in the graph `var` transitively depends on (its producer, their producers, ...),
        upstream first (a topological order)."""
        with self._lock:
            order: list[CompletionChain] = []
            seen: set[str] = set()
            start = self._producer.get(var.id)
            if start is None:
                return order
            seen.add(start.id)
            stack: list[tuple[CompletionChain, list[CompletionChain]]] = [(start, self._deps_of(start))]
            while stack:
                chain, todo = stack[-1]
                if not todo:
                    order.append(chain)
                    stack.pop()
                    continue
                nxt = todo.pop()
                if nxt.id not in seen:
                    seen.add(nxt.id)
                    stack.append((nxt, self._deps_of(nxt)))
            return order

    def _deps_of(self, chain: CompletionChain) -> list[CompletionChain]:
        deps = [self._producer.get(v.id) for v in chain.dependency_vars]
        return [d for d in reversed(deps) if d is not None]

    # -- removal --------------------------------------------------------------------------------------
    def remove(self, chain: CompletionChain) -> None:
        """Drop a chain (finished or abandoned) and its edges; variables left without edges leave the graph.
        Chains reading its output keep waiting on the variable, which then has no producer here."""
        with self._lock:
            if self._chains.get(chain.id) is not chain:
                return
            del self._chains[chain.id]
            out = chain.output_var
            if self._producer.get(out.id) is chain:
                del self._producer[out.id]
            for var in chain.dependency_vars:
                consumers = self._consumers.get(var.id)
                if consumers is not None:
                    consumers.pop(chain.id, None)
                    if not consumers:
                        del self._consumers[var.id]
            for var in [out, *chain.dependency_vars]:
                if var.id not in self._producer and var.id not in self._consumers:
                    self._vars.pop(var.id, None)

    def to_json(self) -> dict[str, Any]:
        """Chains (with nodes), variables (with states) and edges, for inspection."""
        with self._lock:
            edges: list[dict[str, str]] = []
            for chain in self._chains.values():
                edges.extend({"from": v.id, "to": chain.id} for v in chain.dependency_vars)
                edges.append({"from": chain.id, "to": chain.output_var.id})
            return {"chains": [c.to_json() for c in self._chains.values()],
                    "variables": [v.to_json() for v in self._vars.values()],
                    "edges": edges}
