"""The Python SDK end to end: a real uvicorn server on loopback, the serve core, an embedded engine
running a tiny random model (the fixture pattern of test_http_api.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

import parrot as P
from parrot.errors import ConflictError, InvalidRequestError, NotFoundError, ParrotError
from parrot.frontend.sdk import VariableFailedError, VariableTimeoutError
from tests.servers import free_port

SYSTEM = "You are a careful assistant that summarizes text in one line. " * 2
FEW = P.Output(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def server():
    from parrot.engine.engine import LLMEngine
    from tests.conftest import tiny_engine_config, tiny_model
    from tests.servers import serving_core

    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    with serving_core(engine, "tiny", model.tokenizer, default_max_tokens=8) as (url, core):
        yield url, core
    engine.shutdown()


@pytest.fixture
def vm(server):
    with P.VirtualMachine(server[0], timeout=60) as machine:
        yield machine


@P.semantic_function(template=SYSTEM + "Text: {{text}}\nSummary: {{summary}}")
def summarize(text: P.Input, summary: FEW): ...


@P.semantic_function
def refine(summary: P.Input, text: P.Input, new_summary: P.Output(max_tokens=5, ignore_eos=True, temperature=0.0)):
    """You are a careful assistant that summarizes text in one line. You are a careful assistant that summarizes
    Running summary: {{summary}}
    Next part: {{text}}
    New summary: {{new_summary}}"""


def _states(vm: P.VirtualMachine) -> dict[str, str]:
    return {v["id"]: v["state"] for v in vm.inspect()["variables"]}


def test_import_parrot_does_not_import_jax() -> None:
    code = ("import sys, parrot; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'flax', 'fastapi', 'uvicorn', 'torch')]; print(heavy); assert not heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_decorator_reads_docstring_and_annotations() -> None:
    assert refine.template.startswith("You are") and "\n    " not in refine.template  # dedented
    assert refine.outputs == ["new_summary"]
    with pytest.raises(TypeError, match="annotated"):
        @P.semantic_function
        def bad(x: str, y: P.Output):
            """{{x}} {{y}}"""
    with pytest.raises(Exception, match="max_tokens"):
        P.Output(max_tokens=0)
    with pytest.raises(Exception, match="no VirtualMachine"):
        summarize("outside any vm")


def test_call_then_get(vm: P.VirtualMachine) -> None:
    out = summarize("the cat sat on the mat")
    assert isinstance(out, P.SemanticVariable) and out.name == "summary"
    text = out.get(timeout=60)
    assert isinstance(text, str) and text == out.get()
    assert _states(vm)[out.id] == "ready"


def test_chain_is_lazy_and_runs_server_side(vm: P.VirtualMachine) -> None:
    parts = ["first part of the story", "second part", "third and final part"]
    t = time.perf_counter()
    running = summarize(parts[0])
    for part in parts[1:]:
        running = refine(running, part)  # a variable bound as input: no client-side wait
    submit = time.perf_counter() - t
    states = _states(vm)
    assert states[running.id] == "pending"  # nothing ran: lazy until something is read
    assert "ready" not in {states[v["id"]] for v in vm.inspect()["variables"] if "summary" in v["name"]}
    assert isinstance(running.get(timeout=60), str)
    assert submit < 5
    assert all(s == "ready" for s in _states(vm).values())


def test_inspect_reports_generation_timings(vm: P.VirtualMachine) -> None:
    first = summarize("a short text about cats")
    second = refine(first, "and dogs")
    second.get(timeout=60)
    gens = {g["var_id"]: g for g in vm.inspect()["generations"]}
    assert set(gens) == {first.id, second.id}
    for g in gens.values():
        assert g["output_tokens"] == 5 and g["prompt_tokens"] > g["cached_tokens"] >= 0
        assert 0 < g["ttft_s"] <= g["latency_s"] and g["tpot_s"] > 0
        assert g["latency_s"] >= g["ttft_s"] + 4 * g["tpot_s"] - 1e-6
    assert gens[second.id]["cached_tokens"] > 0  # the shared system prompt text


def test_unshared_prompt_pieces_are_filled_in_one_piece(vm: P.VirtualMachine, server) -> None:
    """Contexts are kept at the global system text and at the whole prompt; the session-local pieces in
    between (the text variable, the constant after it) are one fill, since no other task shares them."""
    summarize("a lone text about owls").get(timeout=60)
    mine = [c for c in server[1].contexts.contexts() if c.session_id == vm.session_id]
    assert len(mine) == 2  # the prompt (forked from the global system text) and the generated output
    prompt_ctx = min(mine, key=lambda c: c.num_tokens)
    assert prompt_ctx.parent is not None and prompt_ctx.parent.session_id is None


def test_map_reduce(vm: P.VirtualMachine, server) -> None:
    @P.semantic_function(template=SYSTEM + "Summaries: {{a}} | {{b}} | {{c}} | {{d}}\nOverall: {{final}}")
    def reduce(a: P.Input, b: P.Input, c: P.Input, d: P.Input, final: FEW): ...

    maps = [summarize(f"chunk {i}: " + "abc " * (i + 1)) for i in range(4)]
    final = reduce(*maps)
    assert isinstance(final.get(criteria="throughput", timeout=120), str)
    assert all(isinstance(m.get(timeout=5), str) for m in maps)
    assert server[1].contexts.hit_rate > 0  # the shared system prompt was forked, not refilled


def test_aget_with_gather(vm: P.VirtualMachine) -> None:
    outs = [summarize(f"doc number {i}") for i in range(3)]

    async def main() -> list[str]:
        return await asyncio.gather(*(o.aget(timeout=60) for o in outs))

    texts = asyncio.run(main())
    assert texts == [o.get() for o in outs]


def test_stream_equals_content(vm: P.VirtualMachine) -> None:
    @P.semantic_function(template=SYSTEM + "Go: {{y}}")
    def go(y: P.Output(max_tokens=8, ignore_eos=True)): ...

    a, b = go(), go()
    streamed = "".join(a.stream())
    fresh = P.VirtualMachine(vm.url)  # a second view of the same variable, so get asks the server
    fresh.session_id, fresh._client, fresh._token = vm.session_id, vm._client, vm._token
    assert streamed == P.SemanticVariable(fresh, a.id, "y").get()

    async def astream() -> str:
        return "".join([d async for d in b.astream()])

    assert asyncio.run(astream()) == P.SemanticVariable(fresh, b.id, "y").get()


def test_native_transform_in_a_chain(vm: P.VirtualMachine) -> None:
    @P.native_function("upper")
    def shout(text: P.Input): ...

    @P.native_function("split", sep=" ", maxsplit=1)
    def head_rest(text: P.Input, head: P.Output, rest: P.Output): ...

    first = summarize("some words here")
    loud = shout(first)  # generation -> transform -> generation, all in the server's graph
    last = refine(loud, "more")
    assert _states(vm)[loud.id] == "pending"
    assert isinstance(last.get(timeout=60), str)
    assert loud.get() == first.get().upper()
    joined = P.transform("join", {"sep": "+"}, a="x", b=first)
    assert joined.get(timeout=10) == "x+" + first.get()
    head, rest = head_rest("alpha beta gamma")
    assert (head.get(timeout=10), rest.get(timeout=10)) == ("alpha", "beta gamma")
    v = vm.variable("given")
    trimmed = P.transform("strip", text=v)
    v.set("  hi  ")
    assert trimmed.get(timeout=10) == "hi"


def test_errors(vm: P.VirtualMachine) -> None:
    @P.semantic_function(template="Hi {{x")
    def broken(x: P.Output): ...

    with pytest.raises(InvalidRequestError):
        broken()  # raised when the call is submitted
    with pytest.raises(InvalidRequestError, match="unknown transform"):
        P.transform("eval", text="1+1")

    @P.semantic_function(template="x" * 600 + " {{y}}")  # beyond the context, known once the call runs
    def too_long(y: P.Output(max_tokens=8)): ...

    failed = too_long()
    with pytest.raises(P.VariableFailedError, match="maximum length"):
        failed.get(timeout=60)
    downstream = refine(failed, "more")
    with pytest.raises(P.VariableFailedError):
        downstream.get(timeout=30)
    with pytest.raises(P.VariableFailedError):
        "".join(downstream.stream())

    pending = vm.variable("p")
    with pytest.raises(P.VariableTimeoutError):
        pending.get(timeout=0.2)
    with pytest.raises(TimeoutError):  # also a builtin TimeoutError
        pending.get(timeout=0.2)
    pending.set("x")
    with pytest.raises(ConflictError):
        pending.set("y")
    with pytest.raises(NotFoundError):
        P.SemanticVariable(vm, "no-such-var", "n").get(timeout=1)


def test_session_scope_and_auth(server) -> None:
    url = server[0]
    with P.VirtualMachine(url) as a, P.VirtualMachine(url) as b:
        assert P.current_vm() is b
        va = a.variable("secret", "42")
        with pytest.raises(NotFoundError):  # another session's variable
            P.SemanticVariable(b, va.id, "secret").get(timeout=1)
        b._client.headers["Authorization"] = f"Bearer {a._token}"
        with pytest.raises(P.AuthError):
            b.inspect()
        b._client.headers["Authorization"] = f"Bearer {b._token}"
        sid = a.session_id
    assert sid not in server[1].sessions  # deleted on exit
    with pytest.raises(Exception, match="no VirtualMachine"):
        P.current_vm()
    vm = P.VirtualMachine(url).open()
    try:
        out = summarize("explicit vm", vm=vm)
        assert isinstance(out.get(timeout=60), str)
    finally:
        vm.close()
    with pytest.raises(P.ServerError, match="cannot reach"):
        P.VirtualMachine(f"http://127.0.0.1:{free_port()}").open()


def test_async_session(server) -> None:
    async def main() -> tuple[str, str]:
        async with P.VirtualMachine(server[0]) as vm:
            assert P.current_vm() is vm
            out = summarize("async text")
            failed = refine(vm.variable("never set"), "x")
            with pytest.raises(P.VariableTimeoutError):
                await failed.aget(timeout=0.2)
            return await out.aget(timeout=60), "".join([d async for d in out.astream()])

    text, streamed = asyncio.run(main())
    assert text == streamed  # astream of a variable already read yields its value


def test_virtual_machines_share_one_tls_context(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a VirtualMachine (its sync and asyncio clients) does not load the TLS trust store again: an app
    server opening one per user request pays for it once."""
    import ssl

    from parrot.frontend import sdk

    loaded: list[object] = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: loaded.append(a or k) or real(*a, **k))
    sdk._tls.cache_clear()

    async def main() -> None:
        for _ in range(3):
            vm = P.VirtualMachine(server[0])
            await asyncio.to_thread(vm.open)
            vm._async()
            await vm.aclose()

    asyncio.run(main())
    assert len(loaded) == 1


def test_a_limit_raises_rate_limit_error_with_the_servers_retry_after() -> None:
    import httpx

    from parrot.errors import RateLimitError
    from parrot.frontend.sdk import _check

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/session")
    with pytest.raises(RateLimitError) as info:
        _check(httpx.Response(429, headers={"Retry-After": "3"}, json={"detail": "at most 2 sessions"},
                              request=request))
    assert info.value.retry_after == 3.0 and "at most 2 sessions (HTTP 429" in str(info.value)
    with pytest.raises(P.ServerError):
        _check(httpx.Response(503, json={"detail": "no engine"}, request=request))


def test_activations_are_per_thread_and_task() -> None:
    """`activate()` / `deactivate()` of one VM from two threads (or tasks) in any order: each undoes its own
    (a token reset in another context was a ValueError)."""
    import threading

    vm = P.VirtualMachine("http://127.0.0.1:1")
    a_on, b_on, a_done, seen, errors = (threading.Event(), threading.Event(), threading.Event(), {}, [])

    def a() -> None:
        try:
            vm.activate()
            a_on.set()
            b_on.wait(5)
            seen["a"] = P.current_vm()
            vm.deactivate()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        a_done.set()

    def b() -> None:
        try:
            a_on.wait(5)
            vm.activate()
            b_on.set()
            a_done.wait(5)
            seen["b"] = P.current_vm()
            vm.deactivate()
            seen["b after"] = _current_vm_or_none()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and seen == {"a": vm, "b": vm, "b after": None}

    async def tasks() -> None:
        async def one(first: bool) -> None:
            vm.activate()
            await asyncio.sleep(0.01 if first else 0.02)
            assert P.current_vm() is vm
            vm.deactivate()
            assert _current_vm_or_none() is None

        await asyncio.gather(one(True), one(False))

    asyncio.run(tasks())
    other = P.VirtualMachine("http://127.0.0.1:2")
    vm.activate()
    other.activate()
    vm.deactivate()  # out of order: `other` stays current, and undoing it leaves none
    assert P.current_vm() is other
    other.deactivate()
    assert _current_vm_or_none() is None


def _current_vm_or_none() -> P.VirtualMachine | None:
    try:
        return P.current_vm()
    except ParrotError:
        return None


def test_semantic_function_takes_its_settings_with_the_function_and_refuses_its_calls_keywords() -> None:
    def ask(q: P.Input, a: P.Output):
        """Docstring {{q}} {{a}}"""

    f = P.semantic_function(ask, template="Template {{q}} {{a}}", output_criteria="latency", models=["m"])
    assert (f.template, f.output_criteria, f.models) == ("Template {{q}} {{a}}", "latency", ["m"])
    for name in ("vm", "output_criteria"):
        fn = eval(f"lambda {name}, a: None", {})  # noqa: S307 - a function with that parameter name
        fn.__annotations__ = {name: P.Input, "a": P.Output}
        fn.__doc__ = "{{" + name + "}} {{a}}"
        with pytest.raises(TypeError, match=f"parameter {name!r} is a name its calls take"):
            P.semantic_function(fn)


def test_get_with_timeout_zero_answers_at_once(vm: P.VirtualMachine) -> None:
    x = vm.variable("x", "ready text")
    assert x.get(timeout=0) == "ready text"
    pending = vm.variable("pending")
    with pytest.raises(VariableTimeoutError):
        pending.get(timeout=0)


def test_close_while_another_thread_waits_fails_its_get_as_session_ended(server) -> None:
    import threading

    vm = P.VirtualMachine(server[0], timeout=60).open()
    pending = vm.variable("pending")
    got: list[BaseException] = []
    t = threading.Thread(target=lambda: got.append(_raised(pending.get)))
    t.start()
    time.sleep(0.5)
    vm.close()
    t.join(30)
    assert len(got) == 1 and isinstance(got[0], VariableFailedError) and "session ended" in str(got[0]), got


def _raised(fn) -> BaseException | None:  # noqa: ANN001
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_a_vm_with_a_cache_salt_opens_a_salted_session(server) -> None:
    from parrot.serve.contexts import salt_digest

    url, core = server
    with P.VirtualMachine(url, timeout=60, cache_salt="tenant-a") as salted, P.VirtualMachine(url, timeout=60) as plain:
        assert core.sessions[salted.session_id].salt == salt_digest("tenant-a") != "tenant-a"  # a digest, kept
        assert core.sessions[plain.session_id].salt is None
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        P.VirtualMachine(url, timeout=60, cache_salt="").open()
