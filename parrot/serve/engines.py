"""Engines as the serve layer sees them: one `EngineClient` interface, an `EngineManager` that tracks them.

`EngineClient` has two implementations: `HttpEngineClient` (a remote `parrot engine` process, the routes
of docs/engine-api.md) and `LocalEngineClient` (an engine object in this process, no HTTP hop). Both raise
the same errors (`parrot.errors`), recognised by their stable `code` (the engine's HTTP error bodies and
SSE error events carry it), so a caller can tell "the request is bad" from "the engine is gone, run it
elsewhere":

  NotFoundError          not_found: unknown context or parent (404)
  InvalidRequestError    invalid_request: bad tokens, too long, bad sampling, malformed request (400, 422, 4xx)
  ConflictError          conflict: freeing a context a running primitive uses (409)
  AbortedError           aborted: the primitive was aborted before it finished (499)
  KVCacheFullError       kv_cache_full (an EngineOverloadedError): the engine is alive but its KV cache cannot
                         hold the work (507): retry later or elsewhere
  EngineUnavailableError engine_unavailable: the engine is unreachable, timed out, answered 5xx or nonsense, or
                         its loop is dead
  GenerationFailedError  generation_failed: the engine failed this one generation mid-stream (it serves on)

`EngineManager` holds the engines by name: remote engines register and heartbeat (through
`engine_routes(manager)`, mounted by the frontend); engines added with `register(client)` are pinged.
A monitor task marks engines dead when they go silent and calls the `on_engine_dead` callbacks once
per death, so the scheduler can re-dispatch their unfinished work and the context manager can drop
their contexts.

This module never imports JAX or `parrot.engine`: the local client takes an already built engine.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import httpx
from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ValidationError

from parrot.errors import (
    AbortedError,
    ConflictError,
    EngineError,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerationFailedError,
    InvalidRequestError,
    KVCacheFullError,
    NotFoundError,
    ParrotError,
    code_of,
    error_for_code,
)
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
from parrot.sse import sse_lines

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)


__all__ = ["EngineClient", "EngineManager", "EngineOverloadedError", "EngineUnavailableError", "HttpEngineClient",
           "KVCacheFullError", "LocalEngineClient", "engine_routes"]


# ---- the interface ------------------------------------------------------------------------------------
class EngineClient(abc.ABC):
    """One engine's primitives, asyncio. See the module docstring for the errors they raise."""

    name: str
    url: str | None  # None: in this process
    model: str
    max_context_len: int
    max_batch_size: int | None = None  # sequences per step, when the engine says (its capacity)
    # True: primitives handed over one after the other (send_fill, then any primitive) reach the engine in that
    # order, so a primitive forking a context may be sent before the fill making it is done (the engine runs
    # primitives on one context in order). False (HTTP: requests may overtake each other): await each fill.
    ordered: bool = False
    # what the engine reported when its client was made, if it did: the manager's runtime info until the first
    # ping or heartbeat (so /health says warming_up, not ok, for an engine that has just started)
    initial_runtime: RuntimeInfo | None = None

    @abc.abstractmethod
    async def fill(self, req: FillRequest) -> FillResponse: ...

    def send_fill(self, req: FillRequest) -> asyncio.Future[FillResponse]:
        """Hand the fill over now; the future gives its response (or raises its error)."""
        return asyncio.ensure_future(self.fill(req))

    @abc.abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    @abc.abstractmethod
    def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """StreamChunks as tokens are generated; the last carries `finish_reason`."""

    @abc.abstractmethod
    async def free_context(self, context_id: str) -> FreeContextResponse: ...

    @abc.abstractmethod
    async def ping(self) -> RuntimeInfo:
        """The engine's runtime info; raises EngineUnavailableError when it cannot serve."""

    @property
    def stopped_for_good(self) -> bool:
        """The engine can never serve again (an in-process engine whose loop ended); a remote engine may always
        come back and register."""
        return False

    async def abort(self, context_id: str) -> bool:
        """Abort the queued or running primitive on `context_id` (its client went away): True when one was
        aborted (it then fails with AbortedError). Engines without abort answer False."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the client's resources (not the engine's)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, url={self.url!r}, model={self.model!r})"


# ---- local: an engine object in this process -----------------------------------------------------------
class LocalEngine(Protocol):
    """What LocalEngineClient needs of an engine (parrot.engine.engine.LLMEngine has it)."""

    name: str

    async def fill(self, req: FillRequest) -> FillResponse: ...

    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]: ...

    async def free_context(self, context_id: str) -> FreeContextResponse: ...

    def ping(self) -> RuntimeInfo: ...

    @property
    def alive(self) -> bool: ...

    @property
    def death_reason(self) -> str | None: ...


_PASS_THROUGH = (NotFoundError, InvalidRequestError, ConflictError, AbortedError, EngineError)


class LocalEngineClient(EngineClient):
    """An engine embedded in the serve process: its asyncio methods, errors mapped like the HTTP client's
    (by their `code`). `close()` leaves the engine running unless `owns_engine`."""

    def __init__(self, engine: LocalEngine, name: str = "local", *, owns_engine: bool = False) -> None:
        self.engine = engine
        self.name = name
        self.url = None
        info = self.initial_runtime = engine.ping()
        self.model = info.model
        self.max_context_len = info.max_context_len
        self.max_batch_size = info.max_batch_size or getattr(getattr(engine, "cfg", None), "max_batch_size", None)
        self.owns_engine = owns_engine

    def _map(self, exc: BaseException) -> BaseException:
        if isinstance(exc, _PASS_THROUGH):
            return exc
        code = code_of(exc)
        if code == EngineUnavailableError.code or not self.engine.alive:
            reason = self.engine.death_reason or str(exc) or type(exc).__name__
            return EngineUnavailableError(f"engine {self.name!r} is not running ({reason})", self.name)
        if code in (KVCacheFullError.code, EngineOverloadedError.code):
            return error_for_code(code, f"engine {self.name!r}: {exc}", self.name)
        if code == AbortedError.code:
            return AbortedError(str(exc))
        return exc

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        """Re-raise the engine's own errors as the client-side errors callers act on."""
        try:
            yield
        except Exception as exc:
            mapped = self._map(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    async def fill(self, req: FillRequest) -> FillResponse:
        with self._mapped():
            return await self.engine.fill(req)

    @property
    def ordered(self) -> bool:  # type: ignore[override]
        return hasattr(self.engine, "fill_future")

    def send_fill(self, req: FillRequest) -> asyncio.Future[FillResponse]:
        """Queued on the engine before this returns (its thread takes primitives in the order given)."""
        if not self.ordered:
            return super().send_fill(req)
        with self._mapped():
            done = self.engine.fill_future(req)

        async def response() -> FillResponse:
            with self._mapped():
                return await asyncio.wrap_future(done)
        return asyncio.ensure_future(response())

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        with self._mapped():
            return await self.engine.generate(req)

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        with self._mapped():
            async for chunk in self.engine.generate_stream(req):
                yield chunk

    async def free_context(self, context_id: str) -> FreeContextResponse:
        with self._mapped():
            return await self.engine.free_context(context_id)

    async def abort(self, context_id: str) -> bool:
        abort = getattr(self.engine, "abort", None)
        if abort is None:  # an engine without the primitive
            return False
        with self._mapped():
            return bool(await abort(context_id))

    @property
    def stopped_for_good(self) -> bool:
        return not self.engine.alive

    async def ping(self) -> RuntimeInfo:
        if not self.engine.alive:
            raise EngineUnavailableError(f"engine {self.name!r} is not running ({self.engine.death_reason})",
                                         self.name)
        with self._mapped():
            return self.engine.ping()

    async def close(self) -> None:
        if self.owns_engine:
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None:
                await asyncio.to_thread(shutdown)


# ---- remote: a `parrot engine` over HTTP ----------------------------------------------------------------
def _sse_data(lines: list[str]) -> str:
    return "\n".join(line[5:].removeprefix(" ") for line in lines)


class HttpEngineClient(EngineClient):
    """A remote engine's routes (docs/engine-api.md) over one pooled httpx.AsyncClient.

    `timeout` bounds each read (a whole non-streamed Generate; a gap between stream events); `connect_timeout`
    connecting; `ping_timeout` a ping. A timed-out primitive may still run on the engine."""

    def __init__(self, name: str, url: str, model: str, max_context_len: int, *, timeout: float = 600.0,
                 connect_timeout: float = 5.0, ping_timeout: float = 5.0, max_batch_size: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.model = model
        self.max_context_len = max_context_len
        self.max_batch_size = max_batch_size
        self.ping_timeout = ping_timeout
        self._http = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout, connect=connect_timeout),
                                       transport=transport, trust_env=False)

    @classmethod
    def from_registration(cls, reg: EngineRegistration, **kw: object) -> HttpEngineClient:
        kw.setdefault("max_batch_size", reg.max_batch_size)
        return cls(reg.name, reg.url, reg.model, reg.max_context_len, **kw)  # type: ignore[arg-type]

    # ---- errors -----------------------------------------------------------------------------------
    def _unavailable(self, what: str) -> EngineUnavailableError:
        return EngineUnavailableError(f"engine {self.name!r} at {self.url}: {what}", self.name)

    def _transport_error(self, exc: Exception) -> EngineUnavailableError:
        if isinstance(exc, httpx.TimeoutException):
            return self._unavailable(f"timed out ({type(exc).__name__})")
        detail = str(exc) or type(exc).__name__
        return self._unavailable(f"cannot reach it ({type(exc).__name__}: {detail})")

    def _status_error(self, status: int, body: bytes) -> ParrotError:
        """The error of a non-200 answer: by its `code` (engines send one), else by status (older engines)."""
        code: str | None = None
        try:
            answer = json.loads(body)
            detail = answer["detail"]
            detail = detail if isinstance(detail, str) else json.dumps(detail)
            code = answer.get("code") if isinstance(answer.get("code"), str) else None
        except (ValueError, KeyError, TypeError, AttributeError):  # not an engine's answer: its body stays in the log
            # (a client must not read whatever a registered URL answers, e.g. an internal service's page)
            log.warning("engine %r at %s answered HTTP %d, not an engine's error: %r", self.name, self.url, status,
                        body[:500])
            detail = f"HTTP {status}, not an engine's answer (the serve core's log has it)"
        if code is None:
            code = {404: NotFoundError.code, 409: ConflictError.code, 499: AbortedError.code,
                    507: KVCacheFullError.code}.get(status)
        return self._coded_error(code, detail, status)

    def _coded_error(self, code: str | None, detail: str, status: int | None = None) -> ParrotError:
        if code in (KVCacheFullError.code, EngineOverloadedError.code):
            return error_for_code(code, f"engine {self.name!r}: {detail}", self.name)
        if code == GenerationFailedError.code:  # this primitive failed (its grammar rejected a token); it serves on
            return GenerationFailedError(f"engine {self.name!r}: generation failed: {detail}")
        if code == EngineUnavailableError.code or (status is not None and status >= 500):
            return self._unavailable(f"HTTP {status}: {detail}" if status is not None else detail)
        if code in (NotFoundError.code, ConflictError.code, AbortedError.code, InvalidRequestError.code):
            return error_for_code(code, detail)
        if status is None:  # an error event mid-stream: this generation failed, the engine serves on
            return GenerationFailedError(f"engine {self.name!r}: generation failed: {detail}")
        return InvalidRequestError(detail)  # 400, 422 and any other 4xx

    def _is_transport(self, exc: Exception) -> bool:
        # a closed client (the engine re-registered and this client was replaced) is as good as unreachable
        return isinstance(exc, httpx.TransportError) or (isinstance(exc, RuntimeError) and self._http.is_closed)

    def _parse(self, model: type[_M], content: bytes) -> _M:
        try:
            return model.model_validate_json(content)
        except ValidationError as exc:
            raise self._unavailable(f"malformed answer: {exc.errors()[0].get('msg', exc)}") from exc

    async def _request(self, method: str, path: str, model: type[_M], body: BaseModel | None = None,
                       timeout: float | None = None) -> _M:
        kw: dict[str, object] = {}
        if body is not None:
            kw["json"] = body.model_dump(mode="json")
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            r = await self._http.request(method, path, **kw)  # type: ignore[arg-type]
        except Exception as exc:
            if self._is_transport(exc):
                raise self._transport_error(exc) from exc
            raise
        if r.status_code != 200:
            raise self._status_error(r.status_code, r.content)
        return self._parse(model, r.content)

    # ---- primitives -------------------------------------------------------------------------------
    async def fill(self, req: FillRequest) -> FillResponse:
        return await self._request("POST", "/fill", FillResponse, req)

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        return await self._request("POST", "/generate", GenerateResponse, req)

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        try:
            async with self._http.stream("POST", "/generate_stream", json=req.model_dump(mode="json")) as r:
                if r.status_code != 200:
                    raise self._status_error(r.status_code, await r.aread())
                event, data = "message", []
                async for line in sse_lines(r.aiter_text()):
                    if line:
                        if line.startswith("data:"):
                            data.append(line)
                        elif line.startswith("event:"):
                            event = line[6:].strip()
                        continue  # comments and other fields are ignored
                    if not data:
                        continue
                    payload, kind = _sse_data(data), event
                    event, data = "message", []
                    if kind == "error":
                        raise self._stream_error(payload)
                    if payload == "[DONE]":
                        return
                    yield self._parse(StreamChunk, payload.encode())
        except ParrotError:
            raise
        except Exception as exc:
            if self._is_transport(exc):
                raise self._transport_error(exc) from exc
            raise
        raise self._unavailable("the stream ended without [DONE]")

    def _stream_error(self, payload: str) -> ParrotError:
        """An error after the stream started (`event: error`, `{"detail", "code"}`), by its code: a dead engine
        loop is EngineUnavailableError, a full KV cache KVCacheFullError, an abort AbortedError; anything
        else fails only this generation (GenerationFailedError; the engine serves on)."""
        code: str | None = None
        try:
            answer = json.loads(payload)
            detail = str(answer["detail"])
            code = answer.get("code") if isinstance(answer.get("code"), str) else None
        except (ValueError, KeyError, TypeError, AttributeError):
            detail = payload
        return self._coded_error(code, detail)

    async def free_context(self, context_id: str) -> FreeContextResponse:
        return await self._request("POST", "/free_context", FreeContextResponse,
                                   FreeContextRequest(context_id=context_id))

    async def abort(self, context_id: str) -> bool:
        try:
            answer = await self._request("POST", "/abort", AbortResponse, AbortRequest(context_id=context_id),
                                         timeout=self.ping_timeout)
        except NotFoundError:  # an engine without the /abort route
            return False
        return answer.aborted

    async def ping(self) -> RuntimeInfo:
        """GET /health (503 when the engine loop is dead), then GET /ping."""
        try:
            r = await self._http.get("/health", timeout=self.ping_timeout)
        except Exception as exc:
            if self._is_transport(exc):
                raise self._transport_error(exc) from exc
            raise
        if r.status_code != 200:
            err = self._status_error(r.status_code, r.content)
            raise err if isinstance(err, EngineUnavailableError) else self._unavailable(str(err))
        return await self._request("GET", "/ping", RuntimeInfo, timeout=self.ping_timeout)

    async def close(self) -> None:
        await self._http.aclose()


# ---- the manager --------------------------------------------------------------------------------------
DeadCallback = Callable[[str], Awaitable[None]]
BackCallback = Callable[..., Awaitable[None]]  # (name, same_run=bool)


@dataclass
class _Entry:
    client: EngineClient
    heartbeats: bool  # True: the engine heartbeats to us; False: the monitor pings it
    incarnation: int
    last_seen: float  # time.monotonic() of the last heartbeat / successful ping / registration
    live: bool = True
    reason: str | None = None  # why it is dead
    runtime: RuntimeInfo | None = None


@dataclass(frozen=True)
class EngineStatus:
    name: str
    url: str | None
    model: str
    max_context_len: int
    live: bool
    reason: str | None
    incarnation: int  # bumps on every (re-)registration of the name: an engine restart loses its contexts
    seconds_since_seen: float
    runtime: RuntimeInfo | None


class EngineManager:
    """Engines by name, their liveness and latest runtime info. Use it from one asyncio event loop.

    Liveness: a remote engine (`register_remote`) must heartbeat; any other (`register`) is pinged by the
    monitor every `interval`. An engine is dead when nothing arrived for `dead_after` seconds, when a local
    ping says its loop is dead, or when a caller reports it (`mark_dead`). Each live -> dead transition, and
    a re-registration of a live engine (it restarted: its contexts are gone), calls every `on_engine_dead`
    callback once, as tasks. A dead engine that heartbeats (and answers a ping) or pings fine is live again,
    and so is one that registers again: either calls every `on_engine_back` callback (with whether it is the
    same run, which may still hold what it held). A remote engine dead for `forget_after` seconds is forgotten
    (its client closed, `on_engine_forgotten` called): names of engines long gone do not pile up.
    """

    def __init__(self, *, client_kwargs: dict[str, object] | None = None) -> None:
        self._entries: dict[str, _Entry] = {}
        self._callbacks: list[DeadCallback] = []
        self._back_callbacks: list[BackCallback] = []
        self._forgotten_callbacks: list[DeadCallback] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._incarnations = 0
        self.client_kwargs = client_kwargs or {}  # for the HttpEngineClients register_remote builds

    # ---- membership -----------------------------------------------------------------------------
    def register(self, client: EngineClient, *, heartbeats: bool = False) -> EngineClient:
        """Add (or replace) an engine under `client.name`. Without `heartbeats` the monitor pings it."""
        now = time.monotonic()
        old = self._entries.get(client.name)
        self._incarnations += 1
        self._entries[client.name] = _Entry(client, heartbeats, self._incarnations, now,
                                            runtime=client.initial_runtime)
        if old is not None:
            if old.client is not client:
                self._spawn(old.client.close())
            if old.live:
                log.warning("engine %r registered again while live: treating its previous run as dead", client.name)
                self._fire(client.name)
            self._fire_back(client.name, False)
        log.info("engine %r registered (%s, model %s, max context %d)", client.name, client.url or "in process",
                 client.model, client.max_context_len)
        return client

    def register_remote(self, reg: EngineRegistration) -> HttpEngineClient:
        """A `parrot engine` announced itself: a new HttpEngineClient for it, replacing any remote one under its
        name (ConflictError for the name of an engine inside this process: that one is never replaced)."""
        old = self._entries.get(reg.name)
        if old is not None and old.client.url is None:
            raise ConflictError(f"engine name {reg.name!r} is this server's own engine: register under another name")
        client = HttpEngineClient.from_registration(reg, **self.client_kwargs)
        self.register(client, heartbeats=True)
        if reg.runtime is not None:  # until its first heartbeat: /health says warming_up from the start
            self._entries[reg.name].runtime = reg.runtime
        return client

    async def unregister(self, name: str) -> None:
        """Forget an engine (no callback) and close its client."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            await entry.client.close()

    def get(self, name: str) -> EngineClient:
        return self._entry(name).client

    def __contains__(self, name: object) -> bool:
        """Whether an engine is registered under `name` (live or not)."""
        return name in self._entries

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise NotFoundError(f"engine {name!r} is not registered")
        return entry

    # ---- liveness -------------------------------------------------------------------------------
    async def heartbeat(self, hb: EngineHeartbeat) -> None:
        """Record a heartbeat. Unknown engine: NotFoundError (the engine registers again on the 404). A dead
        engine is live again once it also answers a ping (a heartbeat alone does not prove its loop runs)."""
        entry = self._entry(hb.name)
        if entry.client.url is None:
            raise ConflictError(f"engine name {hb.name!r} is this server's own engine: it sends no heartbeats")
        if hb.url is None or hb.url.rstrip("/") != entry.client.url.rstrip("/"):
            raise ConflictError(f"engine name {hb.name!r} is registered to the engine at {entry.client.url} now (a "
                                f"later registration under the same name); this engine at {hb.url} is not used")
        entry.runtime = hb.runtime
        entry.last_seen = time.monotonic()
        if not entry.live:
            try:
                await entry.client.ping()
            except ParrotError as exc:
                log.debug("engine %r heartbeats but does not answer a ping: %s", hb.name, exc)
                return
            if self._entries.get(hb.name) is entry and not entry.live:
                self._revive(hb.name, entry, "heartbeats again")

    def mark_dead(self, name: str, reason: str, client: EngineClient | None = None) -> bool:
        """A caller saw EngineUnavailableError: mark the engine dead now. Given `client`, only if it is still
        the engine's current client (not an older run's). True when this call made it dead."""
        entry = self._entries.get(name)
        if entry is None or (client is not None and entry.client is not client) or not entry.live:
            return False
        entry.live, entry.reason = False, reason
        log.warning("engine %r is dead: %s", name, reason)
        self._fire(name)
        return True

    def _revive(self, name: str, entry: _Entry, how: str) -> None:
        log.warning("engine %r is live again (%s; it was dead: %s)", name, how, entry.reason)
        entry.live, entry.reason = True, None
        self._fire_back(name, True)

    def _forget(self, name: str, entry: _Entry) -> None:
        log.info("engine %r forgotten: dead since %.0f s (%s)", name, time.monotonic() - entry.last_seen,
                 entry.reason)
        del self._entries[name]
        self._spawn(entry.client.close())
        for cb in self._forgotten_callbacks:
            self._spawn(self._run_callback(cb, name))

    def is_live(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.live

    def live_engines(self) -> list[EngineClient]:
        return [e.client for e in self._entries.values() if e.live]

    def stranded(self) -> dict[str, str] | None:
        """{name: why} when engines are registered and every one has stopped for good (in-process engines whose
        loops ended: nothing can take work again), else None. A liveness slip (a missed ping) is not enough."""
        entries = self._entries.items()
        if entries and all(e.client.stopped_for_good for _, e in entries):
            return {name: e.reason or "stopped" for name, e in entries}
        return None

    def max_context_len(self, live_only: bool = True) -> int | None:
        """The context length every prompt must fit in: the shortest of the live engines' (`live_only` False:
        of the registered ones where none is live); None without engines."""
        limits = [e.max_context_len for e in self.live_engines()]
        if not limits and not live_only:
            limits = [e.client.max_context_len for e in self._entries.values()]
        return min(limits) if limits else None

    def max_sequence_len(self, live_only: bool = True) -> int | None:
        """The most tokens a sequence may hold: `max_context_len`, or fewer where a live engine's whole KV pool
        holds fewer (`min_kv_tokens`); what the OpenAI API reports as max_model_len."""
        limit, pool = self.max_context_len(live_only), self.min_kv_tokens()
        return limit if limit is None or pool is None else min(limit, pool)

    def min_kv_tokens(self) -> int | None:
        """The fewest tokens a live engine's whole KV pool holds (from its latest runtime info); None unknown."""
        pools = [info.total_pages * info.page_size for e in self.live_engines()
                 if (info := self.runtime(e.name)) is not None]
        return min(pools) if pools else None

    def runtime(self, name: str) -> RuntimeInfo | None:
        """The latest runtime info (heartbeat or ping) of an engine; None before the first."""
        return self._entry(name).runtime

    def status(self) -> list[EngineStatus]:
        now = time.monotonic()
        return [EngineStatus(name, e.client.url, e.client.model, e.client.max_context_len, e.live, e.reason,
                             e.incarnation, now - e.last_seen, e.runtime) for name, e in self._entries.items()]

    # ---- death callbacks ------------------------------------------------------------------------
    def on_engine_dead(self, callback: DeadCallback) -> DeadCallback:
        """`await callback(name)` once per death of an engine (usable as a decorator)."""
        self._callbacks.append(callback)
        return callback

    def on_engine_back(self, callback: BackCallback) -> BackCallback:
        """`await callback(name, same_run)` when a dead engine is live again (`same_run`: the run that was taken
        for dead, which may still hold its contexts) or an engine registers again (a new run: they are gone)."""
        self._back_callbacks.append(callback)
        return callback

    def on_engine_forgotten(self, callback: DeadCallback) -> DeadCallback:
        """`await callback(name)` when an engine dead for `forget_after` seconds is forgotten."""
        self._forgotten_callbacks.append(callback)
        return callback

    def _fire(self, name: str) -> None:
        for cb in self._callbacks:
            self._spawn(self._run_callback(cb, name))

    def _fire_back(self, name: str, same_run: bool) -> None:
        for cb in self._back_callbacks:
            self._spawn(self._run_callback(functools.partial(cb, same_run=same_run), name))

    async def _run_callback(self, cb: DeadCallback, name: str) -> None:
        try:
            await cb(name)
        except Exception:
            log.exception("on_engine_dead callback %r failed for engine %r", cb, name)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the event loop: nothing to run it on
            log.error("EngineManager used outside its event loop; dropping %s", coro)
            coro.close()
            return
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the callbacks (and client closes) started so far."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- the monitor ----------------------------------------------------------------------------
    async def check(self, dead_after: float = 5.0, forget_after: float | None = None) -> None:
        """One monitor sweep: ping the pinged engines (concurrently), then mark the silent ones dead, and forget
        the remote ones dead for `forget_after` seconds."""
        pinged = [(name, e) for name, e in self._entries.items() if not e.heartbeats]
        results = await asyncio.gather(*(self._ping(e, dead_after) for _, e in pinged), return_exceptions=True)
        for (name, entry), res in zip(pinged, results, strict=True):
            if self._entries.get(name) is not entry:
                continue  # replaced meanwhile
            if isinstance(res, RuntimeInfo):
                entry.runtime, entry.last_seen = res, time.monotonic()
                if not entry.live:
                    self._revive(name, entry, "answers pings again")
            elif isinstance(res, EngineUnavailableError) and entry.client.url is None:
                self.mark_dead(name, str(res))  # an in-process engine that says it is dead is dead
            elif isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res
        now = time.monotonic()
        for name, entry in list(self._entries.items()):
            if entry.live and now - entry.last_seen > dead_after:
                what = "heartbeat" if entry.heartbeats else "successful ping"
                self.mark_dead(name, f"no {what} for {now - entry.last_seen:.1f}s")
            elif forget_after is not None and not entry.live and entry.heartbeats and \
                    now - entry.last_seen > forget_after:
                self._forget(name, entry)  # (one that comes back registers again, on its heartbeat's 404)

    async def _ping(self, entry: _Entry, timeout: float) -> RuntimeInfo:
        return await asyncio.wait_for(entry.client.ping(), timeout)

    def start_monitor(self, interval: float = 1.0, dead_after: float = 5.0,
                      forget_after: float | None = None) -> asyncio.Task[None]:
        """Run `check(dead_after, forget_after)` every `interval` seconds in a background task (in the running
        loop)."""
        if self._monitor is not None and not self._monitor.done():
            return self._monitor
        # a restarted monitor must not count the time it was off against anyone
        now = time.monotonic()
        for entry in self._entries.values():
            entry.last_seen = max(entry.last_seen, now - interval)

        async def loop() -> None:
            while True:
                try:
                    await self.check(dead_after, forget_after)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("engine monitor sweep failed")
                await asyncio.sleep(interval)

        self._monitor = asyncio.get_running_loop().create_task(loop(), name="parrot-engine-monitor")
        return self._monitor

    async def stop_monitor(self) -> None:
        task, self._monitor = self._monitor, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Stop the monitor, close every client, wait for running callbacks."""
        await self.stop_monitor()
        entries, self._entries = list(self._entries.values()), {}
        await asyncio.gather(*(e.client.close() for e in entries), return_exceptions=True)
        await self.drain()


# ---- the serve core's side of registration ------------------------------------------------------------
def engine_routes(manager: EngineManager, prefix: str = "/v1/engine") -> APIRouter:
    """`POST {prefix}/register` (EngineRegistration) and `POST {prefix}/heartbeat` (EngineHeartbeat; 404 for
    an unknown engine, which makes it register again), for the frontend to mount."""
    router = APIRouter(prefix=prefix, tags=["engines"])

    @router.post("/register")
    async def register(reg: EngineRegistration) -> dict[str, str]:
        try:
            manager.register_remote(reg)
        except ConflictError as exc:
            raise HTTPException(409, str(exc)) from exc
        return {"status": "ok"}

    @router.post("/heartbeat")
    async def heartbeat(hb: EngineHeartbeat) -> dict[str, str]:
        try:
            await manager.heartbeat(hb)
        except NotFoundError as exc:
            raise HTTPException(404, str(exc)) from exc
        except ConflictError as exc:
            raise HTTPException(409, str(exc)) from exc
        return {"status": "ok"}

    return router
