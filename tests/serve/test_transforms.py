"""Native functions: every transform, every validation error, runtime errors, and a property test that no
input string makes a transform raise anything but TransformError."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parrot.errors import InvalidRequestError, ParrotError
from parrot.serve.transforms import (
    MAX_PATTERN_CHARS,
    TRANSFORMS,
    TransformCall,
    TransformContext,
    TransformError,
    describe_transforms,
    run_transform,
    validate_call,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "native-functions.md"


class WordTokenizer:
    """A word-level stand-in for a model tokenizer: each token is a word with its leading whitespace."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def tokenize(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids)) for w in re.findall(r"\s*\S+|\s+", text)]

    def detokenize(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.ids.items()}
        return "".join(words[i] for i in ids)


def byte_ctx(**kw: Any) -> TransformContext:
    """Byte-level tokenizer: one token per UTF-8 byte, so multi-byte characters can be cut in two."""
    return TransformContext(
        tokenize=lambda text: list(text.encode("utf-8")),
        detokenize=lambda ids: bytes(ids).decode("utf-8", errors="replace"),
        **kw,
    )


def word_ctx() -> TransformContext:
    tok = WordTokenizer()
    return TransformContext(tokenize=tok.tokenize, detokenize=tok.detokenize)


def run(name: str, params: dict[str, Any], inputs: dict[str, str], outputs: list[str] | None = None,
        ctx: TransformContext | None = None) -> dict[str, str]:
    call = validate_call(name, params, list(inputs), outputs or ["output"])
    return run_transform(call, inputs, ctx or word_ctx())


def one(name: str, text: str, ctx: TransformContext | None = None, **params: Any) -> str:
    return run(name, params, {"text": text}, ctx=ctx)["output"]


def invalid(name: str, params: Any = None, inputs: Any = ("text",), outputs: Any = ("output",)) -> str:
    with pytest.raises(InvalidRequestError) as info:
        validate_call(name, params, list(inputs) if isinstance(inputs, tuple) else inputs,
                      list(outputs) if isinstance(outputs, tuple) else outputs)
    return str(info.value)


def failure(name: str, params: dict[str, Any], inputs: dict[str, str], outputs: list[str] | None = None,
            ctx: TransformContext | None = None) -> str:
    with pytest.raises(TransformError) as info:
        run(name, params, inputs, outputs, ctx)
    return str(info.value)


# ---- the registry ------------------------------------------------------------------------------------
def test_the_set_is_fixed() -> None:
    assert sorted(TRANSFORMS) == sorted([
        "strip", "lower", "upper", "replace", "regex_extract", "split", "join", "truncate_tokens",
        "truncate_chars", "json_field", "format", "concat",
    ])
    assert issubclass(TransformError, ParrotError)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_examples_run_as_documented(name: str) -> None:
    params, inputs, outputs = TRANSFORMS[name].example
    assert run(name, params, inputs, list(outputs)) == outputs


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_is_documented(name: str) -> None:
    doc = DOC.read_text()
    assert f"### `{name}`" in doc
    params, inputs, outputs = TRANSFORMS[name].example
    assert json.dumps(params) in doc, f"{name}: the doc's example params differ from the registry's"
    for field in TRANSFORMS[name].params.model_fields:
        assert f"`{field}`" in doc.split(f"### `{name}`")[1].split("### ")[0], f"{name}.{field} undocumented"


def test_describe() -> None:
    described = {d["name"]: d for d in describe_transforms()}
    assert set(described) == set(TRANSFORMS)
    assert described["replace"]["params"]["required"] == ["old", "new"]
    assert described["replace"]["params"]["additionalProperties"] is False
    json.dumps(described)


# ---- each transform ------------------------------------------------------------------------------------
def test_strip() -> None:
    assert one("strip", " \t hi there \n") == "hi there"
    assert one("strip", "xxhixx", chars="x") == "hi"
    assert one("strip", "  hi  ", side="left") == "hi  "
    assert one("strip", "  hi  ", side="right") == "  hi"
    assert one("strip", "") == ""


def test_lower_upper() -> None:
    assert one("lower", "HeLLo ÄÖ") == "hello äö"
    assert one("upper", "hello straße") == "HELLO STRASSE"


def test_replace() -> None:
    assert one("replace", "a-b-c", old="-", new="+") == "a+b+c"
    assert one("replace", "a-b-c", old="-", new="", count=1) == "ab-c"
    assert one("replace", "a-b-c", old="x", new="y") == "a-b-c"
    assert one("replace", "a-b-c", old="-", new="+", count=0) == "a-b-c"


def test_regex_extract() -> None:
    text = "Name: Ada, Age: 36"
    assert one("regex_extract", text, pattern=r"Age: \d+") == "Age: 36"
    assert one("regex_extract", text, pattern=r"Age: (\d+)", group=1) == "36"
    assert one("regex_extract", text, pattern=r"Name: (?P<name>\w+)", group="name") == "Ada"
    assert one("regex_extract", text, pattern=r"(?i)name: (\w+)", group=1) == "Ada"
    assert one("regex_extract", text, pattern=r"Zip: (\d+)", group=1, default="none") == "none"
    assert one("regex_extract", "ab", pattern=r"a|(z)", group=1, default="-") == "-"
    assert one("regex_extract", "", pattern=r"x*") == ""


def test_regex_extract_failures() -> None:
    msg = failure("regex_extract", {"pattern": r"Zip: (\d+)"}, {"text": "Name: Ada"})
    assert "does not match" in msg and "Zip" in msg and "Name: Ada" in msg
    msg = failure("regex_extract", {"pattern": r"a|(z)", "group": 1}, {"text": "a"})
    assert "group 1 did not take part" in msg
    long = "x" * 1000
    assert "1000 characters" in failure("regex_extract", {"pattern": "y"}, {"text": long})  # input preview is cut


def test_split_index() -> None:
    assert one("split", "a,b,c", sep=",", index=1) == "b"
    assert one("split", "a,b,c", sep=",", index=-1) == "c"
    assert one("split", "  a  b ", index=0) == "a"  # no sep: runs of whitespace
    assert one("split", "a,b,c", sep=",", index=1, maxsplit=1) == "b,c"
    assert one("split", "a,b", sep=",", index=5, default="") == ""
    msg = failure("split", {"sep": ",", "index": 5}, {"text": "a,b"})
    assert "piece 5 does not exist" in msg and "2 pieces" in msg


def test_split_maxsplit() -> None:
    assert run("split", {"sep": ": ", "maxsplit": 1}, {"text": "key: a: b"}, ["k", "v"]) == {"k": "key", "v": "a: b"}
    out = run("split", {"sep": "|", "maxsplit": 2}, {"text": "1|2|3|4"}, ["a", "b", "c"])
    assert out == {"a": "1", "b": "2", "c": "3|4"}
    out = run("split", {"sep": "|", "maxsplit": 2, "default": "?"}, {"text": "1"}, ["a", "b", "c"])
    assert out == {"a": "1", "b": "?", "c": "?"}
    msg = failure("split", {"sep": "|", "maxsplit": 2}, {"text": "1|2"}, ["a", "b", "c"])
    assert "2 pieces" in msg and "3 outputs" in msg


def test_join_and_concat_keep_the_given_order() -> None:
    inputs = {"z": "first", "a": "second", "m": "third"}
    assert run("join", {"sep": ", "}, inputs) == {"output": "first, second, third"}
    assert run("concat", {}, inputs) == {"output": "firstsecondthird"}
    reordered = {"a": "second", "z": "first", "m": "third"}  # values looked up by the call's order
    call = validate_call("concat", {}, ["z", "a", "m"], ["output"])
    assert run_transform(call, reordered, TransformContext()) == {"output": "firstsecondthird"}
    assert run("join", {"sep": "-"}, {"only": "x"}) == {"output": "x"}


def test_truncate_chars() -> None:
    assert one("truncate_chars", "abcdef", n=3) == "abc"
    assert one("truncate_chars", "abcdef", n=3, keep="end") == "def"
    assert one("truncate_chars", "abc", n=10) == "abc"
    assert one("truncate_chars", "abc", n=0) == ""
    assert one("truncate_chars", "abc", n=0, keep="end") == ""


def test_truncate_tokens() -> None:
    assert one("truncate_tokens", "one two three four", n=2) == "one two"
    assert one("truncate_tokens", "one two three four", n=2, keep="end") == " three four"
    assert one("truncate_tokens", "one two", n=5) == "one two"
    assert one("truncate_tokens", "one two", n=0) == ""


def test_truncate_tokens_never_splits_a_character() -> None:
    ctx = byte_ctx()
    assert one("truncate_tokens", "日本", ctx, n=4) == "日"  # 3 + 1 bytes: the broken byte is dropped
    assert one("truncate_tokens", "日本", ctx, n=4, keep="end") == "本"
    assert one("truncate_tokens", "a\ufffdb", ctx, n=4) == "a\ufffd"  # a real U+FFFD in the input stays
    assert one("truncate_tokens", "日", ctx, n=2) == ""


def test_truncate_tokens_failures() -> None:
    msg = failure("truncate_tokens", {"n": 1}, {"text": "a b"}, ctx=TransformContext())
    assert "no tokenizer" in msg

    def broken(text: str) -> list[int]:
        raise RuntimeError("boom")

    msg = failure("truncate_tokens", {"n": 1}, {"text": "a b"}, ctx=TransformContext(broken, lambda ids: ""))
    assert "tokenizer failed" in msg and "boom" in msg


def test_json_field() -> None:
    doc = json.dumps({"a": {"b": [{"c": "deep"}, {"c": 2}], "1": "key"}, "n": None, "t": "日本"})
    assert one("json_field", doc, path="a.b.0.c") == "deep"
    assert one("json_field", doc, path="a.b.1.c") == "2"  # non-strings come back as JSON
    assert one("json_field", doc, path="a.b.-1") == '{"c": 2}'
    assert one("json_field", doc, path="a.1") == "key"  # a digit segment is a key in an object
    assert one("json_field", doc, path="n") == "null"
    assert one("json_field", doc, path="t") == "日本"
    assert json.loads(one("json_field", doc)) == json.loads(doc)  # the empty path is the whole value
    assert one("json_field", doc, path="a.x", default="") == ""
    assert one("json_field", '"just a string"') == "just a string"


def test_json_field_failures() -> None:
    msg = failure("json_field", {"path": "a"}, {"text": "not json"})
    assert "not JSON" in msg and "not json" in msg
    msg = failure("json_field", {"path": "a.b.5.c"}, {"text": '{"a": {"b": [1]}}'})
    assert "missing at 'a.b.5'" in msg
    assert "missing" in failure("json_field", {"path": "a.0"}, {"text": '{"a": "str"}'})
    assert "missing" in failure("json_field", {"path": "0.x"}, {"text": "[1]"})
    deep = "[" * 100_000 + "]" * 100_000
    assert "not JSON" in failure("json_field", {"path": "0"}, {"text": deep})
    assert "not JSON" in failure("json_field", {"path": "a", "default": "d"}, {"text": "{"})  # default: path only


def test_format() -> None:
    out = run("format", {"template": "Q: {q}\nA: {a} ({q})"}, {"q": "why", "a": "because"})
    assert out == {"output": "Q: why\nA: because (why)"}
    assert run("format", {"template": "{{literal}} {x}"}, {"x": "{y}"}) == {"output": "{literal} {y}"}
    assert run("format", {"template": "no fields"}, {}) == {"output": "no fields"}


def test_output_limit() -> None:
    ctx = TransformContext(max_output_chars=10)
    assert "limit of 10" in failure("replace", {"old": "a", "new": "bbbb"}, {"text": "aaaa"}, ctx=ctx)
    assert run("replace", {"old": "a", "new": "bbbb", "count": 1}, {"text": "aaaa"}, ctx=ctx)  # 7 chars: fine
    assert "limit of 10" in failure("join", {"sep": "---"}, {"a": "xxxx", "b": "yyyy"}, ctx=ctx)
    assert "limit of 10" in failure("concat", {}, {"a": "xxxxxx", "b": "yyyyyy"}, ctx=ctx)
    assert "limit of 10" in failure("format", {"template": "{a}{a}{a}"}, {"a": "xxxx"}, ctx=ctx)
    msg = failure("upper", {}, {"text": "ß" * 6}, ctx=ctx)  # grows while changing case: caught at the end
    assert "'output' is 12 characters" in msg
    assert "limit" in failure("strip", {}, {"text": "x" * 11}, ctx=ctx)


def test_run_time_input_checks() -> None:
    call = validate_call("concat", {}, ["a", "b"], ["output"])
    with pytest.raises(TransformError, match=r"missing input values for \['b'\]"):
        run_transform(call, {"a": "x"}, TransformContext())
    with pytest.raises(TransformError, match="'b' is int, not a string"):
        run_transform(call, {"a": "x", "b": 3}, TransformContext())  # type: ignore[dict-item]


# ---- validation errors ---------------------------------------------------------------------------------
def test_unknown_transform_lists_the_known_ones() -> None:
    msg = invalid("eval", {})
    assert "unknown transform 'eval'" in msg
    assert all(name in msg for name in TRANSFORMS)


@pytest.mark.parametrize(("name", "params", "expected"), [
    ("lower", {"x": 1}, "x: Extra inputs are not permitted"),
    ("strip", {"chars": 3}, "chars: Input should be a valid string"),
    ("strip", {"side": "middle"}, "side: Input should be 'both', 'left' or 'right'"),
    ("replace", {"new": "x"}, "old: Field required"),
    ("replace", {"old": "", "new": "x"}, "old: String should have at least 1 character"),
    ("replace", {"old": "a", "new": "b", "count": -1}, "count: Input should be greater than or equal to 0"),
    ("replace", {"old": "a", "new": "b", "count": "2"}, "count"),  # strict: no string -> int coercion
    ("regex_extract", {}, "pattern: Field required"),
    ("regex_extract", {"pattern": "(a"}, "not a valid regular expression"),
    ("regex_extract", {"pattern": "x" * (MAX_PATTERN_CHARS + 1)}, f"at most {MAX_PATTERN_CHARS} characters"),
    ("regex_extract", {"pattern": "(a)", "group": 2}, "group 2 does not exist (the pattern has 1 groups)"),
    ("regex_extract", {"pattern": "(a)", "group": -1}, "group -1 does not exist"),
    ("regex_extract", {"pattern": "(?P<x>a)", "group": "y"}, "group 'y' does not exist (named groups: ['x'])"),
    ("split", {"sep": ","}, "give index"),
    ("split", {"sep": "", "index": 0}, "sep: String should have at least 1 character"),
    ("split", {"maxsplit": 99}, "maxsplit: Input should be less than or equal to 15"),
    ("join", {}, "sep: Field required"),
    ("truncate_chars", {"n": -1}, "n: Input should be greater than or equal to 0"),
    ("truncate_chars", {"n": True}, "n: Input should be a valid integer"),
    ("truncate_tokens", {"n": 1.5}, "n: Input should be a valid integer"),
    ("truncate_tokens", {"n": 1, "keep": "middle"}, "keep"),
    ("json_field", {"path": "a..b"}, "path 'a..b' has an empty segment"),
    ("json_field", {"path": ".a"}, "empty segment"),
    ("format", {}, "template: Field required"),
    ("format", {"template": "{}"}, "{} is not a plain name"),
    ("format", {"template": "{0}"}, "{0} is not a plain name"),
    ("format", {"template": "{a.b}"}, "{a.b} is not a plain name"),
    ("format", {"template": "{a[0]}"}, "{a[0]} is not a plain name"),
    ("format", {"template": "{a!r}"}, "{a} has a conversion or format spec"),
    ("format", {"template": "{a:>10}"}, "{a} has a conversion or format spec"),
    ("format", {"template": "{a:{b}}"}, "{a} has a conversion or format spec"),
    ("format", {"template": "oops }"}, "template is malformed"),
    ("format", {"template": "{oops"}, "template is malformed"),
])
def test_bad_params(name: str, params: dict[str, Any], expected: str) -> None:
    msg = invalid(name, params, inputs=("a",) if name in ("join", "format") else ("text",))
    assert msg.startswith(f"{name}: invalid params: ")
    assert expected in msg


def test_params_must_be_an_object() -> None:
    assert "params must be an object, got list" in invalid("lower", [1])
    validate_call("lower", None, ["text"], ["output"])  # None means no params


@pytest.mark.parametrize(("name", "params", "inputs", "outputs", "expected"), [
    ("lower", {}, ["txt"], ["output"], "inputs must be exactly ['text'], got ['txt']"),
    ("lower", {}, [], ["output"], "inputs must be exactly ['text'], got []"),
    ("lower", {}, ["text", "more"], ["output"], "inputs must be exactly ['text']"),
    ("lower", {}, ["text"], ["out"], "outputs must be exactly ['output'], got ['out']"),
    ("lower", {}, ["text"], [], "outputs must be exactly ['output'], got []"),
    ("lower", {}, ["text"], ["output", "output2"], "outputs must be exactly ['output']"),
    ("concat", {}, [], ["output"], "needs at least one input"),
    ("join", {"sep": ","}, [], ["output"], "needs at least one input"),
    ("concat", {}, ["a", "a"], ["output"], "duplicate input names ['a']"),
    ("split", {"sep": ",", "maxsplit": 1}, ["text"], ["a"], "with these params it has 2 outputs, got 1"),
    ("split", {"sep": ",", "maxsplit": 1}, ["text"], ["a", "a"], "duplicate output names ['a']"),
    ("split", {"sep": ",", "index": 0}, ["text"], ["a"], "outputs must be exactly ['output']"),
    ("format", {"template": "{a} {b}"}, ["a"], ["output"], "inputs must be exactly ['a', 'b'], got ['a']"),
    ("format", {"template": "{a}"}, ["a", "b"], ["output"], "inputs must be exactly ['a'], got ['a', 'b']"),
    ("concat", {}, ["a", ""], ["output"], "input names must be 1 to 256 characters: ''"),
    ("concat", {}, ["a", "x" * 257], ["output"], "input names must be 1 to 256 characters"),
    ("concat", {}, ["a", 3], ["output"], "input names must be 1 to 256 characters: 3"),
    ("concat", {}, [f"i{k}" for k in range(65)], ["output"], "at most 64 inputs, got 65"),
    ("concat", {}, "abc", ["output"], "inputs must be a list of names"),
    ("concat", {}, ["a"], "output", "outputs must be a list of names"),
])
def test_bad_ports(name: str, params: dict[str, Any], inputs: Any, outputs: Any, expected: str) -> None:
    msg = invalid(name, params, inputs, outputs)
    assert msg.startswith(f"{name}: ")
    assert expected in msg


def test_valid_call_keeps_names_and_order() -> None:
    call = validate_call("join", {"sep": " "}, ["b", "a"], ["output"])
    assert isinstance(call, TransformCall)
    assert (call.name, call.inputs, call.outputs) == ("join", ("b", "a"), ("output",))
    call = validate_call("lower", {}, ["text"], ["output"])
    assert call.params.model_dump() == {}


# ---- properties ----------------------------------------------------------------------------------------
# at least one parameter set per transform, with the ports each needs
CASES: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    ("strip", {}, ["text"], ["output"]),
    ("strip", {"chars": "ab ", "side": "left"}, ["text"], ["output"]),
    ("lower", {}, ["text"], ["output"]),
    ("upper", {}, ["text"], ["output"]),
    ("replace", {"old": "a", "new": "xyz"}, ["text"], ["output"]),
    ("replace", {"old": "ab", "new": "", "count": 2}, ["text"], ["output"]),
    ("regex_extract", {"pattern": r"(\d+)-(?P<w>\w*)", "group": "w"}, ["text"], ["output"]),
    ("regex_extract", {"pattern": r"^\s*(.)", "group": 1, "default": ""}, ["text"], ["output"]),
    ("split", {"sep": ",", "index": 1}, ["text"], ["output"]),
    ("split", {"index": -2, "maxsplit": 3}, ["text"], ["output"]),
    ("split", {"sep": ", ", "maxsplit": 2}, ["text"], ["a", "b", "c"]),
    ("split", {"maxsplit": 1, "default": ""}, ["text"], ["a", "b"]),
    ("join", {"sep": "\n"}, ["text", "other"], ["output"]),
    ("concat", {}, ["other", "text"], ["output"]),
    ("truncate_tokens", {"n": 3}, ["text"], ["output"]),
    ("truncate_tokens", {"n": 5, "keep": "end"}, ["text"], ["output"]),
    ("truncate_chars", {"n": 4}, ["text"], ["output"]),
    ("truncate_chars", {"n": 4, "keep": "end"}, ["text"], ["output"]),
    ("json_field", {"path": "a.0.b"}, ["text"], ["output"]),
    ("json_field", {"path": "0", "default": "none"}, ["text"], ["output"]),
    ("json_field", {}, ["text"], ["output"]),
    ("format", {"template": "<{text}>{{}}{other}{text}"}, ["text", "other"], ["output"]),
]
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "0"]), inner, max_size=3),
    max_leaves=10,
).map(json.dumps)
STRINGS = st.text(max_size=60) | JSONISH | st.text(alphabet="ab01,- \n{}[]\":.日\ufffd", max_size=60)


def test_cases_cover_every_transform() -> None:
    assert {name for name, *_ in CASES} == set(TRANSFORMS)


@pytest.mark.parametrize(("name", "params", "inputs", "outputs"), CASES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=STRINGS, other=STRINGS, limit=st.sampled_from([3, 30, 1_000_000]))
def test_no_input_raises_anything_but_transform_error(
    name: str, params: dict[str, Any], inputs: list[str], outputs: list[str], text: str, other: str, limit: int
) -> None:
    call = validate_call(name, params, inputs, outputs)
    for ctx in (byte_ctx(max_output_chars=limit), word_ctx()):
        try:
            out = run_transform(call, {"text": text, "other": other}, ctx)
        except TransformError as exc:
            assert "unexpected internal error" not in str(exc)
            continue
        assert list(out) == outputs
        assert all(isinstance(v, str) and len(v) <= ctx.max_output_chars for v in out.values())


PARAM_VALUES = (
    st.none() | st.booleans() | st.integers(-3, 20) | st.text(max_size=8) | st.lists(st.integers(), max_size=2)
)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(TRANSFORMS) + ["nope"]),
    params=st.dictionaries(
        st.sampled_from(["chars", "side", "old", "new", "count", "pattern", "group", "default", "sep", "index",
                         "maxsplit", "n", "keep", "path", "template", "x"]),
        PARAM_VALUES, max_size=4,
    ),
    inputs=st.lists(st.sampled_from(["text", "a", "b", "", "x" * 300]), max_size=3),
    outputs=st.lists(st.sampled_from(["output", "a", "b"]), max_size=3),
)
def test_validation_raises_only_invalid_request(name: str, params: dict[str, Any], inputs: list[str],
                                                outputs: list[str]) -> None:
    try:
        call = validate_call(name, params, inputs, outputs)
    except InvalidRequestError as exc:
        assert str(exc).startswith(("unknown transform", f"{name}: "))
        return
    if name == "regex_extract":
        return  # arbitrary patterns are validated, not run (no catastrophic-backtracking guard; see docs)
    try:
        result = run_transform(call, dict.fromkeys(call.inputs, "a,b,c 123"), byte_ctx())
    except TransformError as exc:
        assert "unexpected internal error" not in str(exc)
        return
    assert list(result) == list(call.outputs)


def test_catastrophic_regex_fails_within_the_time_limit() -> None:
    """A pattern that backtracks exponentially fails its call with a clear error after the time limit."""
    import time as _time

    call = validate_call("regex_extract", {"pattern": r"(a|aa)+$"}, ["text"], ["output"])
    ctx = TransformContext(regex_timeout_s=0.2)
    t0 = _time.perf_counter()
    with pytest.raises(TransformError, match=r"ran longer than the limit of 0.2 s .* backtracks catastrophically"):
        run_transform(call, {"text": "a" * 60 + "!"}, ctx)
    assert _time.perf_counter() - t0 < 2.0
    # the classic nested quantifier is handled without backtracking at all: a plain "no match"
    nested = validate_call("regex_extract", {"pattern": r"^(a+)+$"}, ["text"], ["output"])
    with pytest.raises(TransformError, match="does not match"):
        run_transform(nested, {"text": "a" * 40 + "!"}, ctx)
