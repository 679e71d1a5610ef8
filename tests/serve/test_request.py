"""Template parsing and request validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parrot.errors import InvalidRequestError
from parrot.serve.request import (
    Parameter,
    PlaceholderChunk,
    TextChunk,
    parse_request,
    parse_template,
    render_chunks,
    split_completion_chains,
)


def inp(name: str, value: str | None = "v", var_id: str | None = None) -> Parameter:
    return Parameter(name, is_output=False, var_id=var_id, value=value)


def out(name: str, var_id: str | None = None, **kw) -> Parameter:
    return Parameter(name, is_output=True, var_id=var_id, **kw)


def test_parse_template_chunks():
    assert parse_template("Hi {{name}}, say {{ out }}.") == [
        TextChunk("Hi "), PlaceholderChunk("name"), TextChunk(", say "), PlaceholderChunk("out"), TextChunk(".")]
    assert parse_template("{{a}}{{b}}") == [PlaceholderChunk("a"), PlaceholderChunk("b")]
    assert parse_template("plain {json: 1} text") == [TextChunk("plain {json: 1} text")]
    assert parse_template("{{  _x9 }}") == [PlaceholderChunk("_x9")]


@pytest.mark.parametrize("template, words", [
    ("", "empty"),
    ("a {{x", "never closed"),
    ("a x}} b", "without a matching"),
    ("{{", "never closed"),
    ("}}", "without a matching"),
    ("{{a}} }}", "without a matching"),
    ("{{a {{b}}", "not closed before"),
    ("{{9a}}", "invalid placeholder name"),
    ("{{a-b}}", "invalid placeholder name"),
    ("{{}}", "invalid placeholder name"),
    ("{{ a b }}", "invalid placeholder name"),
    ("{{{a}}}", "invalid placeholder name"),
])
def test_parse_template_errors(template, words):
    with pytest.raises(InvalidRequestError, match=words):
        parse_template(template)


def test_parse_template_rejects_non_string():
    with pytest.raises(InvalidRequestError, match="must be a string"):
        parse_template(None)  # type: ignore[arg-type]


names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
texts = st.text(min_size=1, max_size=20).filter(lambda t: "{" not in t and "}" not in t)


@st.composite
def chunk_lists(draw):
    chunks, last_text = [], False
    for is_text in draw(st.lists(st.booleans(), min_size=1, max_size=12)):
        if is_text and not last_text:
            chunks.append(TextChunk(draw(texts)))
        elif not is_text:
            chunks.append(PlaceholderChunk(draw(names)))
        last_text = is_text
    return chunks


@given(chunk_lists())
def test_round_trip(chunks):
    template = render_chunks(chunks)
    assert parse_template(template) == chunks
    assert render_chunks(parse_template(template)) == template


@given(chunk_lists(), st.data())
def test_inner_spaces_are_ignored(chunks, data):
    spaced = "".join(c.text if isinstance(c, TextChunk) else
                     "{{" + " " * data.draw(st.integers(0, 2)) + c.name + " " * data.draw(st.integers(0, 2)) + "}}"
                     for c in chunks)
    assert parse_template(spaced) == chunks


@given(st.text(alphabet="ab{} ", max_size=30))
def test_parse_never_crashes(template):
    try:
        chunks = parse_template(template)
    except InvalidRequestError:
        return
    assert render_chunks(chunks).replace(" ", "") == template.replace(" ", "")


def test_parse_request_ok():
    req = parse_request("System. Q: {{q}} A: {{a}} Again {{q}} B: {{b}} end",
                        [inp("q", "why?"), out("a", sampling_config={"max_tokens": 8}), out("b", var_id="v1")])
    assert [p.name for p in req.inputs] == ["q"]
    assert [p.name for p in req.outputs] == ["a", "b"]
    assert req.is_output(PlaceholderChunk("a")) and not req.is_output(PlaceholderChunk("q"))
    assert req.param_of(PlaceholderChunk("b")).var_id == "v1"
    chains = req.completion_chains()
    assert chains == [
        [TextChunk("System. Q: "), PlaceholderChunk("q"), TextChunk(" A: "), PlaceholderChunk("a")],
        [TextChunk(" Again "), PlaceholderChunk("q"), TextChunk(" B: "), PlaceholderChunk("b")],
    ]  # the trailing " end" generates nothing and is dropped


def test_input_then_output_adjacent_is_fine():
    req = parse_request("x {{a}}{{b}}", [inp("a"), out("b")])
    assert split_completion_chains(req.chunks, req.params) == [[TextChunk("x "), PlaceholderChunk("a"),
                                                                 PlaceholderChunk("b")]]


def test_input_first_is_fine_and_no_outputs_means_no_chains():
    req = parse_request("{{a}} tail", [inp("a", var_id="v", value=None)])
    assert req.completion_chains() == []


@pytest.mark.parametrize("template, params, words", [
    ("{{x}}", [inp("x"), inp("x")], "duplicate parameter 'x'"),
    ("a {{x}} {{y}}", [inp("x")], r"placeholder \{\{y\}\} has no parameter"),
    ("a {{x}}", [inp("x"), out("y")], "parameter 'y' is not used"),
    ("a {{x}} b {{x}}", [out("x")], r"output placeholder \{\{x\}\} is used 2 times"),
    ("a {{x}}", [inp("x", value=None)], "needs a var_id or a value"),
    ("a {{x}}", [inp("x", value="v", var_id="id")], "both a var_id and a value"),
    ("a {{x}}", [Parameter("x", True, value="v")], "must not have a value"),
    ("a {{x}}", [Parameter("x", False, value="v", sampling_config={})], "only outputs generate"),
    ("a {{x}}", [inp("x", value=3)], "must be a string"),  # type: ignore[arg-type]
    ("a {{x}}", [Parameter("x", True, sampling_config=[1])], "must be an object"),  # type: ignore[arg-type]
    ("a {{x}}{{y}}", [out("x"), out("y")], "adjacent"),
    ("{{x}} then", [out("x")], "nothing to condition on"),
    ("a {{x}} b {{y}}", [out("x", "v"), out("y", "v")], "bound to 2 output parameters"),
    ("", [], "empty"),
    ("a {{x", [inp("x")], "never closed"),
])
def test_parse_request_errors(template, params, words):
    with pytest.raises(InvalidRequestError, match=words):
        parse_request(template, params)


@given(chunk_lists(), st.data())
def test_chains_cover_the_prefix(chunks, data):
    """Every chain ends with its only output; chains concatenated are the chunks up to the last output."""
    names_ = {c.name for c in chunks if isinstance(c, PlaceholderChunk)}
    params = {n: Parameter(n, data.draw(st.booleans()), value=None, var_id="v") for n in names_}
    chains = split_completion_chains(chunks, params)
    flat = [c for chain in chains for c in chain]
    assert flat == chunks[:len(flat)]
    assert all(isinstance(c, TextChunk) or not params[c.name].is_output for c in chunks[len(flat):])
    for chain in chains:
        outs = [c for c in chain if isinstance(c, PlaceholderChunk) and params[c.name].is_output]
        assert outs == [chain[-1]]
