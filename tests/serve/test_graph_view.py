"""graph_view: the live view of a session's DAG (what /ui draws): layers of deep graphs, criteria kept."""

from __future__ import annotations

import asyncio

from parrot.config import ServeConfig
from parrot.protocol import StreamChunk
from parrot.serve.graph_view import session_graph
from tests.serve.test_core import ScriptedEngine, _call, _upper, make_core


def test_a_chain_thousands_of_calls_deep_has_its_layers() -> None:
    """Layers are walked without recursion: 1,500 native calls in a chain (the view keeps the last 1,024), then a
    semantic call reading the end (a RecursionError, a 500 of the view, from about 900 on before)."""
    core = make_core(config=ServeConfig(model="tiny", max_pending_calls_per_session=2000,
                                        max_vars_per_session=4000))
    s = core.create_session()
    var = core.create_var(s, "x", None).id
    for _ in range(1500):
        var = _upper(core, s, var)
    _call(core, s, "End {{u}} {{a}}", u=var)
    layers = {n["id"]: n["layer"] for n in session_graph(core, s)["nodes"]}
    assert layers[f"var:{var}"] == 2048 and max(layers.values()) == 2050  # each kept call and its output a layer


def test_a_finished_call_keeps_its_criterion_and_a_read_native_shows_its_own() -> None:
    async def run() -> list[dict]:
        core = make_core(config=ServeConfig(model="tiny"))
        core.engines.register(ScriptedEngine([]))
        await core.start()
        try:
            s = core.create_session()
            a = _call(core, s, "Go {{a}}")
            await core.get_var(s, _upper(core, s, a), "throughput", 10)
            return [n for n in session_graph(core, s)["nodes"] if n["kind"] == "call"]
        finally:
            await core.stop()

    calls = {n["call_type"]: n for n in asyncio.run(run())}
    assert calls["semantic"]["state"] == "done" and calls["semantic"]["needed"]
    assert calls["semantic"]["criterion"] == "throughput" and calls["native"]["criterion"] == "throughput"


class _PausingEngine(ScriptedEngine):
    """Streams one token, then waits for `go` before the last chunk."""

    def __init__(self) -> None:
        super().__init__([])
        self.go = asyncio.Event()

    async def generate_stream(self, req):  # noqa: ANN001, ANN201
        yield StreamChunk(token_id=65, text="A")
        await self.go.wait()
        yield StreamChunk(token_id=66, text="B", finish_reason="length")


def test_a_generating_call_shows_its_tokens_and_first_token_time() -> None:
    async def run() -> dict:
        core = make_core(config=ServeConfig(model="tiny"))
        engine = _PausingEngine()
        core.engines.register(engine)
        await core.start()
        try:
            s = core.create_session()
            a = _call(core, s, "Go {{a}}")
            reader = asyncio.ensure_future(core.get_var(s, a, "latency", 10))
            for _ in range(200):
                await asyncio.sleep(0.01)
                (node,) = [n for n in session_graph(core, s)["nodes"] if n["kind"] == "call"]
                if node["tokens"]["output"]:
                    break
            engine.go.set()
            assert await reader == "AB"
            return node
        finally:
            await core.stop()

    node = asyncio.run(run())
    assert node["state"] == "running" and node["detail"] == "generating"
    assert node["tokens"]["output"] == 1 and node["tokens"]["prompt"] > 0 and node["timings"]["ttft_s"] is not None


def test_layers_of_a_diamond_follow_the_longest_path() -> None:
    """x -> P1 -> v1 -> P2 -> v2, and C reading v1 and v2: C is past v2, not beside it (siblings on the walk's
    stack are not ancestors)."""
    from parrot.serve.graph_view import _layers

    nodes = [{"id": i} for i in ("call:C", "var:v1", "var:v2", "call:P1", "call:P2", "var:x", "var:out")]
    _layers(nodes, {"call:P1": ["x"], "call:P2": ["v1"], "call:C": ["v1", "v2"]},
            {"v1": "call:P1", "v2": "call:P2", "out": "call:C"})
    assert {n["id"]: n["layer"] for n in nodes} == {"var:x": 0, "call:P1": 1, "var:v1": 2, "call:P2": 3, "var:v2": 4,
                                                    "call:C": 5, "var:out": 6}



def test_a_call_that_failed_on_its_engine_keeps_its_time() -> None:
    from parrot.errors import GenerationFailedError, ParrotError

    async def run() -> dict:
        core = make_core(config=ServeConfig(model="tiny"))
        core.engines.register(ScriptedEngine([GenerationFailedError("the engine broke")]))
        await core.start()
        try:
            s = core.create_session()
            a = _call(core, s, "Go {{a}}")
            try:
                await core.get_var(s, a, "latency", 10)
            except ParrotError:
                pass
            (node,) = [n for n in session_graph(core, s)["nodes"] if n["kind"] == "call"]
            return node
        finally:
            await core.stop()

    node = asyncio.run(run())
    assert node["state"] == "failed" and "the engine broke" in node["error"]
    assert node["timings"]["total_s"] is not None and node["timings"]["queue_s"] is not None
