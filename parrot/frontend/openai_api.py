"""OpenAI-compatible API over the serve core: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (JSON or SSE streaming), and `POST /v1/responses` over the chat route
(`openai_responses.py`).

Every request runs through `ParrotServeCore.complete`, i.e. the same GlobalScheduler and ContextManager
as semantic calls, so plain OpenAI clients get prefix sharing:

- chat: the messages are rendered with the model's chat template and passed as pieces at message
  boundaries (the template rendered for messages[:1], messages[:2], ..., the differences being the
  pieces; one piece if those renders are not prefixes of each other; for long chats in linear time,
  `_message_ends`), on a worker thread, as is the tokenizing of every prompt. The leading system (or developer)
  messages are `shared`: kept as global contexts, so a repeated system prompt is filled once and forked
  after (`usage.prompt_tokens_details.cached_tokens` > 0). Without a system message the template's
  constant preamble (e.g. a default system prompt, found by rendering the first message with two
  different contents) is the shared piece instead.
- completions: the prompt is one piece, not kept after the request (shared=0): there is no
  message structure to say which part recurs. The n choices of one prompt still share its fill.

Parameters (docs/openai-api.md has the table): every parameter the openai client sends is honoured or
refused with a 400 naming it (`openai_requests.py`); vLLM / SGLang extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, output constraints under their guided_* and
plain names) are honoured. Left-out sampling settings take the model's recommendation or llama.cpp's
defaults (serve/sampling_defaults.py, shown in /v1/models). Output constraints (response_format,
extensions) are validated before any engine work (serve/constraints.py) and enforced by the engine; tools
are rendered and parsed by `chat_prompt.py` / `openai_tools.py`; logprobs come back in OpenAI's shapes
(`openai_logprobs.py`). `prompt` is a string, a list of strings, a list of token ids or a list of lists
of token ids (one set of n choices per prompt; choice index = prompt index * n + i). Token ids go to the
engine as given (never decoded and re-encoded), through the same prefix cache as text; `echo` shows their
decoded text.

`model`: one model is served; any name is accepted and responses name the served model (clients often
hard-code a model name). `GET /v1/models/{id}` is 404 for other names.

Errors use the OpenAI shape on these routes, `{"error": {"message", "type", "param", "code"}}`, so the
openai client exposes them as `exc.message / exc.type / exc.param / exc.code`: invalid requests
(including schema violations and malformed JSON) are 400 `invalid_request_error`, unknown model 404,
no engine reachable 503, anything unexpected 500. (The Parrot REST API keeps `{"detail": ...}`; the app's
own 404 / 405 / 413 take the shape of the path: `http_api.error_response`.) An error
after a stream has started is sent as a last event `data: {"error": {...}}`, which the openai client
raises as `APIError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from parrot import __version__
from parrot.errors import InvalidRequestError, ParrotError
from parrot.frontend import openai_functions as legacy_functions
from parrot.frontend.api_keys import client_of
from parrot.frontend.chat_prompt import ChatMessage, renderer, template_messages
from parrot.frontend.disconnects import while_connected
from parrot.frontend.metrics import ParrotMetrics, RequestTimer
from parrot.frontend.openai_errors import OpenAIError, OpenAIRoute, error_path, from_exception, unsupported
from parrot.frontend.openai_logprobs import chat_logprobs, completion_logprobs
from parrot.frontend.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest, require
from parrot.frontend.openai_responses import responses_routes
from parrot.frontend.openai_tools import (
    ToolAnswer,
    ToolError,
    forced_prefix,
    parse_tool_choice,
    parse_tools,
    tool_constraint,
)
from parrot.protocol import SamplingParams
from parrot.serve import constraints
from parrot.serve.core import CompletionResult, ParrotServeCore, PromptLogprobs, TokenLogprobs
from parrot.serve.sampling_defaults import SamplingDefaults, model_sampling_defaults

log = logging.getLogger(__name__)

CREATED = int(time.time())
__all__ = ["OpenAIError", "chat_pieces", "frontend_routes", "openai_routes", "unsupported"]


# ---- chat prompt pieces -------------------------------------------------------------------------
def _message(m: Any, i: int) -> ChatMessage:
    """Message i of a request, validated; a 400 naming its field where it is malformed."""
    if not isinstance(m, dict):
        raise ToolError(f"messages[{i}] must be an object with a role", f"messages.{i}")
    try:
        return ChatMessage.model_validate(m)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(x for x in (f"messages.{i}", error_path(e.get("loc", ()))) if x)
        what = "is required" if e.get("type") == "missing" else f"is invalid: {e.get('msg')}"
        raise ToolError(f"{where} {what}", where) from exc


def chat_input(tok: Any, messages: list[Any] | None, tools: Any, tool_choice: Any, functions: Any,
               function_call: Any, template_kwargs: dict[str, Any] | None = None,
               ) -> tuple[list[Any], Any, Callable, list[dict]]:
    """A chat request's tools, tool choice, template renderer (given `template_kwargs`) and template messages,
    as /v1/chat/completions (and /tokenize) read them: legacy functions as tools, every message validated; a
    400 for what is malformed."""
    try:
        raw_tools, raw_choice = legacy_functions.tools_of(functions, function_call, tools, tool_choice)
        parsed = parse_tools(raw_tools)
        choice = parse_tool_choice(raw_choice, parsed)
        raw_messages = legacy_functions.messages_of(messages or [])
        checked = [_message(m, i) for i, m in enumerate(raw_messages)]
        render, native = renderer(tok, parsed, choice, template_kwargs)
        msgs = template_messages(checked, parsed, choice, native)  # type: ignore[arg-type]
    except ToolError as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from exc
    except Exception as exc:  # pydantic: a malformed message
        raise OpenAIError(400, f"messages: {exc}", param="messages") from exc
    return parsed, choice, render, msgs


def rendered_pieces(render: Callable, msgs: list[dict], generation_prompt: bool = True,
                    continue_final: bool = False) -> tuple[list[str], int]:
    """`chat_pieces` of the messages (the whole text alone without the generation prompt, or cut after the
    final message's content with `continue_final`), a 400 where the template cannot render them."""
    try:
        if continue_final:
            return [continued_final_message(render, msgs)], 0
        if not generation_prompt:
            return [render(msgs, False)], 0
        return chat_pieces(render, msgs)
    except OpenAIError:
        raise
    except ParrotError as exc:
        raise OpenAIError(400, str(exc), param="messages") from exc
    except Exception as exc:  # a template error (jinja) on these messages
        raise OpenAIError(400, f"the chat template cannot render these messages: {exc}", param="messages") from exc


def check_forced_call(choice: Any, generation_prompt: bool) -> None:
    """A tool_choice that forces a call opens the answer after the generation prompt: without it, a 400."""
    if choice.mode in ("named", "required") and not generation_prompt:
        raise OpenAIError(400, f"tool_choice {choice.mode!r} opens the answer with a tool call: it needs the "
                          "generation prompt (add_generation_prompt true)", param="tool_choice")


def continued_final_message(render: Callable[[list[dict[str, Any]], bool], str], msgs: list[dict]) -> str:
    """vLLM's (and Hugging Face's) `continue_final_message`: the chat rendered without a generation prompt and cut
    right after the final message's content, so that the model goes on with that message (a prefilled answer)."""
    content = msgs[-1].get("content") if msgs else None
    if not isinstance(content, str) or not content.strip():
        raise OpenAIError(400, "continue_final_message needs a final message with text content to continue",
                          param="continue_final_message")
    text = render(msgs, False)
    for said in (content, content.strip()):  # some templates strip a message's content
        at = text.rfind(said)
        if at >= 0:
            return text[:at + len(said)]
    raise OpenAIError(400, "the chat template does not render the final message's content as given, so it cannot "
                      "be continued", param="continue_final_message")


def chat_pieces(render: Callable[[list[dict[str, str]], bool], str],
                messages: list[dict[str, str]]) -> tuple[list[str], int]:
    """Split the rendered chat prompt at message boundaries: (pieces, how many leading pieces to share).

    `render(messages, add_generation_prompt)` is the chat template. "".join(pieces) is always exactly
    the full prompt. Shared: the leading system messages, else the template's constant preamble."""
    full = render(messages, True)
    try:
        ends = _message_ends(render, messages, full)
    except ParrotError:  # e.g. a template that refuses a partial conversation
        return [full], 0
    if ends is None:
        return [full], 0
    pieces = [full[a:b] for a, b in zip([0, *ends], [*ends, len(full)], strict=True)]
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


EXACT_PIECES_MAX = 32  # conversations up to this many messages: every prefix rendered (n²/2 messages, ~ms)
EXACT_FALLBACK_MAX = 256  # where the windowed split fails: every prefix rendered up to this many (~0.2 s)


def _message_ends(render: Callable[[list[dict[str, str]], bool], str], messages: list[dict[str, str]],
                  full: str) -> list[int] | None:
    """Where `render(messages[:i], False)` ends in `full`, for i in 1..n-1 (None where one is not a prefix of
    the next and of `full`: the prompt is then one piece).

    Rendering every prefix is quadratic (a 2,500-message chat took 14 s), so beyond EXACT_PIECES_MAX messages
    each message's piece is rendered in a window (the first message, up to three before it, positions of the
    same parity: templates that treat the first message or alternate roles see what they see in full), the
    pieces must follow one another in `full`, and exact prefix renders check the split at a few points,
    always the last (`render(messages[:n-1])`, the previous turn's prompt). A template whose pieces depend on
    more than that window fails those checks: every prefix is rendered then (up to EXACT_FALLBACK_MAX
    messages), else the prompt is one piece."""
    n = len(messages)
    if n > EXACT_PIECES_MAX:
        try:
            ends = _windowed_ends(render, messages, full)
        except Exception:  # noqa: BLE001 - a template refusing a window is no verdict on these messages
            ends = None
        if ends is not None or n > EXACT_FALLBACK_MAX:
            return ends
    ends = []
    for i in range(1, n):
        end = len(r := render(messages[:i], False))
        if (ends and end < ends[-1]) or not full.startswith(r):
            return None
        ends.append(end)
    return ends


def _windowed_ends(render: Callable[[list[dict[str, str]], bool], str], messages: list[dict[str, str]],
                   full: str) -> list[int] | None:
    """`_message_ends` from renders of a few messages each, checked by exact prefix renders (see there)."""
    n = len(messages)
    first = render(messages[:1], False)
    if not full.startswith(first):
        return None
    ends, pos = [len(first)], len(first)
    for i in range(1, n - 1):  # message i's piece: render(messages[:i + 1]) less render(messages[:i])
        s = max(1, i - 3)
        s -= 1 - s % 2  # odd: message i sits at a position of i's parity in the window
        window = [messages[0], *messages[s:i]]
        before, after = render(window, False), render([*window, messages[i]], False)
        if not after.startswith(before) or not full.startswith(after[len(before):], pos):
            return None
        pos += len(after) - len(before)
        ends.append(pos)
    for i in sorted({n - 1, *(n * k // 5 for k in range(1, 5))} - {0}):  # the split checked where it counts
        r = render(messages[:i], False)
        if len(r) != ends[i - 1] or not full.startswith(r):
            return None
    return ends


# ---- running choices ----------------------------------------------------------------------------
class _Choice:
    def __init__(self, index: int, queue: asyncio.Queue, timer: RequestTimer | None, prompt_tokens: int = 0) -> None:
        self.index = index
        self.queue = queue
        self.timer = timer
        self.prompt_tokens = prompt_tokens
        self.text = ""
        self.tokens = 0  # tokens generated up to the end of `text`
        self.result: CompletionResult | None = None
        self.pending_logprobs: list[Any] = []  # token logprobs not sent with a delta yet
        self.prompt_logprobs: list[Any] | None = None  # the prompt's token logprobs (echo with logprobs)

    def take_logprobs(self) -> list[Any]:
        out, self.pending_logprobs = self.pending_logprobs, []
        return out


class _Events:
    """Merges the choices' core queues: (choice, text delta | result) in arrival order; token logprobs
    collect in `choice.pending_logprobs` before the text they belong to. Raises the first failure. Timers
    see every delta and the end of each choice. Choices still running when this ends early (a failure, or
    the client disconnected) are cancelled in the core: their generations are aborted. `first()` waits
    for the first delta, result or failure, so a stream whose request the engine refuses is answered with
    an error status rather than a stream that fails."""

    def __init__(self, choices: list[_Choice], core: ParrotServeCore | None = None) -> None:
        self.choices, self.core = choices, core
        self.merged: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._pump(c)) for c in choices]
        self.remaining = len(choices)
        self.held: tuple[_Choice, Any] | None = None
        self.closed = False
        self.failed = False  # a choice failed: the others, cut short with it, fail too (else they are aborted)

    async def _pump(self, choice: _Choice) -> None:
        while True:
            item = await choice.queue.get()
            self.merged.put_nowait((choice, item))
            if not isinstance(item, str | TokenLogprobs | PromptLogprobs):
                return

    async def _next(self) -> tuple[_Choice, str | CompletionResult] | None:
        while self.remaining:
            choice, item = self.held if self.held is not None else await self.merged.get()
            self.held = None
            if isinstance(item, TokenLogprobs):
                choice.pending_logprobs.extend(item.items)
                continue
            if isinstance(item, PromptLogprobs):
                choice.prompt_logprobs = item.items
                continue
            if isinstance(item, str):
                if not item:
                    continue
                if choice.timer is not None:
                    choice.timer.delta()
                choice.text += item
                choice.tokens = getattr(item, "tokens", choice.tokens)
                return choice, item
            self.remaining -= 1
            if isinstance(item, BaseException):
                self.failed = True
                if choice.timer is not None:
                    choice.timer.fail()
                raise item
            choice.result = item
            choice.tokens = len(item.token_ids)
            if choice.timer is not None:
                choice.timer.finish(item.prompt_tokens, len(item.token_ids), item.finish_reason)
            return choice, item
        return None

    async def first(self) -> None:
        try:
            while self.held is None:
                choice, item = await self.merged.get()
                if isinstance(item, TokenLogprobs):
                    choice.pending_logprobs.extend(item.items)
                elif isinstance(item, PromptLogprobs):
                    choice.prompt_logprobs = item.items
                elif not (isinstance(item, str) and not item):
                    self.held = (choice, item)
            if isinstance(self.held[1], BaseException):
                await self._next()  # raises it
        except BaseException:
            self.close()
            raise

    async def __aiter__(self) -> AsyncIterator[tuple[_Choice, str | CompletionResult]]:
        try:
            while (event := await self._next()) is not None:
                yield event
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for t in self.tasks:
            t.cancel()
        for c in self.choices:  # choices still running when the request ended (error, disconnect)
            if c.result is None and c.timer is not None:
                c.timer.fail() if self.failed else c.timer.abort()
            if c.result is None and self.core is not None:
                self.core.cancel_completion(c.queue)


async def _collect(choices: list[_Choice], core: ParrotServeCore, request: Request | None,
                   poll: float = 0.5) -> None:
    """Run the choices to their end for a non-streamed answer; a client that disconnects meanwhile cancels
    them (their generations are aborted) instead of leaving them to run for nobody."""

    async def drain() -> None:
        async for _ in _Events(choices, core):
            pass

    await while_connected(request, drain(), _client_gone, poll)


def _client_gone() -> OpenAIError:
    return OpenAIError(499, "the client disconnected", code="aborted")  # nobody reads this answer


async def _first_or_disconnect(events: _Events, request: Request, poll: float = 0.5) -> None:
    """`events.first()`, unless the client disconnects first: then the choices are cancelled (their
    generations aborted) and the request ends with 499."""

    def gone() -> OpenAIError:
        events.close()
        return _client_gone()

    await while_connected(request, events.first(), gone, poll)


class _EventStream(StreamingResponse):
    """A stream that runs `on_close` however it ends: also when the client is gone before its first byte
    is sent, where the body's generator never starts (and so never runs its own cleanup)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    def close(self) -> None:
        """Run `on_close` now (a stream relaying this one ended: `openai_responses`)."""
        self._on_close()


def _usage(choices: list[_Choice], n: int) -> dict:
    """prompt tokens count once per prompt (the first choice of each), completion tokens for every choice."""
    results = [c.result for c in choices if c.result is not None]
    firsts = [c.result for c in choices if c.result is not None and c.index % n == 0]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def _usage_so_far(c: _Choice) -> dict:
    """One choice's usage up to now (vLLM's continuous usage statistics, in each chunk)."""
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.tokens, "total_tokens": c.prompt_tokens + c.tokens}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _prompt_only(result: CompletionResult) -> CompletionResult:
    """A completion asked for with max_tokens 0 (echo): the generated token (one, for the engine's sake)
    left out."""
    return dataclasses.replace(result, text="", token_ids=[], finish_reason="length",
                               logprobs=None if result.logprobs is None else [])


def _rest(c: _Choice, result: CompletionResult) -> str:
    """Text of the result the deltas have not shown yet (normally none)."""
    return result.text[len(c.text):] if result.text.startswith(c.text) else ""


def openai_routes(core: ParrotServeCore, metrics: ParrotMetrics | None = None,
                  sampling_defaults: SamplingDefaults | None = None) -> APIRouter:
    """The OpenAI-compatible routes; request latencies go to `metrics` when given. Sampling settings a
    request leaves out come from `sampling_defaults` (default: the served model's recommendation, else
    llama.cpp's defaults; see parrot/serve/sampling_defaults.py)."""
    router = APIRouter(route_class=OpenAIRoute)

    @functools.cache
    def defaults() -> SamplingDefaults:
        return sampling_defaults or model_sampling_defaults(core.model)

    # read now, beside start-up, not in the first request (a GGUF's metadata: ~0.1 s for a 49k vocabulary)
    threading.Thread(target=defaults, name="parrot-sampling-defaults", daemon=True).start()

    def vocab_size() -> int | None:
        try:
            return core.tokenizers.get(core.model).backend.get_vocab_size()
        except ParrotError:
            return None

    served = core.served_model_names

    def answered_as(requested: str | None) -> str:
        """The model name an answer carries: the one the request named where it is one of the served names (as
        vLLM echoes it), else the first (requests may name any model)."""
        return requested if requested in served else served[0]

    def model_card(name: str) -> dict:
        """vLLM's model card: its `root` (the model as given to the server), `max_model_len` (the most tokens a
        sequence may hold: the shortest engine's context, or its KV pool where smaller), and the sampling
        defaults in use."""
        return {"id": name, "object": "model", "created": CREATED, "owned_by": "parrot", "root": core.model,
                "parent": None, "max_model_len": core.engines.max_sequence_len(live_only=False),
                "sampling_defaults": defaults().to_json()}

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @router.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in served]}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id not in served:
            raise OpenAIError(404, f"the model {model_id!r} does not exist (served: {', '.join(map(repr, served))})",
                              param="model", code="model_not_found")
        return model_card(model_id)

    def samplings(body: SamplingRequest, max_tokens: int, extra: dict[str, Any]) -> list[SamplingParams]:
        fields = body.sampling_fields(max_tokens, defaults(), vocab_size())
        fields.update(extra)
        return [body.sampling(fields, i) for i in range(body.n)]  # all validated before anything runs

    async def validate_constraint(body: SamplingRequest, params: list[SamplingParams], tools: bool = False) -> None:
        """The output constraint compiles (`constraints.validate`); else a 400 naming the parameter that asked
        for it (`tools` where a tool call's schema constrains the answer)."""
        try:
            await constraints.validate(params[0])
        except InvalidRequestError as exc:
            asked = body.constraint()
            raise OpenAIError(400, str(exc), param=asked[2] if asked is not None else "tools" if tools else None,
                              code=exc.code) from exc

    async def submit(pieces_list: list[tuple[list[str] | list[list[int]], int]], body: SamplingRequest,
                     params: list[SamplingParams], endpoint: str, start: float,
                     prompt_logprobs: int | None = None, implicit_max: bool = False,
                     client: int | None = None) -> list[_Choice]:
        """Each prompt's pieces are text, or token ids given as they are (`ParrotServeCore.complete`).
        `implicit_max`: the request named no max_tokens, so its default is capped at what the context (and the
        smallest KV pool) leaves after each prompt (as vLLM does), not refused."""
        # each prompt tokenized once: counted here, then scheduled with these ids (`n` choices share them);
        # on a worker thread, as a long prompt takes seconds (`encode_pieces` lets go of the GIL meanwhile)
        tokens = await asyncio.to_thread(lambda: [core.prompt_tokens(pieces) for pieces, _ in pieces_list])
        limit = core.engines.max_context_len()
        per_prompt = [params] * len(tokens)
        if limit is not None:  # a clear 400 up front rather than an engine error later (or inside a stream)
            param = "messages" if endpoint == "chat" else "prompt"
            most = core.engines.max_sequence_len() or limit  # the context, or the smallest engine's whole KV pool
            held = f"this model's maximum context length is {limit} tokens" + (
                f" and the KV cache holds {most}" if most < limit else "")
            for p, ids in enumerate(tokens):
                n_prompt = sum(len(piece) for piece in ids)
                room = most - n_prompt
                least = max(1, params[0].min_tokens)
                if implicit_max and least <= room < params[0].max_tokens:
                    per_prompt[p] = [sp.model_copy(update={"max_tokens": room}) for sp in params]
                elif implicit_max and room < least:  # the default asked for nothing: say what the prompt leaves
                    raise OpenAIError(400, f"{held}; the {param} has {n_prompt} tokens, which leaves room for "
                                      f"{max(room, 0)} generated tokens" + (f" (min_tokens is {least})" if least > 1
                                                                            else ""),
                                      param=param, code="context_length_exceeded")
                elif n_prompt + params[0].max_tokens > most:
                    raise OpenAIError(
                        400, f"{held}; the {param} has {n_prompt} tokens and max_tokens is {params[0].max_tokens}",
                        param=param if n_prompt >= most else "max_tokens", code="context_length_exceeded")
        choices: list[_Choice] = []
        try:
            for p, (pieces, shared) in enumerate(pieces_list):
                for i in range(body.n):
                    queue = core.complete(pieces, per_prompt[p][i], "latency", shared, prompt_logprobs,
                                          tokens=tokens[p], arrived=start, cache_salt=body.cache_salt, client=client)
                    timer = metrics.start_request(endpoint, start) if metrics is not None else None
                    choices.append(_Choice(p * body.n + i, queue, timer, sum(map(len, tokens[p]))))
        except BaseException:  # a choice refused (a limit reached, no engine): the request fails whole, and the
            for c in choices:  # choices already queued do not run for nobody
                core.cancel_completion(c.queue, "another choice of the request was refused")
            raise
        return choices

    async def stream_response(events: _Events, gen: AsyncIterator[str], request: Request) -> StreamingResponse:
        # an error before the first token is the response's status, not a stream event; a client that
        # leaves before it (a long queue, a long prompt) cancels its choices
        await _first_or_disconnect(events, request)

        async def lines() -> AsyncIterator[str]:
            try:
                async for line in gen:
                    yield line
            except Exception as exc:  # noqa: BLE001 - after the headers: report in the stream
                yield _sse(from_exception(exc).body())
                return
            finally:
                events.close()
            yield "data: [DONE]\n\n"

        return _EventStream(lines(), events.close, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- /v1/completions ----------------------------------------------------------------------
    @router.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> dict | StreamingResponse:
        start = time.perf_counter()
        prompts = body.check(vocab_size())
        # what echo shows: the text, or the token ids' text (special tokens included, as they are in the prompt)
        texts = [p if isinstance(p, str) else core.tokenizers.decode(core.model, p, skip_special_tokens=False)
                 for p in prompts] if body.echo else []
        prompt_only = body.max_tokens == 0  # echo: the prompt (and its logprobs); the engine generates one token
        params = samplings(body, 16 if body.max_tokens is None else max(body.max_tokens, 1), body.logprob_fields())
        await validate_constraint(body, params)
        choices = await submit([([p], 0) for p in prompts], body, params, "completions", start,
                               body.prompt_logprobs, implicit_max=body.max_tokens is None, client=client_of(request))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": answered_as(body.model)}
        top_n = body.logprobs or 0
        want_logprobs = body.logprobs is not None

        def prompt_logprobs(c: _Choice) -> dict | None:
            """The echoed prompt's logprobs (OpenAI's completion shape), or None without logprobs."""
            if not want_logprobs:
                return None
            return completion_logprobs(c.prompt_logprobs or [], top_n)

        if not body.stream:
            await _collect(choices, core, request)
            out = []
            for c in choices:
                if prompt_only:
                    c.result = _prompt_only(c.result)
                r = c.result
                prefix = texts[c.index // body.n] if body.echo else ""
                logprobs = completion_logprobs(r.logprobs or [], top_n, len(prefix)) if want_logprobs else None
                if logprobs is not None and body.echo:
                    echoed = prompt_logprobs(c)
                    logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
                out.append({"index": c.index, "text": prefix + r.text, "logprobs": logprobs,
                            "finish_reason": r.finish_reason, "stop_reason": r.stop_reason})
            return {**base, "choices": out, "usage": _usage(choices, body.n)}

        events = _Events(choices, core)
        offsets = {c.index: 0 for c in choices}
        live_usage = body.usage_in_chunks()

        def chunk(c: _Choice, text: str, finish: str | None, stop: int | str | None = None) -> str:
            logprobs = None
            if want_logprobs:
                logprobs = completion_logprobs(c.take_logprobs(), top_n, offsets[c.index])
            offsets[c.index] += len(text)
            return _sse({**base, "choices": [{"index": c.index, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish, **({"stop_reason": stop} if finish else {})}],
                         **({"usage": _usage_so_far(c)} if live_usage else {})})

        async def gen() -> AsyncIterator[str]:
            echoed: set[int] = set()
            async for c, item in events:
                if body.echo and c.index not in echoed:  # the prompt first
                    echoed.add(c.index)
                    prompt = texts[c.index // body.n]
                    offsets[c.index] += len(prompt)
                    yield _sse({**base, "choices": [{"index": c.index, "text": prompt,
                                                     "logprobs": prompt_logprobs(c), "finish_reason": None}],
                                **({"usage": _usage_so_far(c)} if live_usage else {})})
                if prompt_only:  # nothing generated to show: the end
                    c.take_logprobs()
                    if isinstance(item, CompletionResult):
                        c.result = _prompt_only(item)
                        yield chunk(c, "", "length")
                elif isinstance(item, str):
                    yield chunk(c, item, None)
                else:
                    yield chunk(c, _rest(c, item), item.finish_reason, item.stop_reason)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(choices, body.n)})

        return await stream_response(events, gen(), request)

    # ---- /v1/chat/completions -----------------------------------------------------------------
    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict | StreamingResponse:
        start = time.perf_counter()
        body.check()
        legacy = body.functions is not None or body.function_call is not None  # openai_functions.py

        def prompt() -> tuple[list[Any], Any, list[str], int]:
            tok = core.tokenizers.get(core.model)
            tools, choice, render, msgs = chat_input(tok, body.messages, body.tools, body.tool_choice,
                                                     body.functions, body.function_call, body.chat_template_kwargs)
            return tools, choice, *rendered_pieces(render, msgs, body.add_generation_prompt,
                                                   body.continue_final_message)

        # on a worker thread: a long chat's template renders take a while, and other clients are served meanwhile
        tools, choice, pieces, shared = await asyncio.to_thread(prompt)
        extra = body.logprob_fields()
        parallel = body.parallel_tool_calls is not False and not legacy
        constrained = tool_constraint(choice, tools, parallel)
        if constrained is not None:
            if body.constraint() is not None:
                raise OpenAIError(400, f"tool_choice {choice.mode!r} constrains the answer to a tool call: it cannot "
                                  "be combined with response_format or another output constraint", param="tool_choice")
            require(constrained[0], "tool_choice", f"tool_choice {choice.mode!r} (constrained tool calls)")
            check_forced_call(choice, body.add_generation_prompt)
            extra[constrained[0]] = constrained[1]
            pieces = [*pieces[:-1], pieces[-1] + forced_prefix(choice)]
        # left out: the rest of the context (OpenAI's and vLLM's default; `submit` caps it per prompt)
        implicit = core.engines.max_context_len() or core.default_max_tokens
        params = samplings(body, body.max_completion_tokens or body.max_tokens or implicit, extra)
        await validate_constraint(body, params, tools=constrained is not None)
        choices = await submit([(pieces, shared)], body, params, "chat", start,
                               implicit_max=body.max_completion_tokens is None and body.max_tokens is None,
                               client=client_of(request))
        answers = {c.index: ToolAnswer(choice, tools, parallel) for c in choices}
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": answered_as(body.model),
                "system_fingerprint": None}

        def logprobs_of(items: list[Any]) -> dict | None:
            return chat_logprobs(items, body.top_logprobs or 0) if body.logprobs else None

        if not body.stream:
            await _collect(choices, core, request)
            out = []
            for c in choices:
                message, finish = answers[c.index].message(c.result.text, c.result.finish_reason)
                if legacy:
                    message, finish = legacy_functions.message(message, finish)
                out.append({"index": c.index, "message": message, "logprobs": logprobs_of(c.result.logprobs or []),
                            "finish_reason": finish, "stop_reason": c.result.stop_reason})
            return {**base, "choices": out, "usage": _usage(choices, body.n)}

        chunk = {**base, "object": "chat.completion.chunk"}
        events = _Events(choices, core)
        live_usage = body.usage_in_chunks()

        def event(c: _Choice, delta: dict | None, finish: str | None, logprobs: list[Any] | None = None,
                  stop: int | str | None = None) -> str:
            lp = logprobs_of(logprobs) if logprobs else None
            if legacy:
                delta, finish = legacy_functions.delta(delta) or {}, legacy_functions.finish_reason(finish)
            return _sse({**chunk, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                               "finish_reason": finish, **({"stop_reason": stop} if finish else {})}],
                         **({"usage": _usage_so_far(c)} if live_usage else {})})

        async def gen() -> AsyncIterator[str]:
            for c in choices:
                yield event(c, answers[c.index].opening(), None)
            async for c, item in events:
                answer = answers[c.index]
                if isinstance(item, str):
                    for delta in answer.feed(item):
                        yield event(c, delta, None, c.take_logprobs())
                    continue
                deltas = answer.feed(_rest(c, item)) if _rest(c, item) else []
                closing, finish = answer.close(item.text, item.finish_reason)
                for delta in deltas + closing:
                    yield event(c, delta, None, c.take_logprobs())
                yield event(c, {}, finish, c.take_logprobs(), item.stop_reason)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**chunk, "choices": [], "usage": _usage(choices, body.n)})

        return await stream_response(events, gen(), request)

    router.include_router(responses_routes(chat_completions, answered_as))  # /v1/responses, over the chat route
    return router


def frontend_routes(core: ParrotServeCore, metrics: ParrotMetrics | None = None) -> APIRouter:
    """The OpenAI-compatible routes and `/metrics` sharing one ParrotMetrics (made here if not given)."""
    metrics = metrics or ParrotMetrics(core)
    router = APIRouter()
    router.include_router(openai_routes(core, metrics))
    router.include_router(metrics.router())
    router.metrics = metrics  # type: ignore[attr-defined] - so callers can reach it
    return router
