"""Exceptions shared by every layer. Each carries a message meant for the user, not a traceback.

Every class has a stable `code` (a short snake_case string). Codes cross process boundaries: the engine's
HTTP errors and SSE `event: error` payloads carry `{"detail", "code"}`, and so do the serve layer's, so a
caller tells errors apart by code, never by message text. `error_for_code(code, message)` rebuilds the
matching class on the receiving side; `code_of(exc)` reads any exception's code.
"""

from __future__ import annotations

from typing import ClassVar


class ParrotError(Exception):
    """Base class: an error Parrot reports to the caller with a clear message."""

    code: ClassVar[str] = "error"


class ModelLoadError(ParrotError):
    """The model file or directory is missing, corrupt or of an unsupported kind."""

    code = "model_load_error"


class InvalidRequestError(ParrotError):
    """The request itself is wrong (empty prompt, too long, bad sampling values, ...)."""

    code = "invalid_request"


class NotFoundError(ParrotError):
    """A named object (context, session, variable, ...) does not exist."""

    code = "not_found"


class ConflictError(ParrotError):
    """The request conflicts with current state (e.g. freeing a context that is running)."""

    code = "conflict"


class AbortedError(ParrotError):
    """The primitive was aborted (its client went away or asked to cancel) before it finished."""

    code = "aborted"


class EngineError(ParrotError):
    """An error about an engine rather than the request. `engine` names the engine it came from."""

    code = "engine_error"

    def __init__(self, message: str = "", engine: str | None = None) -> None:
        super().__init__(message)
        self.engine = engine


class EngineUnavailableError(EngineError):
    """The engine cannot serve anything right now (unreachable, timed out, 5xx, dead loop): re-dispatch the
    work to another engine."""

    code = "engine_unavailable"


class EngineOverloadedError(EngineError):
    """The engine is alive but cannot take the work now (its KV cache is full): retry later or elsewhere."""

    code = "engine_overloaded"


class KVCacheFullError(EngineOverloadedError):
    """The KV cache cannot hold the work even after evicting idle contexts and preempting others."""

    code = "kv_cache_full"


class GenerationFailedError(ParrotError):
    """The engine failed one generation (it serves on)."""

    code = "generation_failed"


class RateLimitError(ParrotError):
    """A configured limit (sessions, variables, pending calls) is reached: retry after `retry_after` seconds."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


_BY_CODE: dict[str, type[ParrotError]] = {}
for _cls in (ParrotError, ModelLoadError, InvalidRequestError, NotFoundError, ConflictError, AbortedError,
             EngineError, EngineUnavailableError, EngineOverloadedError, KVCacheFullError, GenerationFailedError,
             RateLimitError):
    _BY_CODE[_cls.code] = _cls


def code_of(exc: BaseException) -> str:
    """The stable code of an exception: its class's `code`, else "internal_error" for non-Parrot errors."""
    for cls in type(exc).__mro__:
        if "code" in cls.__dict__ and cls is not ParrotError:
            return str(cls.__dict__["code"])
    return ParrotError.code if isinstance(exc, ParrotError) else "internal_error"


def error_for_code(code: str | None, message: str, engine: str | None = None) -> ParrotError:
    """The ParrotError subclass of `code` carrying `message` (a plain ParrotError for unknown codes)."""
    cls = _BY_CODE.get(code or "", ParrotError)
    if issubclass(cls, EngineError):
        return cls(message, engine)
    if cls is RateLimitError:
        return RateLimitError(message)
    return cls(message)
