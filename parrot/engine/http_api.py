"""The engine's HTTP face: /fill /generate /generate_stream /abort /free_context /ping /health over one LLMEngine.

Bodies are the pydantic schemas of `parrot.protocol`. Every error answers `{"detail": "<message>", "code":
"<code>"}` with the stable codes of `parrot.errors`:
  InvalidRequestError 400 invalid_request, NotFoundError 404 not_found, ConflictError 409 conflict,
  request validation 422 invalid_request, GenerationFailedError 422 generation_failed (this primitive
  failed, e.g. its grammar rejected a token; the engine serves on), AbortedError 499 aborted, OutOfPages
  507 kv_cache_full (the KV pool is full; free contexts or retry), EngineDeadError 503 engine_unavailable.
`/generate_stream` is Server-Sent Events: `data: <StreamChunk json>` per chunk, the last chunk carries
`finish_reason`, then `data: [DONE]`. Errors known before the first chunk (unknown context, bad tokens,
...) are plain HTTP errors; an error after the stream started is sent as `event: error` with
`data: {"detail": ..., "code": ...}` and the stream ends without `[DONE]`. A client that disconnects from
`/generate_stream` aborts its generation (when the engine has `abort`), freeing the engine for others.

`run_engine_server` loads a model, starts the engine and serves it with uvicorn; given a serve core URL it
registers there and sends a heartbeat about every second (`serve_core_link`), retrying forever when the
serve core is unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.addresses import local_url
from parrot.config import EngineConfig
from parrot.engine.engine import EngineDeadError, LLMEngine
from parrot.engine.kv_cache import OutOfPages
from parrot.engine.multihost import Mirror
from parrot.engine.structured import Constraint
from parrot.errors import (
    AbortedError,
    ConflictError,
    GenerationFailedError,
    InvalidRequestError,
    ModelLoadError,
    NotFoundError,
    ParrotError,
    code_of,
)
from parrot.header_deadline import HeaderDeadlineH11
from parrot.interrupts import stop_if_interrupted
from parrot.protocol import (
    AbortRequest,
    AbortResponse,
    EngineHeartbeat,
    EngineRegistration,
    FillRequest,
    FillResponse,
    FreeContextRequest,
    FreeContextResponse,
    GenerateRequest,
    GenerateResponse,
    RuntimeInfo,
    StreamChunk,
)

log = logging.getLogger(__name__)

# most specific first
_ERROR_STATUS: list[tuple[type[ParrotError], int]] = [
    (EngineDeadError, 503),
    (OutOfPages, 507),
    (AbortedError, 499),
    (NotFoundError, 404),
    (ConflictError, 409),
    (InvalidRequestError, 400),
    (ModelLoadError, 400),
    # this one primitive failed (e.g. its grammar rejected the sampled token); the engine serves on: not a 5xx,
    # which tells a serve core the engine is gone
    (GenerationFailedError, 422),
]


def error_status(exc: ParrotError) -> int:
    for cls, status in _ERROR_STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def _detail(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _code(exc: BaseException) -> str:
    """The error's stable code; the engine's own classes map onto the shared ones."""
    if isinstance(exc, EngineDeadError):
        return "engine_unavailable"
    if isinstance(exc, OutOfPages):
        return "kv_cache_full"
    return code_of(exc)


_STATUS_CODES = {400: "invalid_request", 404: "not_found", 405: "invalid_request", 409: "conflict",
                 413: "invalid_request", 422: "invalid_request", 503: "engine_unavailable"}


def _error_body(detail: str, code: str) -> dict[str, str]:
    return {"detail": detail, "code": code}


def _loc_part(x: object) -> str:
    s = str(x)
    return s if s and s.isprintable() and s.strip() == s else repr(x)  # make '' and odd keys visible


def _validation_message(exc: RequestValidationError) -> str:
    """One line per pydantic error: `sampling.top_p: Input should be greater than 0`."""
    parts = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        loc = loc[1:] if loc[:1] == ("body",) else loc
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not valid JSON{': ' + reason if reason else ''}")
            continue
        where = ".".join(_loc_part(x) for x in loc)
        msg = err.get("msg", "invalid value")
        if not where and err.get("type") == "missing":
            parts.append("the request needs a JSON body")
            continue
        parts.append(f"{where or 'request body'}: {msg}")
    return "; ".join(parts) or "invalid request"


def _sse(payload: str, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


_END = object()  # end-of-stream marker in a stream's queue


def create_app(engine: LLMEngine) -> FastAPI:
    app = FastAPI(title="Parrot engine", summary="Fill / Generate / FreeContext / Ping on one LLMEngine")
    app.state.engine = engine

    # ---- errors ---------------------------------------------------------------------------------
    @app.exception_handler(ParrotError)
    async def _parrot_error(request: Request, exc: ParrotError) -> JSONResponse:
        status = error_status(exc)
        if status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, status, exc)
        return JSONResponse(_error_body(_detail(exc), _code(exc)), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_error_body(_validation_message(exc), "invalid_request"), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "error")
        return JSONResponse(_error_body(str(exc.detail), code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response, so uvicorn logs the traceback
        return JSONResponse(_error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"),
                            status_code=500)

    # ---- primitives -----------------------------------------------------------------------------
    @app.post("/fill", response_model=FillResponse)
    async def fill(req: FillRequest) -> FillResponse:
        return await engine.fill(req)

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        return await engine.generate(req)

    @app.post("/generate_stream", response_class=StreamingResponse,
              responses={200: {"content": {"text/event-stream": {}},
                               "description": "`data: <StreamChunk json>` events, then `data: [DONE]`"}})
    async def generate_stream(req: GenerateRequest) -> StreamingResponse:
        items = _start_stream(engine, req, await engine.compile_constraint(req))
        first = await items.__anext__()  # errors before the first chunk become plain HTTP errors
        if isinstance(first, BaseException):
            raise first

        async def events() -> AsyncIterator[str]:
            item: object = first
            ended = False
            try:
                while True:
                    if item is _END:
                        ended = True
                        yield _sse("[DONE]")
                        return
                    if isinstance(item, BaseException):
                        ended = True
                        if not isinstance(item, AbortedError):
                            log.warning("generate_stream %s failed mid-stream: %s", req.context_id, item)
                        yield _sse(json.dumps(_error_body(_detail(item), _code(item))), event="error")
                        return
                    assert isinstance(item, StreamChunk)
                    if item.finish_reason is not None:
                        ended = True
                    yield _sse(item.model_dump_json())
                    item = await items.__anext__()
            finally:
                if not ended:  # the client went away mid-stream: stop generating for nobody
                    _abort_later(req.context_id)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    aborts: set[asyncio.Task[None]] = set()

    async def _abort(context_id: str) -> None:
        try:
            await engine.abort(context_id)  # type: ignore[attr-defined]
        except ParrotError as exc:
            log.debug("abort of %s after a disconnect: %s", context_id, exc)

    def _abort_later(context_id: str) -> None:
        if getattr(engine, "abort", None) is None:
            return
        task = asyncio.get_running_loop().create_task(_abort(context_id))
        aborts.add(task)
        task.add_done_callback(aborts.discard)

    @app.post("/abort", response_model=AbortResponse)
    async def abort(req: AbortRequest) -> AbortResponse | JSONResponse:
        """Abort the queued or running primitive on a context; it fails with AbortedError (code aborted)."""
        fn = getattr(engine, "abort", None)
        if fn is None:
            return JSONResponse(_error_body("this engine cannot abort primitives", "not_found"), status_code=404)
        return AbortResponse(context_id=req.context_id, aborted=bool(await fn(req.context_id)))

    @app.post("/free_context", response_model=FreeContextResponse)
    async def free_context(req: FreeContextRequest) -> FreeContextResponse:
        return await engine.free_context(req.context_id)

    # ---- state ----------------------------------------------------------------------------------
    @app.get("/ping", response_model=RuntimeInfo)
    async def ping() -> RuntimeInfo:
        return engine.ping()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            reason = engine.death_reason
            return JSONResponse(_error_body(f"the engine is not running ({reason})", "engine_unavailable"),
                                status_code=503)
        compiled, total = engine.runner.compile_status()
        settings = engine.settings()
        if compiled < total:  # serving already; steps whose shape is not compiled yet wait for it
            return JSONResponse({"status": "warming_up", "compiled_shapes": compiled, "total_shapes": total,
                                 "settings": settings})
        return JSONResponse({"status": "ok", "settings": settings})

    return app


def _start_stream(engine: LLMEngine, req: GenerateRequest, constraint: Constraint | None) -> AsyncIterator[object]:
    """Submit a streaming Generate (submit errors raise here) and return an iterator of its StreamChunks,
    then the exception or `_END`. The engine thread never blocks on or fails because of the consumer: a
    client that went away leaves chunks in an orphaned queue, and an event loop that closed (server
    shutdown) swallows them; the generation itself runs to its end."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[object] = asyncio.Queue()

    def put(item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
            loop.call_soon_threadsafe(q.put_nowait, item)

    fut = engine.generate_future(req, on_chunk=put, constraint=constraint)
    fut.add_done_callback(lambda f: put(f.exception() or _END))

    async def items() -> AsyncIterator[object]:
        while True:
            item = await q.get()
            yield item
            if item is _END or isinstance(item, BaseException):
                return

    return items()


# ---- serve-core link ------------------------------------------------------------------------------
WARN_AFTER_FAILURES = 3  # failed attempts in a row before the link logs a warning (then once per streak)
async def serve_core_link(serve_core_url: str, registration: EngineRegistration, runtime: Callable[[], RuntimeInfo],
                          interval: float = 1.0, timeout: float = 5.0, api_key: str | None = None) -> None:
    """Register with the serve core, then send a heartbeat every `interval` seconds, forever (cancel the task
    to stop). Any failure (unreachable, timeout, non-2xx) is retried after `interval`, and logged as a warning
    once it has failed WARN_AFTER_FAILURES times in a row (a core that stops before its engines is no alarm); a
    heartbeat answered 404 (the serve core forgot us, e.g. it restarted) registers again; one answered 409
    (another engine registered under this name since) ends the link, with an error in the log."""
    base = serve_core_url.rstrip("/")
    registered = False
    failing = 0  # failures in a row: the third is logged as a warning (a blip, e.g. the core stopping first, is not)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None  # a serve core with an API key
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        while True:
            try:
                if not registered:
                    now = registration.model_copy(update={"runtime": runtime()})  # its warm-up so far, at once
                    r = await client.post(f"{base}/v1/engine/register", json=now.model_dump(mode="json"))
                    r.raise_for_status()
                    registered = True
                    log.info("registered engine %r at %s with the serve core %s", registration.name,
                             registration.url, base)
                else:
                    beat = EngineHeartbeat(name=registration.name, runtime=runtime(), url=registration.url)
                    r = await client.post(f"{base}/v1/engine/heartbeat", json=beat.model_dump(mode="json"))
                    if r.status_code == 409:  # another engine registered under this name since: it is that one
                        log.error("the serve core %s no longer uses this engine: %s; this engine stops its "
                                  "heartbeats (give each engine its own --name)", base, _answer_detail(r))
                        return
                    if r.status_code == 404:
                        log.warning("the serve core %s does not know engine %r; registering again", base,
                                    registration.name)
                        registered = False
                        continue
                    r.raise_for_status()
                if failing >= WARN_AFTER_FAILURES:
                    log.info("the serve core %s is reachable again", base)
                failing = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never fatal: the engine keeps serving without a serve core
                what = "register with" if not registered else "send a heartbeat to"
                msg = _describe_http_error(exc)
                failing += 1
                log.log(logging.WARNING if failing == WARN_AFTER_FAILURES else logging.DEBUG,
                        "cannot %s the serve core %s (%s); retrying every %.1fs", what, base, msg, interval)
            await asyncio.sleep(interval)


def _answer_detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text[:200]))
    except ValueError:
        return r.text[:200]


def _describe_http_error(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# ---- serving --------------------------------------------------------------------------------------
class EngineServer:
    """uvicorn serving `create_app(engine)`, plus the serve-core link once the socket is listening.

    `serve()` runs in the caller's event loop; `start_in_thread()` / `stop()` run it in a thread (tests,
    embedding). The engine's lifecycle (start / shutdown) belongs to the caller."""

    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = 9100, *,
                 serve_core_url: str | None = None, name: str | None = None, advertise_url: str | None = None,
                 heartbeat_interval: float = 1.0, log_level: str = "warning",
                 serve_core_api_key: str | None = None, sock: socket.socket | None = None) -> None:
        self.engine = engine
        self.sock = sock  # bound to host:port by the caller (uvicorn listens on it), or None: uvicorn binds
        self.host, self.port = host, port
        self.serve_core_url = serve_core_url
        self.serve_core_api_key = serve_core_api_key
        self.name = name or f"{socket.gethostname()}-{port}"
        self.heartbeat_interval = heartbeat_interval
        self.app = create_app(engine)
        # uvicorn's records go through the process's own log format (`parrot.logs`: text or JSON); a graceful
        # stop lets the requests under way finish (each is bounded by its max_tokens)
        self.config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, log_config=None,
                                     lifespan="off", http=HeaderDeadlineH11)  # slow request heads are cut off
        self.server = uvicorn.Server(self.config)
        self.draining = False  # a graceful stop began: the serve core is told, and places no new work here
        shutdown = self.server.shutdown

        async def say_draining_then_shut_down(sockets: list | None = None) -> None:
            self.draining = True
            await self._tell_draining()
            await shutdown(sockets=sockets)

        self.server.shutdown = say_draining_then_shut_down  # type: ignore[method-assign]
        self._advertise_url = advertise_url
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The URL other processes reach this engine at (for the serve core)."""
        if self._advertise_url:
            return self._advertise_url.rstrip("/")
        return local_url(self.host, self.port)  # a wildcard bind: reached on loopback, on this machine only

    def runtime(self) -> RuntimeInfo:
        """The engine's runtime info, as heartbeats carry it (`draining` once a graceful stop began)."""
        info = self.engine.ping()
        return info.model_copy(update={"draining": True}) if self.draining else info

    async def _tell_draining(self, timeout: float = 2.0) -> None:
        """A heartbeat saying it is stopping, at once, before the socket closes: the serve core places no new work
        here while the requests under way finish (at worst it learns at the next heartbeat, or takes it for dead)."""
        if not self.serve_core_url:
            return
        headers = {"Authorization": f"Bearer {self.serve_core_api_key}"} if self.serve_core_api_key else None
        beat = EngineHeartbeat(name=self.name, runtime=self.runtime(), url=self.url)
        try:
            async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
                await client.post(f"{self.serve_core_url.rstrip('/')}/v1/engine/heartbeat",
                                  json=beat.model_dump(mode="json"))
        except Exception as exc:  # noqa: BLE001 - the core may be gone already: stopping goes on
            log.debug("could not tell the serve core this engine is stopping: %s", exc)

    def registration(self) -> EngineRegistration:
        info = self.engine.ping()
        return EngineRegistration(name=self.name, url=self.url, model=info.model,
                                  max_context_len=info.max_context_len,
                                  max_batch_size=self.engine.cfg.max_batch_size)

    async def serve(self) -> None:
        link: asyncio.Task[None] | None = None
        serving = asyncio.create_task(self.server.serve(sockets=[self.sock] if self.sock is not None else None))
        try:
            if self.serve_core_url:
                while not self.server.started and not serving.done():
                    await asyncio.sleep(0.02)
                if self.server.started:
                    link = asyncio.create_task(serve_core_link(self.serve_core_url, self.registration(),
                                                               self.runtime, self.heartbeat_interval,
                                                               api_key=self.serve_core_api_key))
            await serving
        finally:
            if link is not None:
                link.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await link

    def start_in_thread(self, timeout: float = 30.0) -> EngineServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.serve()), name="parrot-engine-http",
                                        daemon=True)
        self._thread.start()
        for _ in range(int(timeout / 0.02)):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                raise RuntimeError(f"the engine server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        raise TimeoutError(f"the engine server did not start within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)


def run_engine_server(model: str | Any, host: str = "127.0.0.1", port: int = 9100, cfg: EngineConfig | None = None,
                      serve_core_url: str | None = None, *, name: str | None = None,
                      advertise_url: str | None = None, serve_core_api_key: str | None = None,
                      mirror: Mirror | None = None, sock: socket.socket | None = None,
                      log_level: str = "warning") -> None:
    """Load `model` (a name/path for `load_model`, or an already LoadedModel), start an LLMEngine (precompiling
    per `cfg.precompile`) and serve it until interrupted (`mirror`: see LLMEngine; `sock`: a socket already
    bound to host:port, taken before the model loaded; `log_level`: uvicorn's, info adds a line per request)."""
    from parrot.engine.loader import LoadedModel, load_model

    cfg = cfg or EngineConfig()
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    stop_if_interrupted()
    engine = LLMEngine(loaded, cfg, name=str(model) if isinstance(model, str) else None, mirror=mirror)
    engine.start(wait=False)  # answers at once; shapes compile in the background, most needed first
    server = EngineServer(engine, host, port, serve_core_url=serve_core_url, name=name, advertise_url=advertise_url,
                          serve_core_api_key=serve_core_api_key, sock=sock, log_level=log_level)
    log.info("engine %r serving %s at %s", server.name, engine.name, server.url)
    try:
        stop_if_interrupted()
        asyncio.run(server.serve())
    except KeyboardInterrupt:  # uvicorn shut down gracefully on Ctrl-C, then re-raised the signal
        log.info("engine %r stopped", server.name)
    finally:
        engine.shutdown()
