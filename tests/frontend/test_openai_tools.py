"""Tool definitions, tool_choice, the constrained call schemas and the parsing / streaming of tool calls."""

from __future__ import annotations

import json

import pytest

from parrot.frontend.openai_tools import (
    SEPARATOR,
    AutoToolStream,
    ToolAnswer,
    ToolChoice,
    ToolError,
    constraint_schema,
    default_tool_prompt,
    forced_prefix,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    template_supports_tools,
    tool_constraint,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_parse_tools_and_choice() -> None:
    tools = parse_tools([WEATHER, TIME])
    assert [t.function.name for t in tools] == ["get_weather", "get_time"]
    assert tools[1].parameters() == {"type": "object", "properties": {}}
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    assert named == ToolChoice("named", "get_time")


@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "code_interpreter"}], "tools.0"),
    ([{"type": "retrieval", "function": {"name": "x"}}], "tools.0.type"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools.0.function.parameters"),
    ([TIME, TIME], "tools.1.function.name"),
    ([{"type": "function", "function": "get_time"}], "tools.0"),
])
def test_malformed_tools(tools, param) -> None:  # noqa: ANN001
    with pytest.raises(ToolError) as info:
        parse_tools(tools)
    assert info.value.param == param and str(info.value)


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function", "function": {"name": "nope"}},
                                    {"type": "function"}, 3])
def test_bad_tool_choice(choice) -> None:  # noqa: ANN001
    with pytest.raises(ToolError) as info:
        parse_tool_choice(choice, parse_tools([WEATHER]))
    assert info.value.param == "tool_choice"
    with pytest.raises(ToolError, match="needs tools"):
        parse_tool_choice("required", [])


def test_required_takes_one_or_more_calls_where_calls_may_be_parallel() -> None:
    """"required" with parallel calls: a grammar of one or more call objects in their blocks (llguidance takes
    it); without: the one call object's schema."""
    import llguidance

    tools = parse_tools([WEATHER, TIME])
    field, grammar = tool_constraint(ToolChoice("required"), tools, parallel=True)
    assert field == "grammar" and "%json" in grammar and not llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_lark(grammar))
    assert tool_constraint(ToolChoice("required"), tools, parallel=False) == (
        "json_schema", constraint_schema(ToolChoice("required"), tools))
    named = ToolChoice("named", "get_time")
    assert tool_constraint(named, tools, parallel=True) == ("json_schema", constraint_schema(named, tools))
    assert tool_constraint(ToolChoice("auto"), tools, parallel=True) is None


def test_constraint_schemas_and_prefixes() -> None:
    tools = parse_tools([WEATHER, TIME])
    named = ToolChoice("named", "get_weather")
    # no keys the schema does not list (additionalProperties false unless it says otherwise)
    assert constraint_schema(named, tools) == {**WEATHER["function"]["parameters"], "additionalProperties": False}
    assert forced_prefix(named) == '<tool_call>\n{"name": "get_weather", "arguments": '
    required = constraint_schema(ToolChoice("required"), tools)
    assert [s["properties"]["name"] for s in required["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert constraint_schema(ToolChoice("auto"), tools) is None and forced_prefix(ToolChoice("auto")) == ""
    assert constraint_schema(ToolChoice("required"), tools[:1])["properties"]["arguments"] == \
        constraint_schema(named, tools)


def test_default_prompt_and_template_detection() -> None:
    prompt = default_tool_prompt(parse_tools([WEATHER]))
    assert "<tools>" in prompt and '"get_weather"' in prompt and "<tool_call>" in prompt
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools(None)


def test_parse_tool_calls() -> None:
    names = {"get_weather", "get_time"}
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    content, calls = parse_tool_calls(text, names)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    # an unknown tool, broken JSON: content; an unterminated last block that parses: a call
    assert parse_tool_calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', names)[1] == []
    assert parse_tool_calls("<tool_call>{oops</tool_call>", names) == ("<tool_call>{oops</tool_call>", [])
    assert len(parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}', names)[1]) == 1
    # a whole answer that is one call object (Llama 3 style, "parameters")
    content, calls = parse_tool_calls(' {"name": "get_time", "parameters": {}}', names)
    assert content is None and calls[0].name == "get_time"
    assert parse_tool_calls("Just prose.", names) == ("Just prose.", [])


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}, {"name": "get_time", "arguments": {}}]',
    '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]\n```',
    '```\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]',  # unclosed fence
])
def test_other_tool_call_formats(text: str) -> None:
    """Mistral, Llama 3.1, a JSON list, a fence: the same calls, whole and streamed a few characters at a time."""
    names = {"get_weather", "get_time"}
    content, calls = parse_tool_calls(text, names)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    stream = AutoToolStream(names)
    events = [e for i in range(0, len(text), 3) for e in stream.feed(text[i:i + 3])] + stream.finish()
    assert [(k, v.name) for k, v in events] == [("call", "get_weather"), ("call", "get_time")]


@pytest.mark.parametrize("text", ['[1] A footnote.', '{"name": "rm", "arguments": {}}', '[TOOL_CALLS] oops',
                                  '<|python_tag|>{"name": "get_time"}; not json', '```json\n{"a": 1}\n```'])
def test_answers_that_only_look_like_calls_stay_content(text: str) -> None:
    names = {"get_time"}
    assert parse_tool_calls(text, names) == (text, [])
    stream = AutoToolStream(names)
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert events == [("content", text)]  # held to the end, then sent as it was


@pytest.mark.parametrize(("text", "held"), [("```python\nprint(1)\n```", "```p"), ("```\nls -l\n```", "```\nl"),
                                            ("`x` is a name", "`x"), ("  ``` js", "  ``` j")])
def test_fences_of_other_code_stream_at_once(text: str, held: str) -> None:
    """Only a fence that may hold JSON (``` or ```json before { or [) can be a call: other code streams as soon
    as its fence says so."""
    stream = AutoToolStream({"get_time"})
    events = [stream.feed(text[:i + 1][-1:]) for i in range(len(text))]
    first = next(i for i, e in enumerate(events) if e)
    assert text[:first + 1] == held and events[first] == [("content", held)]
    assert "".join(v for e in events for _, v in e) + "".join(v for _, v in stream.finish()) == text


def test_plain_text_streams_at_once() -> None:
    stream = AutoToolStream({"get_time"})
    assert stream.feed("  ") == [] and stream.feed("Hel") == [("content", "  Hel")] and stream.feed("lo") == [
        ("content", "lo")]


def test_auto_stream_holds_tool_calls_back() -> None:
    stream = AutoToolStream({"get_time"})
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> Done <tool'
    events = []
    for ch in text:  # one character at a time: tags split anywhere
        events += stream.feed(ch)
    events += stream.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "call"]
    assert content == "Sure.  Done <tool" and [c.name for c in calls] == ["get_time"]


def test_tool_answer_messages_and_deltas() -> None:
    tools = parse_tools([WEATHER, TIME])
    named = ToolAnswer(ToolChoice("named", "get_weather"), tools)
    msg, finish = named.message('{"city": "Paris"}', "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    opening = named.opening()
    assert opening["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert named.feed('{"ci') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    assert named.close('{"city": "Paris"}', "length") == ([], "length")

    required = ToolAnswer(ToolChoice("required"), tools)
    text = '{"name": "get_weather", "arguments": {"city": "Pa\\"r}is", "n": [1, {"a": 2}]} }'
    msg, finish = required.message(text, "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Pa\\"r}is", "n": [1, {"a": 2}]}'}
    streamed = ToolAnswer(ToolChoice("required"), tools)
    deltas = [d for ch in text for d in streamed.feed(ch)]  # a character at a time
    first, rest = deltas[0]["tool_calls"][0], deltas[1:]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"].startswith("call_")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in rest) == \
        msg["tool_calls"][0]["function"]["arguments"]
    assert streamed.close(text, "stop") == ([], "tool_calls")
    cut = ToolAnswer(ToolChoice("required"), tools)  # max_tokens inside the arguments: the partial call
    msg, finish = cut.message('{"name": "get_time", "arguments": {"x', "length")
    assert finish == "length" and msg["tool_calls"][0]["function"]["arguments"] == '{"x'
    assert ToolAnswer(ToolChoice("required"), tools).message('{"na', "length") == (
        {"role": "assistant", "content": '{"na'}, "length")

    # parallel calls of "required": blocks apart by SEPARATOR, whole and streamed a character at a time
    two = '{"name": "get_time", "arguments": {}}' + SEPARATOR + '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for text, finish in ((two + "\n</tool_call>", "stop"), (two, "stop"), (two[:-4], "length")):
        msg, said = ToolAnswer(ToolChoice("required"), tools).message(text, finish)
        assert said == ("tool_calls" if finish == "stop" else "length") and msg["content"] is None
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
        oslo = '{"city": "Oslo"}' if finish == "stop" else '{"city": "Osl'
        assert calls == [("get_time", "{}"), ("get_weather", oslo)]
        assert len({c["id"] for c in msg["tool_calls"]}) == 2
        streamed = ToolAnswer(ToolChoice("required"), tools)
        deltas = [tc for ch in text for d in streamed.feed(ch) for tc in d["tool_calls"]]
        heads = [d for d in deltas if "id" in d]
        assert [(d["index"], d["function"]["name"]) for d in heads] == [(0, "get_time"), (1, "get_weather")]
        assert [("".join(d["function"]["arguments"] for d in deltas if d["index"] == i)) for i in (0, 1)] == [
            a for _, a in calls]
        assert streamed.close(text, finish) == ([], said)

    auto = ToolAnswer(ToolChoice("auto"), tools, parallel=False)
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    msg, finish = auto.message(text, "stop")
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1  # parallel_tool_calls=false: the first
    none = ToolAnswer(ToolChoice("none"), tools)
    assert none.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")


@pytest.mark.parametrize("text", [
    'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_time", '
    '"arguments": {}}</tool_call>\n',
    '  A <tool_call>{"name": "get_time", "arguments": {}}</tool_call> B  \n',
    "Hello there,\n\n",
    "  \n",
    'Not a call <tool_call>{"name": "nope"}</tool_call>  ',
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_auto_answers_streamed_equal_whole_ones(text: str, step: int) -> None:
    tools = parse_tools([WEATHER, TIME])
    msg, finish = ToolAnswer(ToolChoice("auto"), tools).message(text, "stop")
    streamed = ToolAnswer(ToolChoice("auto"), tools)
    deltas = [d for i in range(0, len(text), step) for d in streamed.feed(text[i:i + step])]
    last, reason = streamed.close(text, "stop")
    deltas += last
    content = "".join(d["content"] for d in deltas if "content" in d)
    assert (content or None) == msg["content"] and reason == finish
    assert len([d for d in deltas if "tool_calls" in d]) == len(msg.get("tool_calls", []))
