"""The legacy functions / function_call fields as tools, and answers shaped back as function_call."""

from __future__ import annotations

import pytest

from parrot.frontend import openai_functions as legacy
from parrot.frontend.openai_tools import ToolAnswer, ToolError, parse_tool_choice, parse_tools

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time"}


def test_functions_become_tools() -> None:
    assert legacy.tools_of(None, None, [{"x": 1}], "auto") == ([{"x": 1}], "auto")  # not legacy: as they are
    tools, choice = legacy.tools_of([WEATHER, TIME], None, None, None)
    assert tools == [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
    assert choice == "auto"
    assert legacy.tools_of([WEATHER], "none", None, None)[1] == "none"
    assert legacy.tools_of([WEATHER], {"name": "get_weather"}, None, None)[1] == {
        "type": "function", "function": {"name": "get_weather"}}
    parse_tool_choice(legacy.tools_of([WEATHER], {"name": "get_weather"}, None, None)[1], parse_tools(tools))


@pytest.mark.parametrize(("args", "param"), [
    (([WEATHER], None, [WEATHER], None), "functions"),
    ((None, "auto", None, None), "function_call"),
    (([], None, None, None), "functions"),
    (([WEATHER], {"name": "nope"}, None, None), "function_call"),
    (([WEATHER], "required", None, None), "function_call"),
    (([WEATHER], {"name": "get_weather", "x": 1}, None, None), "function_call"),
    (([{"name": "has space"}], None, None, None), "functions.0.name"),
    (([WEATHER, WEATHER], None, None, None), "functions.1.name"),
])
def test_bad_functions_name_the_legacy_field(args: tuple, param: str) -> None:
    with pytest.raises(ToolError) as info:
        legacy.tools_of(*args)
    assert info.value.param == param
    if param.startswith("functions."):
        assert "functions" in str(info.value) and "tools" not in str(info.value)


def test_function_turns_become_tool_turns() -> None:
    msgs = [{"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "function_call": {"name": "get_time", "arguments": "{}"}},
            {"role": "function", "name": "get_time", "content": "12:00"}]
    out = legacy.messages_of(msgs)
    call_id = out[1]["tool_calls"][0]["id"]
    assert out[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    assert out[2] == {"role": "tool", "tool_call_id": call_id, "content": "12:00"}
    with pytest.raises(ToolError) as info:
        legacy.messages_of([msgs[0], msgs[2]])
    assert info.value.param == "messages.1.role"


def test_answers_in_the_legacy_shape() -> None:
    tools = parse_tools([{"type": "function", "function": WEATHER}])
    answer = ToolAnswer(parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools), tools)
    msg, finish = legacy.message(*answer.message('{"city": "Oslo"}', "stop"))
    assert msg == {"role": "assistant", "content": None,
                   "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert finish == "function_call"
    assert legacy.delta(answer.opening()) == {"role": "assistant", "content": None,
                                              "function_call": {"name": "get_weather", "arguments": ""}}
    assert legacy.delta(answer.feed('{"ci')[0]) == {"function_call": {"arguments": '{"ci'}}
    assert legacy.delta({"tool_calls": [{"index": 1, "function": {"arguments": "x"}}]}) is None  # a second call
    assert legacy.delta({"content": "hi"}) == {"content": "hi"}
    assert legacy.finish_reason("tool_calls") == "function_call" and legacy.finish_reason("length") == "length"
    assert legacy.message({"role": "assistant", "content": "hi"}, "stop") == (
        {"role": "assistant", "content": "hi"}, "stop")
