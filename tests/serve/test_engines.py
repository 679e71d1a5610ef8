"""EngineClient (local and HTTP) and EngineManager against real parts: the tiny random model in an LLMEngine,
served by a real uvicorn engine server on loopback, registering with a real FastAPI serve-core app that
mounts `engine_routes(manager)`. A few error paths a live server cannot produce on demand (500, 507, a
read timeout, a broken SSE stream) use httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from parrot.engine.engine import LLMEngine
from parrot.engine.http_api import EngineServer
from parrot.errors import (
    AbortedError,
    ConflictError,
    GenerationFailedError,
    InvalidRequestError,
    KVCacheFullError,
    NotFoundError,
    ParrotError,
)
from parrot.protocol import (
    EngineHeartbeat,
    EngineRegistration,
    FillRequest,
    FreeContextResponse,
    GenerateRequest,
    RuntimeInfo,
    SamplingParams,
    StreamChunk,
)
from parrot.serve.engines import (
    EngineClient,
    EngineManager,
    EngineOverloadedError,
    EngineUnavailableError,
    HttpEngineClient,
    LocalEngineClient,
    engine_routes,
)
from tests.conftest import grammar_rejects, tiny_engine_config, tiny_model
from tests.servers import free_port

PROMPT = list(b"The quick brown fox jumps over the lazy dog.")


async def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `cond()` held."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    eng = LLMEngine(tiny_model(), tiny_engine_config(precompile=False)).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: LLMEngine) -> Iterator[EngineServer]:
    srv = EngineServer(engine, "127.0.0.1", free_port(), log_level="warning").start_in_thread()
    yield srv
    srv.stop()


def http_client(server: EngineServer, **kw: object) -> HttpEngineClient:
    return HttpEngineClient("remote", server.url, "tiny-random", 512, **kw)  # type: ignore[arg-type]


def make_client(kind: str, engine: LLMEngine, server: EngineServer) -> EngineClient:
    return LocalEngineClient(engine) if kind == "local" else http_client(server)


# ---- clients ------------------------------------------------------------------------------------------
def test_http_and_local_clients_agree(engine: LLMEngine, server: EngineServer) -> None:
    async def session(client: EngineClient, tag: str) -> dict[str, object]:
        base, a, b = f"{tag}-base", f"{tag}-a", f"{tag}-b"
        out: dict[str, object] = {}
        out["fill"] = (await client.fill(FillRequest(context_id=base, token_ids=PROMPT))).num_tokens
        gen = await client.generate(GenerateRequest(context_id=a, parent_context_id=base, sampling=greedy(12)))
        out["gen"] = (gen.token_ids, gen.text, gen.finish_reason, gen.num_tokens)
        chunks = [c async for c in client.generate_stream(
            GenerateRequest(context_id=b, parent_context_id=base, sampling=greedy(12)))]
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        out["stream"] = ([c.token_id for c in chunks if c.token_id is not None], "".join(c.text for c in chunks))
        more = await client.fill(FillRequest(context_id=a, token_ids=[65, 66]))
        out["continue"] = more.num_tokens
        info = await client.ping()
        out["ping"] = (info.model, info.max_context_len, info.page_size, info.total_pages)
        assert info.num_contexts >= 3
        out["free"] = [(await client.free_context(c)).freed_pages for c in (b, a, base)]
        return out

    async def main() -> tuple[dict[str, object], dict[str, object]]:
        local, remote = LocalEngineClient(engine), http_client(server)
        assert (local.url, local.model, local.max_context_len) == (None, "tiny-random", 512)
        assert remote.url == server.url
        try:
            return await session(local, "loc"), await session(remote, "rem")
        finally:
            await asyncio.gather(local.close(), remote.close())

    loc, rem = asyncio.run(main())
    assert loc == rem
    tokens, text, reason, num = loc["gen"]  # type: ignore[misc]
    assert len(tokens) == 12 and reason == "length" and num == len(PROMPT) + 12
    assert loc["stream"] == (tokens, text)  # the stream gives what /generate gives
    assert loc["continue"] == len(PROMPT) + 14
    assert engine.ping().num_contexts == 0  # everything freed


def test_a_stream_of_any_text_reaches_the_core(engine: LLMEngine, server: EngineServer) -> None:
    """Text holding U+2028, U+2029 or U+0085 (raw in the engine's JSON; line breaks to str.splitlines and to
    httpx's iter_lines, not to SSE) streams whole from an engine over HTTP."""
    odd = "\u2028\u2029\u0085"

    async def main() -> list[StreamChunk]:
        client = http_client(server)
        try:
            await client.fill(FillRequest(context_id="odd-base", token_ids=PROMPT))
            sampling = SamplingParams(max_tokens=12, temperature=0.0, regex=f"[{odd}]{{3}}")
            chunks = [c async for c in client.generate_stream(
                GenerateRequest(context_id="odd", parent_context_id="odd-base", sampling=sampling))]
            for ctx in ("odd", "odd-base"):
                await client.free_context(ctx)
            return chunks
        finally:
            await client.close()

    chunks = asyncio.run(main())
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and len(text) == 3 and set(text) <= set("\u2028\u2029\u0085")


@pytest.mark.parametrize("kind", ["local", "http"])
def test_errors_map_to_parrot_errors(kind: str, engine: LLMEngine, server: EngineServer) -> None:
    async def main() -> None:
        client = make_client(kind, engine, server)
        try:
            with pytest.raises(NotFoundError, match="nope"):
                await client.generate(GenerateRequest(context_id="nope", sampling=greedy(2)))
            with pytest.raises(NotFoundError, match="nope"):
                [c async for c in client.generate_stream(GenerateRequest(context_id="nope", sampling=greedy(2)))]
            with pytest.raises(NotFoundError, match="nope"):
                await client.free_context("nope")
            with pytest.raises(NotFoundError, match="ghost"):
                await client.fill(FillRequest(context_id=f"{kind}-child", parent_context_id="ghost", token_ids=[1]))
            with pytest.raises(InvalidRequestError, match="vocabulary"):
                await client.fill(FillRequest(context_id=f"{kind}-bad", token_ids=[1, 999]))
            # freeing a context that a running generate uses
            await client.fill(FillRequest(context_id=f"{kind}-busy", token_ids=PROMPT))
            gen = asyncio.create_task(client.generate(GenerateRequest(context_id=f"{kind}-busy",
                                                                      sampling=greedy(300))))
            await wait_for(lambda: engine.ping().running > 0, 10, "the generate to run")
            with pytest.raises(ConflictError, match="in use"):
                await client.free_context(f"{kind}-busy")
            await gen
            await client.free_context(f"{kind}-busy")
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["local", "http"])
@pytest.mark.parametrize("at", [0, 2])
def test_a_token_the_grammar_rejects_is_a_generation_failure(kind: str, at: int, engine: LLMEngine,
                                                             server: EngineServer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A generate whose grammar rejects its token (the first: before the stream starts; a later one: mid
    stream) is a GenerationFailedError over both clients, never EngineUnavailableError (which would make
    the serve core take the engine for dead)."""
    grammar_rejects(monkeypatch, at)

    async def main() -> None:
        client = make_client(kind, engine, server)
        base = f"{kind}-rej{at}"
        sp = SamplingParams(max_tokens=8, regex="[a-y]{8}")
        try:
            await client.fill(FillRequest(context_id=base, token_ids=PROMPT))
            with pytest.raises(GenerationFailedError, match="left its grammar at token"):
                await client.generate(GenerateRequest(context_id=f"{base}-a", parent_context_id=base, sampling=sp))
            chunks: list[StreamChunk] = []
            with pytest.raises(GenerationFailedError, match="left its grammar at token"):
                async for c in client.generate_stream(GenerateRequest(context_id=f"{base}-b", parent_context_id=base,
                                                                      sampling=sp)):
                    chunks.append(c)
            assert len([c for c in chunks if c.token_id is not None]) == at
            assert (await client.ping()).running == 0
        finally:
            await client.close()

    asyncio.run(main())


def test_http_validation_error_is_invalid_request(server: EngineServer) -> None:
    async def main() -> None:
        client = http_client(server)
        try:
            bad = FillRequest.model_construct(context_id="", parent_context_id=None, token_ids=[1])  # 422
            with pytest.raises(InvalidRequestError, match="context_id"):
                await client.fill(bad)
        finally:
            await client.close()

    asyncio.run(main())


def test_unreachable_or_stopped_engine_is_unavailable(engine: LLMEngine) -> None:
    async def main() -> None:
        srv = await asyncio.to_thread(
            EngineServer(engine, "127.0.0.1", free_port(), log_level="warning").start_in_thread)
        client = HttpEngineClient("short-lived", srv.url, "tiny-random", 512, connect_timeout=2.0)
        try:
            assert (await client.ping()).model == "tiny-random"
            await asyncio.to_thread(srv.stop)
            with pytest.raises(EngineUnavailableError, match="short-lived") as err:
                await client.ping()
            assert err.value.engine == "short-lived"
            with pytest.raises(EngineUnavailableError):
                await client.fill(FillRequest(context_id="x", token_ids=[1]))
            with pytest.raises(EngineUnavailableError):
                [c async for c in client.generate_stream(GenerateRequest(context_id="x"))]
            with pytest.raises(EngineUnavailableError):
                await client.free_context("x")
        finally:
            await client.close()
        with pytest.raises(EngineUnavailableError):  # a closed client (replaced on re-registration)
            await client.ping()

    asyncio.run(main())


def test_dead_engine_is_unavailable_locally_and_over_http() -> None:
    eng = LLMEngine(tiny_model(), tiny_engine_config(precompile=False)).start()
    srv = EngineServer(eng, "127.0.0.1", free_port(), log_level="warning").start_in_thread()

    async def main() -> None:
        local, remote = LocalEngineClient(eng, name="doomed"), HttpEngineClient("doomed", srv.url, "tiny-random", 512)
        try:
            await local.ping()
            await remote.ping()
            await asyncio.to_thread(eng.shutdown)
            for client in (local, remote):
                with pytest.raises(EngineUnavailableError, match="not running"):
                    await client.ping()
                with pytest.raises(EngineUnavailableError, match="not running"):  # 503 over HTTP
                    await client.fill(FillRequest(context_id="x", token_ids=[1]))
                with pytest.raises(EngineUnavailableError):
                    [c async for c in client.generate_stream(GenerateRequest(context_id="x"))]
        finally:
            await asyncio.gather(local.close(), remote.close())

    try:
        asyncio.run(main())
    finally:
        srv.stop()
        eng.shutdown()


def mock_client(handler: Callable[[httpx.Request], httpx.Response], **kw: object) -> HttpEngineClient:
    return HttpEngineClient("mock", "http://engine.invalid", "m", 64, transport=httpx.MockTransport(handler),
                            **kw)  # type: ignore[arg-type]


def test_status_and_stream_edge_cases() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        ctx = json.loads(req.content).get("context_id") if req.content else None
        if ctx == "507":
            return httpx.Response(507, json={"detail": "KV cache is full: 9 page(s) needed, 1 free"})
        if ctx == "500":
            return httpx.Response(500, json={"detail": "internal error: boom"})
        if ctx == "405":
            return httpx.Response(405, text="Method Not Allowed")
        if ctx == "timeout":
            raise httpx.ReadTimeout("read timed out", request=req)
        if ctx == "junk":
            return httpx.Response(200, json={"nothing": "useful"})
        first = 'data: {"token_id": 5, "text": "a"}\n\n'
        sse = {
            "midway": first + 'event: error\ndata: {"detail": "the engine stopped (x)", '
                                '"code": "engine_unavailable"}\n\n',
            "full": first + 'event: error\ndata: {"detail": "2 page(s) needed, 0 free", "code": "kv_cache_full"}\n\n',
            # recognised by code, not by message text
            "textonly": first + 'event: error\ndata: {"detail": "KV cache is full: no code"}\n\n',
            "aborted": first + 'event: error\ndata: {"detail": "aborted", "code": "aborted"}\n\n',
            "cut": first,
            "ok": ': comment\n\n' + first + 'data: {"text": "b", "finish_reason": "length"}\n\ndata: [DONE]\n\n',
        }[ctx]
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def stream(client: HttpEngineClient, ctx: str) -> list[StreamChunk]:
        return [c async for c in client.generate_stream(GenerateRequest(context_id=ctx))]

    async def main() -> None:
        client = mock_client(handler)
        with pytest.raises(EngineOverloadedError, match="KV cache is full"):
            await client.fill(FillRequest(context_id="507", token_ids=[1]))
        with pytest.raises(EngineUnavailableError, match="HTTP 500: internal error: boom"):
            await client.generate(GenerateRequest(context_id="500"))
        with pytest.raises(InvalidRequestError, match="HTTP 405, not an engine's answer") as info:
            await client.generate(GenerateRequest(context_id="405"))
        assert "Method Not Allowed" not in str(info.value)  # what a URL answered is not echoed to clients
        with pytest.raises(EngineUnavailableError, match="timed out"):
            await client.generate(GenerateRequest(context_id="timeout"))
        with pytest.raises(EngineUnavailableError, match="malformed answer"):
            await client.generate(GenerateRequest(context_id="junk"))
        assert await stream(client, "ok") == [StreamChunk(token_id=5, text="a"),
                                              StreamChunk(text="b", finish_reason="length")]
        with pytest.raises(EngineUnavailableError, match="the engine stopped"):
            await stream(client, "midway")
        with pytest.raises(KVCacheFullError) as full:
            await stream(client, "full")
        assert full.value.code == "kv_cache_full" and full.value.engine == "mock"
        with pytest.raises(GenerationFailedError, match="no code"):
            await stream(client, "textonly")
        with pytest.raises(AbortedError):
            await stream(client, "aborted")
        with pytest.raises(EngineUnavailableError, match="without \\[DONE\\]"):
            await stream(client, "cut")
        await client.close()

    asyncio.run(main())


# ---- manager ------------------------------------------------------------------------------------------
class FakeClient(EngineClient):
    """Only ping matters to the manager."""

    def __init__(self, name: str, url: str | None = "http://fake") -> None:
        self.name, self.url, self.model, self.max_context_len = name, url, "m", 64
        self.up = True
        self.closed = False

    async def ping(self) -> RuntimeInfo:
        if not self.up:
            raise EngineUnavailableError("down", self.name)
        return runtime_info()

    async def fill(self, req):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    async def generate(self, req):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    async def generate_stream(self, req) -> AsyncIterator[StreamChunk]:  # type: ignore[no-untyped-def]
        raise NotImplementedError
        yield

    async def free_context(self, context_id: str) -> FreeContextResponse:
        raise NotImplementedError

    async def close(self) -> None:
        self.closed = True


def runtime_info(**kw: object) -> RuntimeInfo:
    base = dict(model="m", max_context_len=64, page_size=16, total_pages=8, free_pages=8, num_contexts=0,
                num_cached_tokens=0, running=0, waiting=0, recent_step_ms=0.0, steps=0, shape_misses=0,
                preemptions=0, evictions=0, cascade_steps=0)
    return RuntimeInfo(**{**base, **kw})  # type: ignore[arg-type]


def test_manager_bookkeeping(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        mgr = EngineManager()
        deaths: list[str] = []

        @mgr.on_engine_dead
        async def dead(name: str) -> None:
            deaths.append(name)

        with pytest.raises(NotFoundError):
            await mgr.heartbeat(EngineHeartbeat(name="e", runtime=runtime_info()))
        with pytest.raises(NotFoundError):
            mgr.runtime("e")
        a = FakeClient("a")
        mgr.register(a, heartbeats=True)
        assert mgr.runtime("a") is None and mgr.live_engines() == [a]
        await mgr.heartbeat(EngineHeartbeat(name="a", runtime=runtime_info(running=3), url="http://fake"))
        assert mgr.runtime("a").running == 3  # type: ignore[union-attr]

        # a caller saw EngineUnavailableError; a stale client's report is ignored; repeated reports count once
        assert not mgr.mark_dead("a", "stale", client=FakeClient("a"))
        assert mgr.mark_dead("a", "connection refused", client=a) and not mgr.mark_dead("a", "again")
        await mgr.drain()
        assert deaths == ["a"] and mgr.live_engines() == [] and not mgr.is_live("a")

        # heartbeats again, but a ping fails: still dead; once it answers, live again (logged)
        a.up = False
        await mgr.heartbeat(EngineHeartbeat(name="a", runtime=runtime_info(), url="http://fake"))
        assert not mgr.is_live("a")
        a.up = True
        with caplog.at_level(logging.WARNING, logger="parrot.serve.engines"):
            await mgr.heartbeat(EngineHeartbeat(name="a", runtime=runtime_info(), url="http://fake"))
        assert mgr.is_live("a") and "live again" in caplog.text

        # re-registration of a live engine (it restarted): the old run is dead, the old client closed
        inc = mgr.status()[0].incarnation
        b = mgr.register_remote(EngineRegistration(name="a", url="http://127.0.0.1:1", model="m", max_context_len=64))
        await mgr.drain()
        assert deaths == ["a", "a"] and a.closed and mgr.get("a") is b and mgr.is_live("a")
        assert mgr.status()[0].incarnation > inc and mgr.runtime("a") is None

        # a pinged engine: the monitor pings, records runtime, marks it dead when pings fail too long
        c = FakeClient("c", url=None)
        mgr.register(c)
        await mgr.check(dead_after=5.0)
        assert mgr.runtime("c") is not None
        c.up = False  # an in-process engine that says it is dead is dead at once
        await mgr.check(dead_after=5.0)
        await mgr.drain()
        assert not mgr.is_live("c") and deaths.count("c") == 1
        await mgr.close()

    asyncio.run(main())


def test_engines_back_and_engines_long_dead_are_told_and_forgotten() -> None:
    """`on_engine_back` says whether the same run is back (it may still hold its contexts) or a new one
    registered; a remote engine dead for `forget_after` seconds is forgotten (client closed, callback), so the
    names of engines long gone do not pile up; its next heartbeat is a 404 (it registers again). In-process
    engines are kept."""
    async def main() -> None:
        mgr = EngineManager()
        back: list[tuple[str, bool]] = []
        forgotten: list[str] = []

        @mgr.on_engine_back
        async def on_back(name: str, same_run: bool) -> None:
            back.append((name, same_run))

        @mgr.on_engine_forgotten
        async def on_forgotten(name: str) -> None:
            forgotten.append(name)

        a, local = FakeClient("a"), FakeClient("local", url=None)
        mgr.register(a, heartbeats=True)
        mgr.register(local)
        mgr.mark_dead("a", "slow")
        await mgr.heartbeat(EngineHeartbeat(name="a", runtime=runtime_info(), url="http://fake"))  # a slip: same run
        mgr.register_remote(EngineRegistration(name="a", url="http://127.0.0.1:1", model="m", max_context_len=64))
        await mgr.drain()
        assert back == [("a", True), ("a", False)] and "a" in mgr

        mgr.mark_dead("a", "gone")
        local.up = False
        await mgr.check(dead_after=5.0, forget_after=60.0)
        assert "a" in mgr and forgotten == []  # not long enough
        for name in ("a", "local"):
            mgr._entries[name].last_seen -= 61
        await mgr.check(dead_after=5.0, forget_after=60.0)
        await mgr.drain()
        assert forgotten == ["a"] and "a" not in mgr and "local" in mgr
        assert [s.name for s in mgr.status()] == ["local"]
        with pytest.raises(NotFoundError):
            await mgr.heartbeat(EngineHeartbeat(name="a", runtime=runtime_info(), url="http://fake"))
        await mgr.close()

    asyncio.run(main())


class ServeCore:
    """The serve core's engine routes on a real uvicorn server, in the test's event loop."""

    def __init__(self, manager: EngineManager) -> None:
        app = FastAPI()
        app.include_router(engine_routes(manager))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ServeCore:
        self.task = asyncio.create_task(self.server.serve())
        await wait_for(lambda: self.server.started, 10, "the serve core to start")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self.task is not None
        await self.task


def test_manager_with_real_engine_servers(engine: LLMEngine) -> None:
    dead_after = 1.0

    def engine_server(core: ServeCore) -> EngineServer:
        return EngineServer(engine, "127.0.0.1", free_port(), serve_core_url=core.url, name="e1",
                            heartbeat_interval=0.2, log_level="warning")

    async def main() -> None:
        mgr = EngineManager()
        deaths: list[tuple[str, float]] = []

        @mgr.on_engine_dead
        async def dead(name: str) -> None:
            deaths.append((name, time.monotonic()))

        async with ServeCore(mgr) as core:
            mgr.start_monitor(interval=0.1, dead_after=dead_after)
            srv = await asyncio.to_thread(engine_server(core).start_in_thread)
            await wait_for(lambda: mgr.is_live("e1") and mgr.runtime("e1") is not None, 10, "registration")
            client = mgr.get("e1")
            assert isinstance(client, HttpEngineClient) and client.url == srv.url
            assert (client.model, client.max_context_len) == ("tiny-random", 512)
            # the registered client works
            await client.fill(FillRequest(context_id="m1", token_ids=PROMPT))
            out = await client.generate(GenerateRequest(context_id="m1", sampling=greedy(4)))
            assert len(out.token_ids) == 4
            await client.free_context("m1")
            # heartbeats keep it live well past dead_after
            await asyncio.sleep(2 * dead_after)
            assert mgr.is_live("e1") and deaths == []
            assert mgr.status()[0].seconds_since_seen < dead_after

            # stop the engine server: dead within ~dead_after, one callback
            await asyncio.to_thread(srv.stop)
            stopped = time.monotonic()
            await wait_for(lambda: not mgr.is_live("e1"), 3 * dead_after, "the engine to be marked dead")
            await wait_for(lambda: len(deaths) == 1, 1, "the callback")
            assert deaths[0][0] == "e1" and deaths[0][1] - stopped < dead_after + 0.6
            assert mgr.live_engines() == [] and "no heartbeat" in (mgr.status()[0].reason or "")
            await asyncio.sleep(dead_after)
            assert len(deaths) == 1  # once per death

            # a new engine server under the same name registers again and is live, no new death
            srv2 = await asyncio.to_thread(engine_server(core).start_in_thread)
            try:
                await wait_for(lambda: mgr.is_live("e1"), 10, "re-registration")
                assert mgr.get("e1").url == srv2.url
                assert (await mgr.get("e1").ping()).model == "tiny-random"
                assert len(deaths) == 1
            finally:
                await asyncio.to_thread(srv2.stop)
            await mgr.close()

    asyncio.run(main())


def test_manager_pings_a_local_engine() -> None:
    eng = LLMEngine(tiny_model(), tiny_engine_config(precompile=False)).start()

    async def main() -> None:
        mgr = EngineManager()
        deaths: list[str] = []

        async def dead(name: str) -> None:
            deaths.append(name)

        mgr.on_engine_dead(dead)
        mgr.register(LocalEngineClient(eng, name="in-proc", owns_engine=True))
        mgr.start_monitor(interval=0.05, dead_after=1.0)
        await wait_for(lambda: mgr.runtime("in-proc") is not None, 2, "a ping")
        assert mgr.is_live("in-proc") and mgr.stranded() is None
        mgr.mark_dead("in-proc", "a missed ping")  # a liveness slip: its loop runs, it comes back
        assert mgr.stranded() is None
        await wait_for(lambda: mgr.is_live("in-proc"), 2, "the slip to heal")
        deaths.clear()
        await asyncio.to_thread(eng.shutdown)
        took = await wait_for(lambda: not mgr.is_live("in-proc"), 2, "the local engine to be marked dead")
        assert took < 0.5  # a local engine that is not running is dead at the next ping
        assert set(mgr.stranded() or {}) == {"in-proc"}  # it stopped for good: nothing can take work
        await asyncio.sleep(0.3)
        await mgr.drain()
        assert deaths == ["in-proc"]
        with pytest.raises(ParrotError):
            await mgr.get("in-proc").fill(FillRequest(context_id="x", token_ids=[1]))
        await mgr.close()

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_an_engine_replaced_under_its_name_stops_keeping_the_name_alive(caplog: pytest.LogCaptureFixture) -> None:
    """Two engines given one --name: the later registration wins, and the earlier engine's heartbeats, which kept
    the name live after the later one died, are refused (409): its link ends, with an error in its log."""
    from parrot.engine.http_api import serve_core_link

    async def main() -> None:
        mgr = EngineManager()
        async with ServeCore(mgr) as core:
            first = EngineRegistration(name="e", url="http://127.0.0.1:1", model="m", max_context_len=64)
            second = first.model_copy(update={"url": "http://127.0.0.1:2"})
            with caplog.at_level(logging.ERROR, logger="parrot.engine.http_api"):
                old = asyncio.create_task(serve_core_link(core.url, first, runtime_info, interval=0.05))
                await wait_for(lambda: any(e.name == "e" for e in mgr.status()) and mgr.runtime("e") is not None, 10,
                               "the first registration")
                new = asyncio.create_task(serve_core_link(core.url, second, runtime_info, interval=0.05))
                await wait_for(lambda: old.done(), 10, "the replaced engine's link to end")
            assert mgr.get("e").url == "http://127.0.0.1:2" and "stops its heartbeats" in caplog.text
            await asyncio.sleep(0.2)
            assert not new.done()  # the current one goes on
            new.cancel()
            # a heartbeat that names no URL, or another, could be anyone's (a client spoofing "draining"): refused
            for url in (None, "http://127.0.0.1:1"):
                with pytest.raises(ConflictError):
                    await mgr.heartbeat(EngineHeartbeat(name="e", runtime=runtime_info(), url=url))
        await mgr.close()

    asyncio.run(main())


def test_a_registration_brings_the_engines_warm_up_at_once() -> None:
    """/health says warming_up from an engine's registration on, not "ok" until its first heartbeat."""
    async def main() -> None:
        mgr = EngineManager()
        warming = runtime_info(compiled_shapes=3, total_shapes=40)
        mgr.register_remote(EngineRegistration(name="w", url="http://127.0.0.1:1", model="m", max_context_len=64,
                                               runtime=warming))
        assert mgr.runtime("w") == warming
        await mgr.close()

    asyncio.run(main())


def test_a_stopping_engine_says_it_is_draining_before_its_socket_closes(engine: LLMEngine) -> None:
    """A graceful stop (SIGTERM) of a `parrot engine`: a heartbeat saying `draining` goes to the serve core first,
    so the core places no new work there (it did until the engine stopped answering) while what runs finishes."""
    from parrot.serve.core import ParrotServeCore

    async def main() -> None:
        mgr = EngineManager()
        async with ServeCore(mgr) as core:
            srv = await asyncio.to_thread(EngineServer(engine, "127.0.0.1", free_port(), serve_core_url=core.url,
                                                       name="d1", heartbeat_interval=0.2).start_in_thread)
            await wait_for(lambda: any(e.name == "d1" for e in mgr.status()) and mgr.runtime("d1") is not None, 10,
                           "registration")
            assert not mgr.runtime("d1").draining
            serve = ParrotServeCore()
            serve.engines = mgr
            assert [v.name for v in serve._engine_views()] == ["d1"]
            await asyncio.to_thread(srv.stop)
            assert mgr.runtime("d1").draining  # told before the socket closed
            assert serve._engine_views() == []  # nothing new is placed there
        await mgr.close()

    asyncio.run(main())
