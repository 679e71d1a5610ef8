"""OpenAI-compatible API over the serve core: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (JSON or SSE streaming).

Every request runs through `ParrotServeCore.complete`, i.e. the same GlobalScheduler and ContextManager
as semantic calls, so plain OpenAI clients get prefix sharing:

- chat: the messages are rendered with the model's chat template and passed as pieces at message
  boundaries (the template rendered for messages[:1], messages[:2], ..., the differences being the
  pieces; one piece if those renders are not prefixes of each other). The leading system (or developer)
  messages are `shared`: kept as global contexts, so a repeated system prompt is filled once and forked
  after (`usage.prompt_tokens_details.cached_tokens` > 0). Without a system message the template's
  constant preamble (e.g. a default system prompt, found by rendering the first message with two
  different contents) is the shared piece instead.
- completions: the prompt is one piece, not kept after the request (shared=0): there is no
  message structure to say which part recurs. The n choices of one prompt still share its fill.

Parameters: max_tokens (default 16 for completions, 128 for chat; `max_completion_tokens` too for chat),
temperature (default 1.0, 0 = greedy), top_p, top_k (extension, 0 or -1 = off), n (<= 16; choice i
of a seeded request uses seed + i), stop (str or list), seed, stream (+ stream_options.include_usage),
ignore_eos (extension), user (ignored). `prompt` is a string or a list of strings (one set of n choices
per prompt; choice index = prompt index * n + i). Unknown fields are ignored. Refused with 400 because
they would silently change the meaning: echo, logprobs / top_logprobs, suffix, best_of != n,
logit_bias, non-zero presence/frequency penalties, tools / functions, a response_format other than
text, token-id prompts, non-text message content, roles other than system / developer / user /
assistant.

`model`: one model is served; any name is accepted and responses name the served model (clients often
hard-code a model name). `GET /v1/models/{id}` is 404 for other names.

Errors use the OpenAI shape on these routes, `{"error": {"message", "type", "param", "code"}}`, so the
openai client exposes them as `exc.message / exc.type / exc.param / exc.code`: invalid requests
(including schema violations and malformed JSON) are 400 `invalid_request_error`, unknown model 404,
no engine reachable 503, anything unexpected 500. (The Parrot REST API keeps `{"detail": ...}`; a
404/405 for a path that does not exist at all is produced by the app and has that shape too.) An error
after a stream has started is sent as a last event `data: {"error": {...}}`, which the openai client
raises as `APIError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.errors import NotFoundError, ParrotError, RateLimitError, code_of
from parrot.frontend.metrics import ParrotMetrics, RequestTimer
from parrot.protocol import SamplingParams
from parrot.serve.core import CompletionResult, ParrotServeCore
from parrot.serve.engines import EngineUnavailableError

log = logging.getLogger(__name__)

MAX_N = 16
MAX_STOP = 16
CREATED = int(time.time())


# ---- errors -------------------------------------------------------------------------------------
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


def _unsupported(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def _from_exception(exc: BaseException) -> OpenAIError:
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


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    parts, param = [], None
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # drop pydantic's union-member tags ("str", "list[str]") from the path shown to the user
        where = ".".join(x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "list"))
        param = param or where or None
        msg = str(e.get("msg"))
        if e.get("type") == "json_invalid":
            msg = f"the body is not valid JSON: {e.get('ctx', {}).get('error', msg)}"
        parts.append(f"{where}: {msg}" if where else msg)
    return OpenAIError(400, "; ".join(dict.fromkeys(parts)) or "invalid request", param=param)


class OpenAIRoute(APIRoute):
    """Routes whose errors (validation included) come out in the OpenAI error shape."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return _validation_error(exc).response()
            except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error body
                return _from_exception(exc).response()

        return route


# ---- request schemas ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1: whole vocabulary")
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM): generate max_tokens tokens regardless of EOS
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # ignored

    def check_common(self) -> None:
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _unsupported(name, name)
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise OpenAIError(400, f"at most {MAX_STOP} stop sequences", param="stop")
        if any(not s for s in stops):
            raise OpenAIError(400, "stop sequences must not be empty", param="stop")
        return stops

    def sampling(self, default_max_tokens: int, index: int, max_tokens: int | None = None) -> SamplingParams:
        seed = None if self.seed is None else (self.seed + index) % 2**32
        try:
            return SamplingParams(
                max_tokens=max_tokens or self.max_tokens or default_max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(0, self.top_k or 0), seed=seed, stop=self.stops(), ignore_eos=self.ignore_eos)
        except ValidationError as exc:
            raise OpenAIError(400, f"invalid sampling parameters: {exc}") from exc


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] = Field(description="a string, or a list of strings (n choices each)")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> list[str]:
        self.check_common()
        if self.echo:
            raise _unsupported("echo", "echo")
        if self.logprobs is not None:
            raise _unsupported("logprobs", "logprobs")
        if self.suffix:
            raise _unsupported("suffix", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "best_of other than n")
        prompts = [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
        if not prompts:
            raise OpenAIError(400, "prompt must not be an empty list", param="prompt")
        if len(prompts) * self.n > MAX_N * 4:
            raise OpenAIError(400, f"at most {MAX_N * 4} choices (prompts x n) per request", param="n")
        if any(not p for p in prompts):
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        return prompts


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # ignored
    tool_calls: list[Any] | None = None

    def text(self, i: int) -> str:
        if self.role not in ("system", "developer", "user", "assistant"):
            raise OpenAIError(400, f"messages[{i}].role {self.role!r} is not supported (system, developer, user, "
                              "assistant)", param=f"messages.{i}.role")
        if self.tool_calls:
            raise _unsupported(f"messages.{i}.tool_calls", "tool calls")
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise OpenAIError(400, f"messages[{i}].content is required", param=f"messages.{i}.content")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise _unsupported(f"messages.{i}.content", f"content part of type {part.type!r}")
            texts.append(part.text)
        return "".join(texts)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    def check(self) -> list[dict[str, str]]:
        self.check_common()
        if self.logprobs or self.top_logprobs is not None:
            raise _unsupported("logprobs", "logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise _unsupported(name, name)
        if self.tool_choice not in (None, "none"):
            raise _unsupported("tool_choice", "tool_choice")
        if self.response_format is not None and self.response_format.type != "text":
            raise _unsupported("response_format", f"response_format {self.response_format.type!r}")
        out = []
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(i)})
        return out


# ---- chat prompt pieces -------------------------------------------------------------------------
def chat_pieces(render: Callable[[list[dict[str, str]], bool], str],
                messages: list[dict[str, str]]) -> tuple[list[str], int]:
    """Split the rendered chat prompt at message boundaries: (pieces, how many leading pieces to share).

    `render(messages, add_generation_prompt)` is the chat template. "".join(pieces) is always exactly
    the full prompt. Shared: the leading system messages, else the template's constant preamble."""
    full = render(messages, True)
    try:
        renders = [render(messages[:i], False) for i in range(1, len(messages))] + [full]
    except ParrotError:  # e.g. a template that refuses a partial conversation
        return [full], 0
    pieces, prev = [], ""
    for r in renders:
        if not r.startswith(prev):
            return [full], 0
        pieces.append(r[len(prev):])
        prev = r
    n_system = 0
    while n_system < len(messages) and messages[n_system]["role"] == "system":
        n_system += 1
    if n_system:
        return pieces, n_system
    # no system message: share what the template puts before the first message's content
    try:
        a = render([{**messages[0], "content": "\x01"}], False)
        b = render([{**messages[0], "content": "\x02"}], False)
    except ParrotError:
        return pieces, 0
    preamble = os.path.commonprefix([a, b])
    if preamble and pieces[0].startswith(preamble) and len(preamble) < len(pieces[0]):
        return [preamble, pieces[0][len(preamble):], *pieces[1:]], 1
    return pieces, 0


# ---- running choices ----------------------------------------------------------------------------
class _Choice:
    def __init__(self, index: int, queue: asyncio.Queue, timer: RequestTimer | None) -> None:
        self.index = index
        self.queue = queue
        self.timer = timer
        self.text = ""
        self.result: CompletionResult | None = None


async def _events(choices: list[_Choice], core: ParrotServeCore | None = None
                  ) -> AsyncIterator[tuple[_Choice, str | CompletionResult]]:
    """Merge the choices' core queues: (choice, text delta | result) in arrival order. Raises the first
    failure. Timers see every delta and the end of each choice. Choices still running when this ends early
    (a failure, or the client disconnected) are cancelled in the core: their generations are aborted."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        while True:
            item = await choice.queue.get()
            merged.put_nowait((choice, item))
            if not isinstance(item, str):
                return

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            choice, item = await merged.get()
            if isinstance(item, str):
                if not item:
                    continue
                if choice.timer is not None:
                    choice.timer.delta()
                choice.text += item
                yield choice, item
                continue
            remaining -= 1
            if isinstance(item, BaseException):
                if choice.timer is not None:
                    choice.timer.fail()
                raise item
            choice.result = item
            if choice.timer is not None:
                choice.timer.finish(item.prompt_tokens, len(item.token_ids), item.finish_reason)
            yield choice, item
    finally:
        for t in tasks:
            t.cancel()
        for c in choices:  # choices still running when the request ended (error, disconnect)
            if c.result is None and c.timer is not None:
                c.timer.fail()
            if c.result is None and core is not None:
                core.cancel_completion(c.queue)


async def _collect(choices: list[_Choice], core: ParrotServeCore, request: Request | None,
                   poll: float = 0.5) -> None:
    """Run the choices to their end for a non-streamed answer; a client that disconnects meanwhile cancels
    them (their generations are aborted) instead of leaving them to run for nobody."""

    async def drain() -> None:
        async for _ in _events(choices, core):
            pass

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll)
            if not task.done() and request is not None and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise OpenAIError(499, "the client disconnected", code="aborted")  # nobody reads this answer
    finally:
        if not task.done():
            task.cancel()
    await task  # its error, if it failed


def _usage(choices: list[_Choice], n: int) -> dict:
    """prompt tokens count once per prompt (the first choice of each), completion tokens for every choice."""
    results = [c.result for c in choices if c.result is not None]
    firsts = [c.result for c in choices if c.result is not None and c.index % n == 0]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def openai_routes(core: ParrotServeCore, metrics: ParrotMetrics | None = None) -> APIRouter:
    """The OpenAI-compatible routes; request latencies go to `metrics` when given."""
    router = APIRouter(route_class=OpenAIRoute)

    def model_card() -> dict:
        return {"id": core.model, "object": "model", "created": CREATED, "owned_by": "parrot"}

    @router.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id != core.model:
            raise OpenAIError(404, f"the model {model_id!r} does not exist (served: {core.model!r})",
                              param="model", code="model_not_found")
        return model_card()

    def submit(pieces_list: list[tuple[list[str], int]], body: _SamplingRequest, default_max: int,
               endpoint: str, start: float, max_tokens: int | None = None) -> list[_Choice]:
        samplings = [body.sampling(default_max, i, max_tokens) for i in range(body.n)]  # validate first
        limits = [e.max_context_len for e in core.engines.live_engines()]
        if limits:  # a clear 400 up front rather than an engine error later (or inside a stream)
            param = "messages" if endpoint == "chat" else "prompt"
            for pieces, _ in pieces_list:
                n_prompt = len(core.tokenizers.encode(core.model, "".join(pieces)))
                if n_prompt + samplings[0].max_tokens > min(limits):
                    raise OpenAIError(
                        400, f"this model's maximum context length is {min(limits)} tokens; the {param} has "
                        f"{n_prompt} tokens and max_tokens is {samplings[0].max_tokens}",
                        param=param if n_prompt >= min(limits) else "max_tokens", code="context_length_exceeded")
        choices: list[_Choice] = []
        for p, (pieces, shared) in enumerate(pieces_list):
            for i in range(body.n):
                queue = core.complete(pieces, samplings[i], "latency", shared)
                timer = metrics.start_request(endpoint, start) if metrics is not None else None
                choices.append(_Choice(p * body.n + i, queue, timer))
        return choices

    def stream_response(gen: AsyncIterator[str]) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                async for line in gen:
                    yield line
            except Exception as exc:  # noqa: BLE001 - after the headers: report in the stream
                yield _sse(_from_exception(exc).body())
                return
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- /v1/completions ----------------------------------------------------------------------
    @router.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> dict | StreamingResponse:
        start = time.perf_counter()
        prompts = body.check()
        choices = submit([([p], 0) for p in prompts], body, 16, "completions", start)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": core.model}

        if not body.stream:
            await _collect(choices, core, request)
            return {**base, "choices": [{"index": c.index, "text": c.result.text, "logprobs": None,
                                         "finish_reason": c.result.finish_reason} for c in choices],
                    "usage": _usage(choices, body.n)}

        async def gen() -> AsyncIterator[str]:
            async for c, item in _events(choices, core):
                if isinstance(item, str):
                    text, finish = item, None
                else:
                    # text the deltas have not shown yet (normally none)
                    text = item.text[len(c.text):] if item.text.startswith(c.text) else ""
                    finish = item.finish_reason
                yield _sse({**base, "choices": [{"index": c.index, "text": text, "logprobs": None,
                                                 "finish_reason": finish}]})
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(choices, body.n)})

        return stream_response(gen())

    # ---- /v1/chat/completions -----------------------------------------------------------------
    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict | StreamingResponse:
        start = time.perf_counter()
        messages = body.check()
        tok = core.tokenizers.get(core.model)

        def render(msgs: list[dict[str, str]], add_generation_prompt: bool) -> str:
            return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)

        try:
            pieces = chat_pieces(render, messages)
        except ParrotError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        except Exception as exc:  # a template error (jinja) on these messages
            raise OpenAIError(400, f"the chat template cannot render these messages: {exc}",
                              param="messages") from exc
        max_tokens = body.max_completion_tokens or body.max_tokens
        choices = submit([pieces], body, 128, "chat", start, max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": core.model,
                "system_fingerprint": None}

        if not body.stream:
            await _collect(choices, core, request)
            return {**base, "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.result.text},
                                         "logprobs": None, "finish_reason": c.result.finish_reason}
                                        for c in choices],
                    "usage": _usage(choices, body.n)}

        chunk = {**base, "object": "chat.completion.chunk"}

        def event(c: _Choice, delta: dict, finish: str | None) -> str:
            return _sse({**chunk, "choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                               "finish_reason": finish}]})

        async def gen() -> AsyncIterator[str]:
            for c in choices:
                yield event(c, {"role": "assistant", "content": ""}, None)
            async for c, item in _events(choices, core):
                if isinstance(item, str):
                    yield event(c, {"content": item}, None)
                    continue
                rest = item.text[len(c.text):] if item.text.startswith(c.text) else ""
                if rest:
                    yield event(c, {"content": rest}, None)
                yield event(c, {}, item.finish_reason)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**chunk, "choices": [], "usage": _usage(choices, body.n)})

        return stream_response(gen())

    return router


def frontend_routes(core: ParrotServeCore, metrics: ParrotMetrics | None = None) -> APIRouter:
    """The OpenAI-compatible routes and `/metrics` sharing one ParrotMetrics (made here if not given)."""
    metrics = metrics or ParrotMetrics(core)
    router = APIRouter()
    router.include_router(openai_routes(core, metrics))
    router.include_router(metrics.router())
    router.metrics = metrics  # type: ignore[attr-defined] - so callers can reach it
    return router
