"""The chat API's legacy function calling, as OpenAI still takes it: `functions`, `function_call`, assistant
messages carrying `function_call` and `role: "function"` messages.

On the way in they become tools (`openai_tools`): `functions` -> `tools`, `function_call` ("none", "auto",
{"name": N}) -> `tool_choice` (the default with functions: "auto"), and earlier turns -> assistant
`tool_calls` and `tool` messages. On the way out an answer's first tool call is shaped back as
`message.function_call = {"name", "arguments"}` (streamed: `delta.function_call`, the name first, then the
arguments in pieces) with `finish_reason: "function_call"`; legacy answers hold one call.
"""

from __future__ import annotations

from typing import Any

from parrot.frontend.openai_tools import ToolError, parse_tool_choice, parse_tools


def tools_of(functions: list[Any] | None, function_call: Any, tools: list[Any] | None,
             tool_choice: Any) -> tuple[list[Any] | None, Any]:
    """(tools, tool_choice) for a request: its own, or those its `functions` / `function_call` stand for.
    Raises ToolError naming the legacy field at fault."""
    if functions is None and function_call is None:
        return tools, tool_choice
    if tools is not None or tool_choice is not None:
        raise ToolError("functions / function_call cannot be combined with tools / tool_choice",
                        "functions" if functions is not None else "function_call")
    if functions is None:
        raise ToolError("function_call needs functions", "function_call")
    if not isinstance(functions, list) or not functions:
        raise ToolError("functions must be a non-empty list of {name, description, parameters}", "functions")
    as_tools = [{"type": "function", "function": f} for f in functions]
    try:
        parsed = parse_tools(as_tools)
    except ToolError as exc:
        raise ToolError(str(exc).replace("tools[", "functions[").replace("two tools", "two functions")
                        .replace(".function.", "."),
                        exc.param.replace("tools.", "functions.").replace(".function.", ".")) from None
    if function_call is None or function_call in ("none", "auto"):
        choice: Any = function_call or "auto"
    elif isinstance(function_call, dict) and isinstance(function_call.get("name"), str) and set(function_call) == {
            "name"}:
        choice = {"type": "function", "function": {"name": function_call["name"]}}
    else:
        raise ToolError("function_call must be 'none', 'auto' or {\"name\": ...}", "function_call")
    try:
        parse_tool_choice(choice, parsed)
    except ToolError as exc:
        raise ToolError(str(exc).replace("tool_choice", "function_call").replace("among the tools",
                                                                                 "among the functions"),
                        "function_call") from None
    return as_tools, choice


def messages_of(messages: list[Any]) -> list[Any]:
    """The messages with legacy turns as tool turns: an assistant `function_call` becomes a one-call
    `tool_calls`, a `function` message the `tool` message answering the call before it."""
    out: list[Any] = []
    last_id: str | None = None
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("role") == "assistant" and m.get("function_call") is not None:
            fc = m["function_call"]
            if not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
                raise ToolError(f"messages[{i}].function_call must be {{\"name\", \"arguments\"}}",
                                f"messages.{i}.function_call")
            last_id = f"call_function_{i}"
            m = {k: v for k, v in m.items() if k != "function_call"}
            m["tool_calls"] = [{"id": last_id, "type": "function",
                                "function": {"name": fc["name"], "arguments": fc.get("arguments") or "{}"}}]
        elif m.get("role") == "function":
            if last_id is None:
                raise ToolError(f"messages[{i}] (role function) answers no function_call before it",
                                f"messages.{i}.role")
            m = {"role": "tool", "tool_call_id": last_id, "content": m.get("content")}
        out.append(m)
    return out


def message(msg: dict[str, Any], finish: str) -> tuple[dict[str, Any], str]:
    """A whole answer's message and finish_reason in the legacy shape."""
    msg = dict(msg)
    calls = msg.pop("tool_calls", None)
    if calls:
        msg["function_call"] = dict(calls[0]["function"])
    return msg, finish_reason(finish)


def delta(d: dict[str, Any]) -> dict[str, Any] | None:
    """A streamed delta in the legacy shape (None: nothing of it is shown: a second call)."""
    calls = d.get("tool_calls")
    if calls is None:
        return d
    first = [c for c in calls if c.get("index", 0) == 0]
    rest = {k: v for k, v in d.items() if k != "tool_calls"}
    if not first:
        return rest or None
    fn = first[0].get("function", {})
    return {**rest, "function_call": {k: v for k, v in fn.items() if k in ("name", "arguments")}}


def finish_reason(finish: str | None) -> str | None:
    return "function_call" if finish == "tool_calls" else finish
