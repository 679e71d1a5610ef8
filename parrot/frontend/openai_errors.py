"""Errors of the OpenAI-compatible API in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Invalid requests (schema violations and malformed JSON included) are 400 `invalid_request_error`, unknown
model 404, no engine reachable 503, rate limits 429 with Retry-After, anything unexpected 500.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.errors import NotFoundError, ParrotError, RateLimitError, code_of
from parrot.frontend.text_body import TextBodyRoute
from parrot.serve.engines import EngineUnavailableError

log = logging.getLogger(__name__)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def from_exception(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, NotFoundError):
        return OpenAIError(404, str(exc), code="not_found")
    if isinstance(exc, EngineUnavailableError):
        return OpenAIError(503, str(exc), type_="server_error", code="engine_unavailable")
    if isinstance(exc, RateLimitError):
        return OpenAIError(429, str(exc), type_="rate_limit_error", code=exc.code)
    if isinstance(exc, ParrotError):  # InvalidRequestError and failures reported by the engine
        return OpenAIError(400, str(exc) or type(exc).__name__, code=code_of(exc))
    if isinstance(exc, StarletteHTTPException):
        return OpenAIError(exc.status_code, str(exc.detail), type_="invalid_request_error" if exc.status_code < 500
                           else "server_error")
    log.exception("unhandled error in the OpenAI API", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")


def error_path(loc: Sequence[object]) -> str:
    """A pydantic error location as the parameter path shown to the user ("messages.0.role"): without the
    request body's own name and pydantic's union-member tags ("str", "list[str]")."""
    return ".".join(x for x in map(str, loc)
                    if x != "body" and not any(c in x for c in "[]") and x not in ("str", "int", "list"))


def validation_error(exc: RequestValidationError) -> OpenAIError:
    parts, param = [], None
    for e in exc.errors():
        where = error_path(e.get("loc", ()))
        msg = str(e.get("msg"))
        if e.get("type") == "json_invalid":  # its location is a character offset, not a parameter
            where = ""
            msg = f"the body is not valid JSON: {e.get('ctx', {}).get('error', msg)}"
        elif not where and e.get("type") in ("dict_type", "model_attributes_type"):
            msg = f"the body must be a JSON object (sent as Content-Type: application/json): {msg}"
        param = param or where or None
        parts.append(f"{where}: {msg}" if where else msg)
    return OpenAIError(400, "; ".join(dict.fromkeys(parts)) or "invalid request", param=param)


class OpenAIRoute(TextBodyRoute):
    """Routes whose errors (validation included) come out in the OpenAI error shape (and whose JSON bodies are
    read as Unicode: `TextBodyRoute`)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return validation_error(exc).response()
            except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error body
                return from_exception(exc).response()

        return route
