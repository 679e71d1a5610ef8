"""Chat messages of the OpenAI API -> the prompt text, through the model's chat template.

Messages are checked (roles system / developer / user / assistant / tool, text content only) and turned
into the dicts a chat template takes. Tools (see `openai_tools`) are rendered by the template itself when
it renders `tools`; otherwise the default tool prompt joins the system message, assistant tool calls
become `<tool_call>` text and tool results user turns holding `<tool_response>` blocks.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from pydantic import BaseModel, ConfigDict

from parrot.errors import InvalidRequestError, ParrotError
from parrot.frontend.openai_tools import (
    ToolChoice,
    ToolDef,
    ToolError,
    call_text,
    default_tool_prompt,
    template_supports_tools,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part (OpenAI's history): read as its text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # ignored
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


def _text(m: ChatMessage, i: int) -> str | None:
    if m.content is None:
        return None
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        text = part.refusal if part.type == "refusal" and m.role == "assistant" else part.text
        if part.type not in ("text", "refusal") or (part.type == "refusal" and m.role != "assistant"):
            raise ToolError(f"messages[{i}].content: a content part of type {part.type!r} is not supported by "
                            "this server (text only)", f"messages.{i}.content")
        if text is None:
            raise ToolError(f"messages[{i}].content[{j}]: a {part.type!r} part needs its {part.type!r} field",
                            f"messages.{i}.content.{j}.{part.type}")
        texts.append(text)
    return "".join(texts)


def _calls(m: ChatMessage, i: int) -> list[tuple[str, str, str]]:
    """An assistant message's tool calls: (id, name, arguments JSON text)."""
    out = []
    for j, c in enumerate(m.tool_calls or []):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                            "{\"name\", \"arguments\"}}", f"messages.{i}.tool_calls.{j}")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append((str(c.get("id") or f"call_{j}"), fn["name"], args))
    return out


def _args_value(args: str) -> Any:
    try:
        return json.loads(args)
    except ValueError:
        return args


def template_messages(messages: list[ChatMessage], tools: list[ToolDef], choice: ToolChoice,
                      native: bool) -> list[dict[str, Any]]:
    """The messages as a chat template takes them. `native`: the template renders tools and tool
    messages itself; otherwise they become text (and the default tool prompt a system message)."""
    out: list[dict[str, Any]] = []
    called: dict[str, str] = {}  # the tool calls of the assistant messages so far: id -> name
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ToolError(f"messages[{i}].role {m.role!r} is not supported ({', '.join(ROLES)})",
                            f"messages.{i}.role")
        role = "system" if m.role == "developer" else m.role
        text = _text(m, i)
        if m.tool_calls and role != "assistant":
            raise ToolError(f"messages[{i}]: only assistant messages have tool_calls", f"messages.{i}.tool_calls")
        calls = _calls(m, i) if m.tool_calls else []
        called.update((cid, n) for cid, n, _ in calls)
        if text is None and not calls and role != "assistant":
            raise ToolError(f"messages[{i}].content is required", f"messages.{i}.content")
        if role == "tool":
            if not m.tool_call_id:
                raise ToolError(f"messages[{i}] (role tool) needs tool_call_id", f"messages.{i}.tool_call_id")
            if m.tool_call_id not in called:  # as OpenAI: a tool message answers an earlier call
                raise ToolError(f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call of an earlier "
                                "assistant message", f"messages.{i}.tool_call_id")
            if native:
                name = called[m.tool_call_id]
                out.append({"role": "tool", "content": text or "", "tool_call_id": m.tool_call_id,
                            **({"name": name} if name else {})})
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{text or ''}\n</tool_response>"})
            continue
        if calls:
            if native:
                out.append({"role": "assistant", "content": text or "", "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": n, "arguments": _args_value(a)}}
                    for cid, n, a in calls]})
            else:
                said = [text] if text else []
                out.append({"role": "assistant", "content": "\n".join(said + [call_text(n, a) for _, n, a in calls])})
            continue
        out.append({"role": role, "content": text or ""})
    if tools and choice.mode != "none" and not native:
        prompt = default_tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise InvalidRequestError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)  # as HF
    return env.from_string(template)


def load_chat_template(given: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: a file's path, or the template itself (text
    with Jinja syntax in it). Raises ParrotError for a missing file or a template that does not compile."""
    path = Path(given).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ParrotError(f"cannot read the chat template {given!r}: {exc}") from None
    elif any(mark in given for mark in ("{{", "{%")):
        text = given
    else:
        raise ParrotError(f"chat template {given!r}: no such file, nor a template (no '{{{{' or '{{%' in it)")
    try:
        _compiled(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ParrotError(f"the chat template does not compile: {exc.message} (line {exc.lineno})") from None
    return text


# the variables a chat template is given by the server itself: not a request's `chat_template_kwargs`
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception"})


def renderer(tok: Any, tools: list[ToolDef], choice: ToolChoice, kwargs: dict[str, Any] | None = None) -> tuple[
        Callable[[list[dict[str, Any]], bool], str], bool]:
    """(render(messages, add_generation_prompt), native): the model's chat template, given the tools when
    it renders them (native) and tool_choice is not "none", and `kwargs` as more of its variables (vLLM's
    `chat_template_kwargs`, e.g. `enable_thinking`; none of `TEMPLATE_VARIABLES`)."""
    kwargs = kwargs or {}
    native = template_supports_tools(tok.chat_template)
    if not native:
        return (lambda msgs, gen: tok.apply_chat_template(msgs, add_generation_prompt=gen, **kwargs)), False
    template = _compiled(tok.chat_template)
    vocab = tok.backend
    bos = vocab.id_to_token(tok.bos_token_id) if tok.bos_token_id is not None else ""
    eos = vocab.id_to_token(tok.eos_token_id) if tok.eos_token_id is not None else ""
    specs = [t.spec() for t in tools] if tools and choice.mode != "none" else None

    def render(msgs: list[dict[str, Any]], gen: bool) -> str:
        return template.render(**kwargs, messages=msgs, tools=specs, add_generation_prompt=gen, bos_token=bos,
                               eos_token=eos)

    return render, True
