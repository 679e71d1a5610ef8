"""Tool calls on the OpenAI chat API: `tools` and `tool_choice` in, `tool_calls` out.

- Tools reach the model through its chat template when the template uses `tools` (Hermes / Qwen style
  templates), otherwise through the default tool prompt (`default_tool_prompt`), added to the system
  message. Either way the model is asked to answer a call as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- `tool_choice`: "none" (tools are left out of the prompt, nothing is parsed), "auto" (the default with
  tools: the model's text is parsed for tool calls), "required" (the answer is constrained to call objects of
  the tools: a JSON schema built from their parameter schemas; one or more, each in its `<tool_call>` block,
  unless parallel_tool_calls is false), or a named function (the
  prompt ends with that call's opening, `<tool_call>\\n{"name": "NAME", "arguments": `, and the answer is
  constrained by the function's parameter schema). Constrained arguments are always valid JSON.
- Earlier turns: assistant messages with `tool_calls` and `tool` messages are rendered by a template that
  knows tools; otherwise as `<tool_call>` text and as user turns holding `<tool_response>` blocks.
- "auto" answers are read in the formats models are trained to write (`parse_tool_calls`): Hermes / Qwen
  `<tool_call>` blocks anywhere in the text, or an answer that is only calls: Mistral's `[TOOL_CALLS]`
  followed by a JSON list, Llama 3.1's `<|python_tag|>` followed by call objects (`;`-separated), a JSON
  call object or list of them, or one of those in a ```json fence. A call object is `{"name", "arguments"}`
  (or "parameters", Llama's key), its arguments an object or JSON text.

The OpenAI shapes: a call is `{"id", "type": "function", "function": {"name", "arguments"}}` with the
arguments a JSON string; streamed calls arrive as `delta.tool_calls` entries with an `index`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from parrot.engine.structured import JSON_OPTIONS
from parrot.frontend.strict_schema import strict_schema

MAX_TOOLS = 128
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK_RE = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class ToolError(ValueError):
    """Malformed tools / tool_choice / tool messages: the API answers 400 with `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: FunctionDef

    def spec(self) -> dict[str, Any]:
        """The tool as the template / the default prompt shows it (OpenAI's own JSON shape)."""
        fn: dict[str, Any] = {"name": self.function.name}
        if self.function.description:
            fn["description"] = self.function.description
        fn["parameters"] = self.parameters()
        return {"type": "function", "function": fn}

    def parameters(self) -> dict[str, Any]:
        return self.function.parameters if self.function.parameters is not None else {"type": "object",
                                                                                         "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # for "named"


def parse_tools(raw: list[Any] | None) -> list[ToolDef]:
    """Validate `tools`: function tools with unique names ([A-Za-z0-9_.-], at most 64) whose parameters
    are a JSON schema object. Raises ToolError."""
    if raw is None:
        return []
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools", "tools")
    tools: list[ToolDef] = []
    for i, item in enumerate(raw):
        try:
            tool = ToolDef.model_validate(item)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
            raise ToolError(f"tools[{i}] is malformed: {problems}", f"tools.{i}") from None
        if tool.type != "function":
            raise ToolError(f"tools[{i}].type {tool.type!r} is not supported (only 'function')", f"tools.{i}.type")
        if not NAME_RE.fullmatch(tool.function.name):
            raise ToolError(f"tools[{i}].function.name {tool.function.name!r} must be 1 to 64 of a-z, A-Z, 0-9, "
                            "_, . and -", f"tools.{i}.function.name")
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema of an object (type 'object'), "
                            f"got type {params.get('type')!r}", f"tools.{i}.function.parameters")
        if any(t.function.name == tool.function.name for t in tools):
            raise ToolError(f"two tools are named {tool.function.name!r}", f"tools.{i}.function.name")
        tools.append(tool)
    return tools


def parse_tool_choice(raw: Any, tools: list[ToolDef]) -> ToolChoice:
    """`tool_choice`: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
    Default: "auto" with tools, "none" without. Raises ToolError (a choice other than "none" without
    tools, an unknown function name, a malformed object)."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice {raw!r} is not one of 'none', 'auto', 'required' or a function object",
                            "tool_choice")
        if raw != "none" and not tools:
            raise ToolError(f"tool_choice {raw!r} needs tools", "tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    name = None
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
    if not isinstance(name, str):
        raise ToolError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if not any(t.function.name == name for t in tools):
        known = [t.function.name for t in tools]
        raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools {known}",
                        "tool_choice")
    return ToolChoice("named", name)


# ---- the prompt ------------------------------------------------------------------------------------
def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the chat template renders a `tools` list (as Hugging Face templates with tool support do)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def default_tool_prompt(tools: list[ToolDef]) -> str:
    """The tool prompt for a chat template that does not render tools (Hermes-style, as Qwen2.5's template
    writes it)."""
    specs = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{specs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def forced_prefix(choice: ToolChoice) -> str:
    """Text appended after the generation prompt so the answer starts inside a call: the constrained
    part is then the named call's arguments, or the call object for "required"."""
    if choice.mode == "named":
        return f'{OPEN}\n{{"name": {json.dumps(choice.name)}, "arguments": '
    if choice.mode == "required":
        return f"{OPEN}\n"
    return ""


def constraint_schema(choice: ToolChoice, tools: list[ToolDef]) -> dict[str, Any] | None:
    """The JSON schema the answer is constrained by: the named function's parameters, or for "required"
    one call object `{"name": const, "arguments": parameters}` of any tool. Arguments take no keys their
    schema does not list (objects that do not say otherwise get `additionalProperties: false`, as vLLM's
    default matcher treats them), so a call holds what the function takes."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.function.name == choice.name)
        return strict_schema(tool.parameters())
    if choice.mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "arguments": strict_schema(t.parameters())},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}
    return None


SEPARATOR = f"\n{CLOSE}\n{OPEN}\n"  # between calls of a "required" answer with parallel calls


def required_calls_grammar(tools: list[ToolDef]) -> str:
    """"required" with parallel calls (a Lark grammar for llguidance): one or more call objects of
    `constraint_schema`, each in a `<tool_call>` block of its own, as Hermes-style models write several calls
    (the first block's opening is the forced prefix); vLLM's is a JSON array of calls, at least one."""
    # compact JSON as the engine's json_schema constraints take it: inline %json would take any whitespace
    schema = {**constraint_schema(ToolChoice("required"), tools), "x-guidance": JSON_OPTIONS}  # type: ignore[dict-item]
    return (f"start: call (SEP call)* END?\nSEP: {json.dumps(SEPARATOR)}\nEND: {json.dumps(chr(10) + CLOSE)}\n"
            f"call: %json {json.dumps(schema)}")


def tool_constraint(choice: ToolChoice, tools: list[ToolDef], parallel: bool) -> tuple[str, Any] | None:
    """(SamplingParams field, value) constraining the answer of a named or "required" tool_choice (with
    `parallel`, "required" takes one or more calls: `required_calls_grammar`); None for "auto" and "none"."""
    schema = constraint_schema(choice, tools)
    if schema is None:
        return None
    if choice.mode == "required" and parallel:
        return "grammar", required_calls_grammar(tools)
    return "json_schema", schema


# ---- the answer ------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _as_call(text: str, names: set[str]) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or "parameters") naming a known tool -> a call."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


WHOLE_MARKERS = ("[TOOL_CALLS]", "<|python_tag|>")  # an answer opening with one of these is calls only
_FENCE_RE = re.compile(r"```(?:json)?\s*(.*?)\s*(?:```\s*)?\Z", re.DOTALL)


def _whole_answer_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """The calls of an answer that is nothing but calls (Mistral's `[TOOL_CALLS] [...]`, Llama's
    `<|python_tag|>{...}; {...}`, a call object or a list of them, or either in a ```json fence), or None
    when it is not one, or names an unknown tool."""
    body = text.strip()
    for marker in WHOLE_MARKERS:
        if body.startswith(marker):
            body = body[len(marker):].strip()
            break
    fence = _FENCE_RE.match(body) if body.startswith("```") else None
    if fence is not None:
        body = fence.group(1)
    if not body.startswith(("{", "[")):
        return None
    try:
        value = json.loads(body)
    except ValueError:  # Llama 3.1 writes several objects separated by ";"
        parts = [p.strip() for p in body.split(";") if p.strip()]
        calls = [_as_call(p, names) for p in parts]
        return None if len(parts) < 2 or any(c is None for c in calls) else calls  # type: ignore[return-value]
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(json.dumps(item), names) for item in items]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def could_be_whole_calls(text: str) -> bool:
    """Whether an answer beginning with `text` may turn out to be nothing but calls (a stream holds it): a
    marker, JSON, or a fence that is or may become ``` or ```json before JSON (a fence of other code, say
    ```python, streams at once)."""
    head = text.lstrip()
    if not head:
        return False
    if head[0] in "{[" or any(m.startswith(head[:len(m)]) for m in WHOLE_MARKERS):
        return True
    if not head.startswith("```"):
        return "```".startswith(head)
    rest = head[3:]
    if "json".startswith(rest):
        return True  # "```", "```js", ...: the fence's language is not known yet
    body = (rest[4:] if rest.startswith("json") else rest).lstrip()
    return not body or body[0] in "{["


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Split a model answer into (content, calls): `<tool_call>` blocks holding a call of a known tool
    (a last block may be unterminated), or an answer that is only calls (`_whole_answer_calls`). Blocks
    that do not parse stay in the content. Content is None when nothing but calls (and whitespace) was said."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK_RE.finditer(text):
        call = _as_call(m.group(1).strip(), names)
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    if not calls:
        whole = _whole_answer_calls(text, names)
        return (None, whole) if whole else (text, [])
    content = "".join(kept).rstrip()  # the text around the calls as it was said, up to its trailing whitespace
    return content or None, calls


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN (text held back)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class AutoToolStream:
    """Streams an "auto" answer: content deltas pass through, except text that is or may become a
    `<tool_call>` block, which is held until the block closes and then comes out as one tool call (or as
    content again if it is no call). `feed` and `finish` return events: ("content", text) or
    ("call", ToolCall)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.started = False  # some content went out: the answer is not calls only
        self.whole = ""  # an answer that may be calls only (`could_be_whole_calls`), held to its end

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        if not self.started:
            self.whole += delta
            if not self.whole.strip() or could_be_whole_calls(self.whole):
                return []
            delta, self.whole, self.started = self.whole, "", True  # plain text: stream it from the start
        return self._feed(delta)

    def _feed(self, delta: str) -> list[tuple[str, Any]]:
        self.buf += delta
        events: list[tuple[str, Any]] = []
        while self.buf:
            start = self.buf.find(OPEN)
            if start < 0:
                hold = _partial_open(self.buf)
                out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                if out:
                    events.append(("content", out))
                break
            if start > 0:
                events.append(("content", self.buf[:start]))
                self.buf = self.buf[start:]
            end = self.buf.find(CLOSE)
            if end < 0:
                break  # inside a block: wait for its end
            block, self.buf = self.buf[:end + len(CLOSE)], self.buf[end + len(CLOSE):]
            events.extend(self._block(block))
        return events

    def _block(self, block: str) -> list[tuple[str, Any]]:
        inner = block[len(OPEN):]
        inner = inner[:-len(CLOSE)] if inner.endswith(CLOSE) else inner
        call = _as_call(inner.strip(), self.names)
        if call is None:
            return [("content", block)]
        self.calls.append(call)
        return [("call", call)]

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the answer: a held unterminated block is a call if it parses, else content; a held
        answer is read whole, as `parse_tool_calls` reads it."""
        if not self.started and self.whole:
            whole, self.whole = self.whole, ""
            content, calls = parse_tool_calls(whole, self.names)
            self.calls.extend(calls)
            return [("content", content)] * (content is not None) + [("call", c) for c in calls]
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if rest.startswith(OPEN):
            return self._block(rest)
        return [("content", rest)]


def call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """One whole call as a streamed `delta.tool_calls` entry."""
    return {"index": index, **call.to_json()}


_CALL_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


_NEXT_CALL_RE = re.compile(r"\s*\}\s*" + re.escape(CLOSE) + r"\s*" + re.escape(OPEN))  # a call's end, the next's start


class RequiredCallStream:
    """Reads a "required" answer as it is generated: call objects (`CallReader`), one, or several apart by
    `SEPARATOR` (parallel calls). `feed` gives (call index, its name when it became complete, new argument
    text) events."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.readers = [CallReader(names)]
        self.between = ""  # text after the last call's arguments, before the next call's object

    def feed(self, delta: str) -> list[tuple[int, str | None, str]]:
        events: list[tuple[int, str | None, str]] = []
        while delta:
            reader = self.readers[-1]
            if reader.args_end is None:
                name, args = reader.feed(delta)
                if name is not None or args:
                    events.append((len(self.readers) - 1, name, args))
                if reader.args_end is None:
                    break
                delta, reader.text = reader.text[reader.args_end:], reader.text[:reader.args_end]
            self.between += delta
            found = _NEXT_CALL_RE.match(self.between)
            if found is None:
                break
            delta, self.between = self.between[found.end():], ""
            self.readers.append(CallReader(self.names))
        return events

    def calls(self, ids: list[str]) -> list[ToolCall]:
        """The calls whose names are complete and known (`CallReader.call`), the i-th with ids[i] if given."""
        out = []
        for i, reader in enumerate(self.readers):
            call = reader.call(ids[i] if i < len(ids) else new_call_id())
            if call is not None:
                out.append(call)
        return out


class CallReader:
    """Reads one call object `{"name": N, "arguments": {...}}` (keys in that order, as the constraint schema
    lists them) as it is generated: the name once it is complete, then the arguments' own text as it comes (a
    JSON scanner finds where the arguments object ends)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None  # once the arguments object closed
        self._pos = 0  # scanner position in text
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, delta: str) -> tuple[str | None, str]:
        """(the name if it became known with this delta, new argument text)."""
        self.text += delta
        new_name = None
        if self.args_start is None:
            m = _CALL_HEAD_RE.match(self.text)
            if m is None:
                return None, ""
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return None, ""
            self.name, self.args_start, self._pos = name, m.end(), m.end()
            new_name = name
        if self.args_end is not None:
            return new_name, ""
        start = self._pos
        for i in range(self._pos, len(self.text)):
            ch = self.text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.args_end = i + 1
                    self._pos = i + 1
                    return new_name, self.text[start:i + 1]
        self._pos = len(self.text)
        return new_name, self.text[start:]

    def call(self, call_id: str) -> ToolCall | None:
        """The call once its name is complete and known, with its arguments as generated so far (whole once
        `args_end` is set; cut short when max_tokens came first)."""
        if self.name not in self.names or self.args_start is None:
            return None
        return ToolCall(self.name, self.text[self.args_start:self.args_end or len(self.text)], call_id)


class ToolAnswer:
    """Shapes one choice's answer by `tool_choice`: the message of a whole answer, or the `delta`s of a
    streamed one. "none": content only. "named": the text is the call's arguments. "required": the text is
    one or more call objects (`RequiredCallStream`). "auto": text with `<tool_call>` blocks; `parallel` False
    keeps the first call only."""

    def __init__(self, choice: ToolChoice, tools: list[ToolDef], parallel: bool = True) -> None:
        self.choice = choice
        self.names = {t.function.name for t in tools}
        self.parallel = parallel
        self.auto = AutoToolStream(self.names) if choice.mode == "auto" else None
        self.required = RequiredCallStream(self.names) if choice.mode == "required" else None
        self.named_id = new_call_id()
        self.streamed_calls = 0
        self.held_space = ""  # "auto": the content's trailing whitespace, not sent yet (no text may follow it)

    @property
    def calls_tools(self) -> bool:
        return self.choice.mode in ("named", "required")

    def finish_reason(self, finish: str, called: bool) -> str:
        return "tool_calls" if called and finish == "stop" else finish

    # -- whole answers --
    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """(the assistant message, finish_reason)."""
        mode = self.choice.mode
        content: str | None = text
        calls: list[ToolCall] = []
        if mode == "named":
            content, calls = None, [ToolCall(self.choice.name or "", text, self.named_id)]
        elif mode == "required":
            reader = RequiredCallStream(self.names)
            reader.feed(text)
            calls = reader.calls([self.named_id])
            if calls:
                content = None
        elif mode == "auto":
            content, calls = parse_tool_calls(text, self.names)
            if not self.parallel:
                calls = calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.to_json() for c in calls]
        return msg, self.finish_reason(finish, bool(calls))

    # -- streamed answers --
    def opening(self) -> dict[str, Any]:
        """The first delta."""
        if self.choice.mode == "named":
            self.streamed_calls = 1
            return {"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": self.named_id, "type": "function",
                 "function": {"name": self.choice.name, "arguments": ""}}]}
        return {"role": "assistant", "content": ""}

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The deltas a piece of generated text gives (none while it is held back)."""
        mode = self.choice.mode
        if mode == "none":
            return [{"content": delta}]
        if mode == "named":
            return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}]
        if mode == "required":  # each call's id and name once the name is complete, then its arguments
            assert self.required is not None
            out: list[dict[str, Any]] = []
            for index, name, args in self.required.feed(delta):
                if name is not None and name in self.names and index == self.streamed_calls:
                    call_id = self.named_id if index == 0 else new_call_id()
                    self.streamed_calls += 1
                    out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                                "function": {"name": name, "arguments": ""}}]})
                if args and index < self.streamed_calls:
                    out.append({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
            return out
        assert self.auto is not None
        return self._auto_deltas(self.auto.feed(delta))

    def _auto_deltas(self, events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        """Content as the whole answer's (`parse_tool_calls`: with calls, the text around them without its
        trailing whitespace): trailing whitespace is held until text follows it, or the answer ends without
        calls."""
        out: list[dict[str, Any]] = []
        for kind, value in events:
            if kind == "content":
                text = self.held_space + value
                body = text.rstrip()
                self.held_space = text[len(body):]
                if body:
                    out.append({"content": body})
            elif self.parallel or self.streamed_calls == 0:
                out.append({"tool_calls": [call_delta(self.streamed_calls, value)]})
                self.streamed_calls += 1
        return out

    def close(self, text: str, finish: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas once the whole text is known, and the finish_reason."""
        mode = self.choice.mode
        if mode == "required":
            assert self.required is not None
            if self.streamed_calls:  # the call went out as it was generated
                return [], self.finish_reason(finish, True)
            return ([{"content": text}] if text else []), finish  # cut before its name was complete
        if mode == "auto":
            assert self.auto is not None
            deltas = self._auto_deltas(self.auto.finish())
            if self.held_space and not self.auto.calls:  # an answer without calls: its text as it was said
                deltas.append({"content": self.held_space})
            self.held_space = ""
            return deltas, self.finish_reason(finish, self.streamed_calls > 0)
        return [], self.finish_reason(finish, mode == "named")
