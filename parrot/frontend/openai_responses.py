"""OpenAI's Responses API, `POST /v1/responses`, over the chat completions route.

A request is translated into a chat completion (`instructions` the system message, `input` the messages: text,
earlier `function_call` items as an assistant's tool calls and `function_call_output` items as tool results;
`text.format` the response format; function tools in the chat shape), runs through the same route (and so
the same scheduler, prefix cache, sampling defaults, constraints and tool parsing), and its answer is shaped
as a Response: a `message` item with the text and a `function_call` item per tool call, `status` "incomplete"
where `max_output_tokens` ended it. Streamed, the chat chunks become Responses events (`response.created`,
`response.output_item.added`, `response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`).

Token logprobs come with `include: ["message.output_text.logprobs"]` (or `top_logprobs`, the alternatives per
token), on the `output_text` part and its deltas. Nothing is stored: `store: true`, `previous_response_id`,
`conversation` and `background` are refused with a 400 naming them, as are the parameters that would change the
output and are not implemented (hosted tools, `reasoning`, other `include`s, `text.verbosity` but "medium",
`truncation: "auto"`, ...). vLLM's sampling extensions (`top_k`, `seed`, `stop`, ...) given beside the Responses
parameters reach the chat route as they are. An error the chat route finds names the Responses field (`input.3`,
`max_output_tokens`, `text.format`, `tools.0.name`), not the chat completion it was translated to.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from parrot.frontend.openai_errors import OpenAIError, OpenAIRoute, unsupported
from parrot.frontend.openai_requests import ChatCompletionRequest
from parrot.sse import sse_lines

ChatRoute = Callable[[ChatCompletionRequest, Request], Awaitable[dict | StreamingResponse]]

log = logging.getLogger(__name__)
LOGPROBS = "message.output_text.logprobs"  # the one `include` value honoured

# Responses parameters that would change the output or promise what is not done: refused unless absent or as
# given here (what a client sending every field at its default sends)
REFUSED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (), "conversation": (), "prompt": (), "reasoning": (),
    "background": (False,), "max_tool_calls": (), "truncation": ("disabled",), "moderation": (),
    "image": (), "access_programs": (), "background_options": (), "context_management": (),
    "prompt_cache_options": (), "n": (1,),
}


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses; other fields go to the chat route as they are (vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no effect on the text
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check(self) -> None:
        for name, neutral in REFUSED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value not in neutral:
                raise unsupported(name, f"{name} (responses are not stored, and it is not implemented)"
                                  if name in ("previous_response_id", "conversation", "background") else name)
        if self.store:
            raise unsupported("store", "store (responses are not stored: give store false, and the whole input "
                                       "each time)")
        for i, name in enumerate(self.include or []):
            if name != LOGPROBS:
                raise unsupported(f"include.{i}", f"include {name!r} (only {LOGPROBS!r})")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise unsupported("text.verbosity", "text.verbosity other than 'medium'")

    def logprobs(self) -> bool:
        """Token logprobs were asked for (`include`, `top_logprobs`, or vLLM's `logprobs: true`)."""
        return LOGPROBS in (self.include or []) or bool(self.top_logprobs) or \
            (self.model_extra or {}).get("logprobs") is True

    def chat_body(self, origins: list[str] | None = None) -> dict[str, Any]:
        """The chat completion this request is; `origins` gets, per chat message, the Responses field it
        came from (`instructions`, `input.3`)."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in REFUSED}
        body: dict[str, Any] = {**extra, "messages": _messages(self.instructions, self.input, origins)}
        for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier",
                     "prompt_cache_key", "prompt_cache_retention", "service_tier"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None and (self.tools or self.tool_choice not in ("auto", "none")):
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)  # (the defaults "auto" and "none" need no
            # tools here, as OpenAI takes them: a client echoing a Response's settings back sends "auto")
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        if self.logprobs():
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}  # the usage of response.completed
        return body


# ---- request translation -----------------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    """A message's content: text, or parts of `input_text` / `output_text` (a 400 for images, files, audio)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}.content must be text or a list of content parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            field = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(field), str):
                raise OpenAIError(400, f"{where}.content.{j}.{field} must be a string",
                                  param=f"{where}.content.{j}.{field}")
            texts.append(part[field])
        else:
            raise unsupported(f"{where}.content.{j}", f"content parts of type {kind!r} (text only)")
    return "".join(texts)


def _messages(instructions: str | None, given: str | list[Any], origins: list[str] | None = None
              ) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input`: consecutive function calls are one assistant turn.
    `origins` gets each message's Responses field (a merged turn: its first call's)."""
    origins = [] if origins is None else origins
    out: list[dict[str, Any]] = []

    def add(message: dict[str, Any], origin: str) -> None:
        out.append(message)
        origins.append(origin)

    if instructions:
        add({"role": "system", "content": instructions}, "instructions")
    if isinstance(given, str):
        add({"role": "user", "content": given}, "input")
        return out
    if not given:
        raise OpenAIError(400, "input must not be empty", param="input")
    for i, item in enumerate(given):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise OpenAIError(400, f"{where} must be an object (a message or an item)", param=where)
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(400, f"{where}.role must be user, system, developer or assistant",
                                  param=f"{where}.role")
            add({"role": role, "content": _text_of(item.get("content"), where)}, where)
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": _str_field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                add({"role": "assistant", "content": None, "tool_calls": [call]}, where)
        elif kind == "function_call_output":
            output = item.get("output")
            add({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                 "content": output if isinstance(output, str) else _text_of(output, where)}, where)
        else:
            raise unsupported(f"{where}.type", f"input items of type {kind!r}")
    return out


def _str_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise OpenAIError(400, f"{where}.{name} must be a string", param=f"{where}.{name}")
    return value


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (`{type, name, description, parameters, strict}`) in the chat shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise unsupported(f"tools.{i}", f"tools of type {kind!r} (function tools only)")
    if not isinstance(tool.get("name"), str):
        raise OpenAIError(400, f"tools.{i}.name must be a string", param=f"tools.{i}.name")
    spec = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": spec}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise OpenAIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": '
                                   '...}: tool_choice.name must be a string', param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise unsupported("tool_choice", f"tool_choice of type {kind!r}")


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise OpenAIError(400, "text.format.schema is required (a JSON schema object)", param="text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise unsupported("text.format", f"text.format of type {kind!r}")


_CHAT_NAMES = [  # a chat completion's field (in a message or a param) -> the Responses field it came from
    (re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format(?:\.json_schema)?"), "text.format"),
    (re.compile(r"\btool_choice\.function"), "tool_choice"),
    (re.compile(r"\btools(?:\[(\d+)\]|\.(\d+))\.function"), r"tools.\1\2"),
    (re.compile(r"\btool_call_id\b"), "call_id"),
    (re.compile(r"\bmessages\b"), "input"),  # (the messages as a whole; one of them: `_MESSAGE`)
]
_MESSAGE = re.compile(r"\bmessages(?:\[(\d+)\]|\.(\d+))")


def _in_responses_terms(exc: OpenAIError, origins: list[str]) -> OpenAIError:
    """An error of the chat route, naming the Responses fields (`messages[2]` is the input item it came from)."""
    def translate(text: str | None) -> str | None:
        if text is None:
            return None
        text = _MESSAGE.sub(lambda m: origins[int(m[1] or m[2])] if int(m[1] or m[2]) < len(origins) else "input",
                            text)
        for pattern, name in _CHAT_NAMES:
            text = pattern.sub(name, text)
        return text

    exc.message, exc.param = translate(exc.message) or "", translate(exc.param)
    return exc


# ---- answers -------------------------------------------------------------------------------------------
def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat:
        return None
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str = "completed",
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _Shell:
    """What every Response object of one request says besides its output."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body

    def response(self, model: str, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 finish: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": model, "status": status,
            "output": output, "usage": usage, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": None,
            "temperature": b.temperature, "top_p": b.top_p, "tools": b.tools or [],
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "text": {**(b.text or {}), "format": (b.text or {}).get("format") or {"type": "text"}},
            "truncation": "disabled", "store": False,
            "reasoning": None, "user": b.user, "top_logprobs": b.top_logprobs,
        }


def _whole(shell: _Shell, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content") or not message.get("tool_calls"):  # an empty answer is an empty message
        output.append(_message_item(f"msg_{uuid.uuid4().hex}", message.get("content") or "",
                                    logprobs=(choice.get("logprobs") or {}).get("content")))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        output.append(_call_item(f"fc_{uuid.uuid4().hex}", call["id"], fn["name"], fn["arguments"]))
    finish = choice["finish_reason"]
    if finish == "length":  # the item max_output_tokens cut short (a call's arguments are not whole JSON then)
        output[-1]["status"] = "incomplete"
    return shell.response(chat["model"], "incomplete" if finish == "length" else "completed", output,
                          _usage(chat.get("usage")), finish)


class _StreamedAnswer:
    """Chat chunks in, Responses events out (each with its `sequence_number`)."""

    def __init__(self, shell: _Shell, model: str) -> None:
        self.shell, self.model = shell, model
        self.seq = -1  # the first event's sequence_number is 0
        self.output: list[dict[str, Any]] = []  # the items so far, in order
        self.text_at: int | None = None  # the message item's index in `output`, once text came
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's index in `output`
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        data = {"type": kind, "sequence_number": self.seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        shown = self.shell.response(self.model, "in_progress", [], None)
        return [self.event("response.created", response=shown), self.event("response.in_progress", response=shown)]

    def chunk(self, data: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if data.get("usage") and not data.get("choices"):
            self.usage = _usage(data["usage"])
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content") or logprobs:
                out += self._text(delta.get("content") or "", logprobs)
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _text(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        out = []
        if self.text_at is None:  # the message item opens
            self.text_at = len(self.output)
            item = {**_message_item(f"msg_{uuid.uuid4().hex}", ""), "status": "in_progress", "content": []}
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=self.text_at, item=dict(item)))
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.text_at,
                                  content_index=0, part=dict(item["content"][0])))
        item = self.output[self.text_at]
        if not text and not logprobs:
            return out
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs or []
        return [*out, self.event("response.output_text.delta", item_id=item["id"], output_index=self.text_at,
                                 content_index=0, delta=text, logprobs=logprobs or [])]

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = []
        fn = call.get("function") or {}
        at = self.calls.get(call.get("index", 0))
        if at is None:
            at = self.calls[call.get("index", 0)] = len(self.output)
            item = _call_item(f"fc_{uuid.uuid4().hex}", call.get("id") or "", fn.get("name") or "", "", "in_progress")
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=at, item=dict(item)))
        item = self.output[at]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                  delta=fn["arguments"]))
        return out

    def closing(self) -> list[str]:
        out = [] if self.output else self._text("")  # an empty answer is an empty message
        incomplete = self.finish == "length"
        for at, item in enumerate(self.output):  # the last one is what max_output_tokens cut short
            item["status"] = "incomplete" if incomplete and at == len(self.output) - 1 else "completed"
            if item["type"] == "message":
                part = item["content"][0]
                out += [self.event("response.output_text.done", item_id=item["id"], output_index=at,
                                   content_index=0, text=part["text"], logprobs=part["logprobs"]),
                        self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                   content_index=0, part=part)]
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=at, name=item["name"], arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=at, item=item))
        done = self.shell.response(self.model, "incomplete" if incomplete else "completed", self.output,
                                   self.usage, self.finish)
        return [*out, self.event("response.incomplete" if incomplete else "response.completed", response=done)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        err = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        return [self.event("error", code=err["code"], message=err["message"], param=error.get("param")),
                self.event("response.failed", response=self.shell.response(self.model, "failed", self.output,
                                                                           self.usage, error=err))]


class _Relayed(StreamingResponse):
    """A stream made of another's (the chat route's): that one's cleanup runs however this one ends."""

    def __init__(self, content: AsyncIterator[str], inner: StreamingResponse, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.inner = inner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(RuntimeError):  # (ended already, as it normally has)
                await self.inner.body_iterator.aclose()  # type: ignore[attr-defined]
            close = getattr(self.inner, "close", None)
            if close is not None:
                close()


def responses_routes(chat: ChatRoute, answered_as: Callable[[str | None], str]) -> APIRouter:
    """`POST /v1/responses` over `chat`, the chat completions route; `answered_as` names the model an answer
    carries for the model a request names."""
    router = APIRouter(route_class=OpenAIRoute)

    @router.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest, request: Request) -> dict | StreamingResponse:
        body.check()
        shell = _Shell(body)
        origins: list[str] = []
        try:
            chat_body = ChatCompletionRequest.model_validate(body.chat_body(origins))
        except ValidationError as exc:
            e = exc.errors(include_url=False)[0]
            where = ".".join(map(str, e.get("loc", ())))
            raise _in_responses_terms(OpenAIError(400, f"{where}: {e.get('msg')}", param=where or None),
                                      origins) from None
        try:
            answer = await chat(chat_body, request)
        except OpenAIError as exc:
            raise _in_responses_terms(exc, origins) from None
        if isinstance(answer, dict):
            return _whole(shell, answer)
        streamed = _StreamedAnswer(shell, answered_as(chat_body.model))

        async def events() -> AsyncIterator[str]:
            for line in streamed.opening():
                yield line
            try:
                async for line in sse_lines(answer.body_iterator):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[len("data: "):])
                    if "error" in data:
                        err = _in_responses_terms(OpenAIError(400, data["error"].get("message", ""),
                                                              param=data["error"].get("param")), origins)
                        for out in streamed.failed({**data["error"], "message": err.message, "param": err.param}):
                            yield out
                        return
                    for out in streamed.chunk(data):
                        yield out
            except Exception as exc:  # noqa: BLE001 - the stream ends with an explicit failure, not a cut
                log.exception("the response stream %s failed", shell.id)
                for out in streamed.failed({"code": "server_error", "message": f"the response failed: {exc}"}):
                    yield out
                return
            for out in streamed.closing():
                yield out

        return _Relayed(events(), answer, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
