"""The Parrot REST API (sessions, semantic variables, semantic and native calls) over the serve core.

Session-scoped calls carry the session's token: `Authorization: Bearer <session_token>`, or
`X-Session-Token: <session_token>` (required when the server has an API key, since `Authorization` then
carries the key). None -> 401, another session's token -> 403, unknown session or variable -> 404.

API key (`ServeConfig.api_key`: `parrot serve --api-key` or `PARROT_API_KEY`): every route except
`/health`, `/metrics` and the static web page (`/ui`) needs `Authorization: Bearer <api_key>`, as vLLM's
`--api-key` (so the `openai` client's `api_key=` works); a missing or wrong key is 401. Several keys
(comma-separated, as llama-server's) are several clients: a session belongs to the key that created it (any
other key gets 404 for it, as for a session that does not exist), and `max_sessions_per_key` bounds each key's
open sessions (429).

Every error is `{"detail": "<message>", "code": "<code>"}` (stable codes from `parrot.errors`; the
OpenAI routes use the OpenAI error shape). A limit reached (sessions, variables or pending calls per
session, queued completions) is 429 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from parrot.errors import (
    AbortedError,
    ConflictError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    ParrotError,
    RateLimitError,
    code_of,
)
from parrot.frontend.api_keys import CLIENT_SCOPE_KEY, client_of, key_index
from parrot.frontend.disconnects import while_connected
from parrot.frontend.openai_api import frontend_routes
from parrot.frontend.openai_tokens import TOKEN_PATHS, token_routes
from parrot.frontend.text_body import TextBodyRoute
from parrot.frontend.ui import ui_routes
from parrot.protocol import (
    CallCreated,
    NativeCallRequest,
    SemanticCallRequest,
    SemanticVarContent,
    SemanticVarCreate,
    SemanticVarCreated,
    SemanticVarSet,
    SessionCreate,
    SessionCreated,
)
from parrot.serve import constraints
from parrot.serve.core import ParrotServeCore
from parrot.serve.engines import engine_routes
from parrot.serve.perf import Criterion
from parrot.serve.session import AuthError, ForbiddenError, Session
from parrot.serve.transforms import TransformError
from parrot.serve.variables import VariableFailedError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20
# a request's body must arrive within BODY_TIMEOUT_S of its head, plus a second for every BODY_MIN_RATE bytes that
# came (Apache's RequestReadTimeout body=20,MinRate=500): a body that trickles or stalls is a 408, not a connection
# and a task held for as long as the client likes (parrot.header_deadline does the same for the head)
BODY_TIMEOUT_S = 20.0
BODY_MIN_RATE = 500
Auth = Annotated[str | None, Header()]  # "Authorization: Bearer <session_token>" (or the API key)
SessionToken = Annotated[str | None, Header(alias="X-Session-Token")]

Client = Annotated[int | None, Depends(client_of)]  # the API key the request came with (its index), if any
_STATUS: list[tuple[type[Exception], int]] = [
    (AuthError, 401), (ForbiddenError, 403), (NotFoundError, 404), (ConflictError, 409),
    (VariableFailedError, 424), (TransformError, 424), (InvalidRequestError, 400), (EngineUnavailableError, 503),
    (RateLimitError, 429), (AbortedError, 409), (ParrotError, 400),
]
_STATUS_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 408: "timeout", 409: "conflict", 413: "body_too_large",
                 422: "invalid_request", 429: "rate_limited"}
# open without the API key (/ui: the static page and its assets; /version: the server's version, as vLLM's)
UNGUARDED = ("/health", "/ping", "/metrics", "/ui", "/version")
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", *TOKEN_PATHS)
ENGINE_PATH = "/v1/engine"  # the engines' registration and heartbeats (docs/deployment.md)
REST_PATHS = ("/v1/session", "/v1/sessions", "/v1/semantic_var", "/v1/semantic_call", "/v1/native_call", ENGINE_PATH)


def error_body(detail: str, code: str) -> dict[str, str]:
    return {"detail": detail, "code": code}


def route_path(scope: Scope) -> str:
    """The path the routes see: the request's, less the server's `root_path` (`--root-path`: a proxy's prefix)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _admin_path(path: str) -> bool:
    """The views of sessions that the admin key opens too: the list of sessions and a session's graph."""
    return path == "/v1/sessions" or (path.startswith("/v1/session/") and path.endswith("/graph"))


def _open_path(path: str) -> bool:
    return any(path == p or (p == "/ui" and path.startswith("/ui/")) for p in UNGUARDED)


def _openai_path(path: str) -> bool:
    """Whether `path` answers errors in the OpenAI shape: the OpenAI routes, and any other /v1/ path that is
    not one of the REST API's (e.g. an OpenAI route this server lacks, /v1/embeddings)."""
    if any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS):
        return True
    return path.startswith("/v1/") and not any(path == p or path.startswith(p + "/") for p in REST_PATHS)


def error_response(path: str, status: int, message: str, code: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer in the shape of `path`'s API: OpenAI's `{"error": {...}}` or the REST `{"detail", "code"}`."""
    if _openai_path(path):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                            status_code=status, headers=headers)
    return JSONResponse(error_body(message, code), status_code=status, headers=headers)


class _BodyRefused(StarletteHTTPException):
    """Raised by the guarded `receive` once a body passes MAX_BODY_BYTES, or is too slow (BODY_TIMEOUT_S)."""


def _unauthorized(path: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"}
    if _openai_path(path):  # what the openai client expects
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "invalid_api_key"}}, status_code=401, headers=headers)
    return JSONResponse(error_body(message, "unauthorized"), status_code=401, headers=headers)


def _token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


class _Guard:
    """Pure ASGI middleware (a BaseHTTPMiddleware would hide client disconnects from the routes): the API
    key on every route but the open ones (the engine key on the engines' routes, where one is set), and the
    body size limit."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], engine_key: str | None = None,
                 admin_key: str | None = None) -> None:
        self.app = app
        self.api_keys = api_keys
        self.engine_key = engine_key
        self.admin_key = admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal: JSONResponse | None = None
        engines = path == ENGINE_PATH or path.startswith(ENGINE_PATH + "/")
        engine_key = engines and self.engine_key is not None
        keys, what = ((self.engine_key,), "engine key") if engine_key else (self.api_keys, "API key")
        if keys and not _open_path(path):
            given = _token(headers.get("authorization"))
            if given is None:
                refusal = _unauthorized(path, f"missing {what}: send 'Authorization: Bearer <{what}>'")
            else:
                client = key_index(given, keys)
                if client is not None and not engine_key:
                    scope[CLIENT_SCOPE_KEY] = client  # whose request it is (a key's sessions are its own)
                if client is None and not (self.admin_key is not None and _admin_path(path)
                                           and _same(given, self.admin_key)):
                    refusal = _unauthorized(path, f"invalid {what}")
        length = headers.get("content-length")

        def too_large() -> JSONResponse:  # and the connection closed: the rest of the body is not read
            return error_response(path, 413, f"request body over {MAX_BODY_BYTES} bytes", "body_too_large",
                                  headers={"Connection": "close"})

        def too_slow() -> JSONResponse:  # likewise
            return error_response(path, 408, f"the request body did not arrive in time ({BODY_TIMEOUT_S:g} s, and a "
                                  f"second for each {BODY_MIN_RATE} bytes that came)", "timeout",
                                  headers={"Connection": "close"})

        if refusal is None and length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            refusal = too_large()
        # a chunked body has no end the server knows of: one the app answered without reading to its end is not
        # read on (the server would read and drop it for as long as the client sends): the connection closes
        unread = "chunked" in headers.get("transfer-encoding", "").lower()
        if refusal is not None:
            if unread:
                refusal.headers["Connection"] = "close"
            await refusal(scope, receive, send)
            return
        # a body without Content-Length (chunked) is counted as it arrives: past the limit, the app's next
        # read raises and the answer is this 413, whatever the route made of that error; a body slower than its
        # deadline likewise gets a 408
        received, failed, started, body_done = 0, None, False, False
        begun = time.monotonic()

        async def counted() -> Message:
            nonlocal received, failed, unread, body_done
            if body_done:  # the body is in: what comes next is a disconnect, whenever it comes
                return await receive()
            left = begun + BODY_TIMEOUT_S + received / BODY_MIN_RATE - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                failed = too_slow
                raise _BodyRefused(408, "the request body did not arrive in time") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    failed = too_large
                    raise _BodyRefused(413, f"request body over {MAX_BODY_BYTES} bytes")
                unread = unread and message.get("more_body", False)
                body_done = not message.get("more_body", False)
            else:
                body_done = True  # a disconnect: nothing more to wait for
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            if failed is not None and not started:  # the app's own answer to the error it got reading: ours instead
                return
            if message["type"] == "http.response.start" and unread:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception:
            if failed is None or started:
                raise
        if failed is not None and not started:
            await failed()(scope, receive, send)


def create_app(core: ParrotServeCore, manage_core: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        if manage_core:
            await core.start()
        yield
        if manage_core:
            await core.stop()

    app = FastAPI(title="Parrot", lifespan=lifespan)
    app.router.route_class = TextBodyRoute  # the REST routes' bodies are read as Unicode (lone surrogates: U+FFFD)
    api_keys = core.config.api_keys
    app.include_router(engine_routes(core.engines))
    app.include_router(frontend_routes(core))  # OpenAI-compatible /v1/completions, /v1/chat/completions, /metrics
    app.include_router(token_routes(core))  # vLLM's /tokenize, /detokenize (and under /v1/)
    # the web view /ui, /v1/session/{id}/graph, /v1/sessions: every session opens with the admin key, else with the
    # API key where there is one (with several, each client's key opens only the sessions whose tokens it gives)
    app.include_router(ui_routes(core, api_key=core.config.admin_key or (api_keys[0] if len(api_keys) == 1 else None)))

    app.add_middleware(_Guard, api_keys=api_keys, engine_key=core.config.engine_key, admin_key=core.config.admin_key)
    if core.config.allowed_origins:  # outside the guard: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(core.config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    async def errors(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, TimeoutError):
            return JSONResponse(error_body("timed out waiting for the variable", "timeout"), status_code=408)
        for cls, status in _STATUS:
            if isinstance(exc, cls):
                headers = None
                if isinstance(exc, RateLimitError):
                    headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
                return JSONResponse(error_body(str(exc), code_of(exc)), status_code=status, headers=headers)
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"),
                            status_code=500)

    for cls in (ParrotError, TimeoutError, Exception):
        app.add_exception_handler(cls, errors)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return JSONResponse(error_body("; ".join(parts) or "invalid request", "invalid_request"), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # also the app's own 404 / 405 for paths and methods no route has: in the OpenAI shape under /v1/ but
        # the REST API's paths
        return error_response(route_path(request.scope), exc.status_code, str(exc.detail),
                              _STATUS_CODES.get(exc.status_code, "error"), headers=exc.headers)

    def session_of(session_id: str, authorization: str | None, session_token: str | None = None,
                   client: int | None = None) -> Session:
        """The session, if the request carries its token (X-Session-Token, else the Authorization bearer token
        unless the guard took it for an API key: `client`) and, with API keys, the key that opened it."""
        token = session_token
        if token is None and client is None:
            token = _token(authorization)
        return core.get_session(session_id, token, owner=client)

    # ---- sessions -----------------------------------------------------------------------------
    @app.post("/v1/session", status_code=201, response_model=SessionCreated)
    async def create_session(client: Client, body: SessionCreate | None = None) -> SessionCreated:
        s = core.create_session(cache_salt=body.cache_salt if body is not None else None, owner=client)
        return SessionCreated(session_id=s.session_id, session_token=s.token)

    @app.get("/v1/session/{session_id}")
    async def get_session(client: Client, session_id: str, authorization: Auth = None,
                          xst: SessionToken = None) -> dict:
        return core.inspect(session_of(session_id, authorization, xst, client))

    @app.delete("/v1/session/{session_id}", status_code=204)
    async def delete_session(client: Client, session_id: str, authorization: Auth = None,
                             xst: SessionToken = None) -> Response:
        await core.delete_session(session_of(session_id, authorization, xst, client))
        return Response(status_code=204)

    # ---- semantic variables -------------------------------------------------------------------
    @app.post("/v1/semantic_var", status_code=201, response_model=SemanticVarCreated)
    async def create_var(client: Client, body: SemanticVarCreate, authorization: Auth = None,
                         xst: SessionToken = None) -> SemanticVarCreated:
        var = core.create_var(session_of(body.session_id, authorization, xst, client), body.name, body.content)
        return SemanticVarCreated(var_id=var.id)

    @app.post("/v1/semantic_var/{var_id}")
    async def set_var(client: Client, var_id: str, body: SemanticVarSet, authorization: Auth = None,
                      xst: SessionToken = None) -> dict:
        core.set_var(session_of(body.session_id, authorization, xst, client), var_id, body.content)
        return {"var_id": var_id}

    @app.get("/v1/semantic_var/{var_id}", response_model=SemanticVarContent)
    async def get_var(client: Client, var_id: str, session_id: str, request: Request, authorization: Auth = None,
                      xst: SessionToken = None, criteria: Criterion = "latency",
                      timeout: Annotated[float | None, Query(ge=0, le=3600)] = None) -> SemanticVarContent:
        # a reader that leaves stops reading (as a stream's does): it no longer holds its session open, or keeps
        # a generation nobody else needs running
        session = session_of(session_id, authorization, xst, client)
        content = await while_connected(request, core.get_var(session, var_id, criteria, timeout),
                                        lambda: StarletteHTTPException(499, "the client disconnected"))
        return SemanticVarContent(var_id=var_id, content=content)

    @app.get("/v1/semantic_var/{var_id}/stream")
    async def stream_var(client: Client, var_id: str, session_id: str, authorization: Auth = None,
                         xst: SessionToken = None, criteria: Criterion = "latency") -> StreamingResponse:
        stream = core.stream_var(session_of(session_id, authorization, xst, client), var_id, criteria)

        async def events() -> AsyncIterator[str]:
            try:
                async for delta in stream:
                    yield f"data: {json.dumps({'text': delta})}\n\n"
                yield "data: [DONE]\n\n"
            except ParrotError as exc:
                yield f"event: error\ndata: {json.dumps(error_body(str(exc), code_of(exc)))}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- calls --------------------------------------------------------------------------------
    @app.post("/v1/semantic_call", status_code=201, response_model=CallCreated)
    async def semantic_call(client: Client, body: SemanticCallRequest, authorization: Auth = None,
                            xst: SessionToken = None) -> CallCreated:
        session = session_of(body.session_id, authorization, xst, client)
        for p in body.parameters:  # an invalid output constraint is a 400 before anything is scheduled
            if p.sampling_config is not None:
                await constraints.validate(p.sampling_config)
        return core.semantic_call(session, body)

    @app.post("/v1/native_call", status_code=201, response_model=CallCreated)
    async def native_call(client: Client, body: NativeCallRequest, authorization: Auth = None,
                          xst: SessionToken = None) -> CallCreated:
        return core.native_call(session_of(body.session_id, authorization, xst, client), body)

    # ---- service ------------------------------------------------------------------------------
    @app.get("/health", response_model=None)
    @app.api_route("/ping", methods=["GET", "POST"], response_model=None,
                   include_in_schema=False)  # SageMaker's (and vLLM's) name for it
    async def health() -> dict | JSONResponse:
        engines = [e.name for e in core.engines.live_engines()]
        # every engine stopped for good (the one inside this process): nothing here can serve again, so the
        # answer is a 503 (a liveness probe restarts the server), as an engine's own /health answers
        stopped = core.engines.stranded()
        procs = core.engine_processes
        processes = procs.status() if procs is not None else None  # --engines N: each process's state
        if not stopped and not engines and procs is not None and procs.all_given_up:  # none to come
            stopped = {p["name"]: f"its process exited with code {p['last_exit_code']} and is not restarted"
                       for p in processes or ()}
        if stopped:
            dead: dict = {"status": "engine_dead", "engines": [], "dead": stopped}
            if processes is not None:
                dead["engine_processes"] = processes
            return JSONResponse(dead, status_code=503)
        warming = {}  # engines still compiling shapes: they serve, a step waits for a shape it needs
        draining = []  # engines stopping: their requests under way finish, no new work goes there
        for name in engines:
            info = core.engines.runtime(name)
            if info is not None and info.compiled_shapes < info.total_shapes:
                warming[name] = f"{info.compiled_shapes} of {info.total_shapes} shapes compiled"
            if info is not None and info.draining:
                draining.append(name)
        body: dict = {"status": "warming_up" if warming else "ok" if engines else "no_engine", "engines": engines}
        if warming:
            body["warming_up"] = warming
        if draining:
            body["draining"] = draining
        if processes is not None:  # --engines N: each process's state, restarts, last exit code
            body["engine_processes"] = processes
            if engines and any(p["state"] != "running" for p in processes):
                body["status"] = "degraded"  # serving, with fewer engines than it started
        return body

    return app
