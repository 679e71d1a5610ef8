"""Chat messages (tool calls and results included) through a chat template, with and without tool support."""

from __future__ import annotations

import pytest

from parrot.errors import ParrotError
from parrot.frontend.chat_prompt import ChatMessage, load_chat_template, renderer, template_messages
from parrot.frontend.openai_tools import ToolChoice, ToolError, parse_tools
from tests.conftest import tiny_tokenizer

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])
HISTORY = [
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]
# a Hermes-style template that renders tools and tool messages itself
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _messages(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_without_template_support_tools_become_text() -> None:
    tok = tiny_tokenizer()
    render, native = renderer(tok, TOOLS, ToolChoice("auto"))
    assert not native
    msgs = template_messages(_messages(HISTORY), TOOLS, ToolChoice("auto"), native)
    assert msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]  # the default tool prompt
    assert msgs[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                                       "</tool_call>"}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    prompt = render(msgs, True)
    assert prompt.endswith("<|im_start|>assistant\n") and "<tool_response>" in prompt
    # tool_choice none: no tool prompt; an existing system message gets the tool prompt appended
    assert template_messages(_messages(HISTORY), TOOLS, ToolChoice("none"), False)[0]["role"] == "user"
    with_system = template_messages(_messages([{"role": "developer", "content": "Be brief."}, *HISTORY]), TOOLS,
                                    ToolChoice("required"), False)
    assert with_system[0]["role"] == "system" and with_system[0]["content"].startswith("Be brief.\n\n# Tools")


def test_template_with_tool_support_renders_them() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    render, native = renderer(tok, TOOLS, ToolChoice("auto"))
    assert native
    msgs = template_messages(_messages(HISTORY), TOOLS, ToolChoice("auto"), native)
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {}}
    assert msgs[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1", "name": "get_time"}
    prompt = render(msgs, True)
    assert prompt.startswith("<|im_start|>system\nTOOLS:get_time;") and "CALL get_time {}" in prompt
    render_none, _ = renderer(tok, TOOLS, ToolChoice("none"))
    assert "TOOLS:" not in render_none(msgs, True)


@pytest.mark.parametrize(("raw", "param"), [
    ([{"role": "robot", "content": "x"}], "messages.0.role"),
    ([{"role": "tool", "content": "x"}], "messages.0.tool_call_id"),
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages.0.content"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}], "messages.0.tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": "f"}]}], "messages.0.tool_calls.0"),
])
def test_bad_messages(raw, param) -> None:  # noqa: ANN001
    with pytest.raises(ToolError) as info:
        template_messages(_messages(raw), [], ToolChoice("none"), False)
    assert info.value.param == param


def test_a_chat_template_given_as_a_file_or_as_text(tmp_path) -> None:  # noqa: ANN001
    """vLLM's --chat-template: a file's path or the template itself; a missing file or a template that does not
    compile is a clear error before anything loads; the tokenizer then renders chats with it."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template, encoding="utf-8")
    assert load_chat_template(str(path)) == load_chat_template(template) == template
    with pytest.raises(ParrotError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ParrotError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
    tok = tiny_tokenizer()
    own = tok.chat_template
    mine = tok.with_chat_template(template)
    assert mine.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    assert tok.chat_template == own and mine.backend is tok.backend  # the original is unchanged
