"""The Parrot REST API (sessions, semantic variables, semantic and native calls) over the serve core.

Session-scoped calls carry `Authorization: Bearer <session_token>`: none -> 401, another session's
token -> 403, unknown session or variable -> 404. Every error is `{"detail": "<message>"}`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.errors import ConflictError, InvalidRequestError, NotFoundError, ParrotError
from parrot.frontend.openai_api import frontend_routes
from parrot.frontend.ui import ui_routes
from parrot.protocol import (
    CallCreated,
    NativeCallRequest,
    SemanticCallRequest,
    SemanticVarContent,
    SemanticVarCreate,
    SemanticVarCreated,
    SemanticVarSet,
    SessionCreated,
)
from parrot.serve.core import ParrotServeCore
from parrot.serve.engines import EngineUnavailableError, engine_routes
from parrot.serve.perf import Criterion
from parrot.serve.session import AuthError, ForbiddenError, Session
from parrot.serve.transforms import TransformError
from parrot.serve.variables import VariableFailedError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20
Auth = Annotated[str | None, Header()]  # "Authorization: Bearer <session_token>"
_STATUS: list[tuple[type[Exception], int]] = [
    (AuthError, 401), (ForbiddenError, 403), (NotFoundError, 404), (ConflictError, 409),
    (VariableFailedError, 424), (TransformError, 424), (InvalidRequestError, 400), (EngineUnavailableError, 503),
    (ParrotError, 400),
]


def _token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def create_app(core: ParrotServeCore, manage_core: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        if manage_core:
            await core.start()
        yield
        if manage_core:
            await core.stop()

    app = FastAPI(title="Parrot", lifespan=lifespan)
    app.include_router(engine_routes(core.engines))
    app.include_router(frontend_routes(core))  # OpenAI-compatible /v1/completions, /v1/chat/completions, /metrics
    app.include_router(ui_routes(core))  # the live web view /ui and its JSON (/v1/session/{id}/graph, /v1/sessions)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):  # noqa: ANN001, ANN202
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return JSONResponse({"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        return await call_next(request)

    async def errors(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, TimeoutError):
            return JSONResponse({"detail": "timed out waiting for the variable"}, status_code=408)
        for cls, status in _STATUS:
            if isinstance(exc, cls):
                return JSONResponse({"detail": str(exc)}, status_code=status)
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    for cls in (ParrotError, TimeoutError, Exception):
        app.add_exception_handler(cls, errors)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code)

    def session_of(session_id: str, authorization: str | None) -> Session:
        return core.get_session(session_id, _token(authorization))

    # ---- sessions -----------------------------------------------------------------------------
    @app.post("/v1/session", status_code=201, response_model=SessionCreated)
    async def create_session() -> SessionCreated:
        s = core.create_session()
        return SessionCreated(session_id=s.session_id, session_token=s.token)

    @app.get("/v1/session/{session_id}")
    async def get_session(session_id: str, authorization: Auth = None) -> dict:
        return core.inspect(session_of(session_id, authorization))

    @app.delete("/v1/session/{session_id}", status_code=204)
    async def delete_session(session_id: str, authorization: Auth = None) -> Response:
        await core.delete_session(session_of(session_id, authorization))
        return Response(status_code=204)

    # ---- semantic variables -------------------------------------------------------------------
    @app.post("/v1/semantic_var", status_code=201, response_model=SemanticVarCreated)
    async def create_var(body: SemanticVarCreate, authorization: Auth = None) -> SemanticVarCreated:
        var = core.create_var(session_of(body.session_id, authorization), body.name, body.content)
        return SemanticVarCreated(var_id=var.id)

    @app.post("/v1/semantic_var/{var_id}")
    async def set_var(var_id: str, body: SemanticVarSet, authorization: Auth = None) -> dict:
        core.set_var(session_of(body.session_id, authorization), var_id, body.content)
        return {"var_id": var_id}

    @app.get("/v1/semantic_var/{var_id}", response_model=SemanticVarContent)
    async def get_var(var_id: str, session_id: str, authorization: Auth = None,
                      criteria: Criterion = "latency",
                      timeout: Annotated[float | None, Query(gt=0, le=3600)] = None) -> SemanticVarContent:
        content = await core.get_var(session_of(session_id, authorization), var_id, criteria, timeout)
        return SemanticVarContent(var_id=var_id, content=content)

    @app.get("/v1/semantic_var/{var_id}/stream")
    async def stream_var(var_id: str, session_id: str, authorization: Auth = None,
                         criteria: Criterion = "latency") -> StreamingResponse:
        stream = core.stream_var(session_of(session_id, authorization), var_id, criteria)

        async def events() -> AsyncIterator[str]:
            try:
                async for delta in stream:
                    yield f"data: {json.dumps({'text': delta})}\n\n"
                yield "data: [DONE]\n\n"
            except ParrotError as exc:
                yield f"event: error\ndata: {json.dumps({'detail': str(exc)})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- calls --------------------------------------------------------------------------------
    @app.post("/v1/semantic_call", status_code=201, response_model=CallCreated)
    async def semantic_call(body: SemanticCallRequest, authorization: Auth = None) -> CallCreated:
        return core.semantic_call(session_of(body.session_id, authorization), body)

    @app.post("/v1/native_call", status_code=201, response_model=CallCreated)
    async def native_call(body: NativeCallRequest, authorization: Auth = None) -> CallCreated:
        return core.native_call(session_of(body.session_id, authorization), body)

    # ---- service ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "engines": [e.name for e in core.engines.live_engines()]}

    return app
