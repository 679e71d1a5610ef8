"""Native functions: a fixed, documented set of string transforms that run on the server as graph nodes.

No user code ever runs on the server. A native call names one transform from `TRANSFORMS`, gives its
parameters (checked against the transform's pydantic schema, unknown keys rejected) and binds named
string inputs and outputs. `validate_call` checks all of that up front (when the call is submitted) and
returns a `TransformCall`; `run_transform` runs it once its inputs are ready. See docs/native-functions.md.

User patterns (`regex_extract`) run on the `regex` package with a time limit (`TransformContext.
regex_timeout_s`) and without holding the GIL, so a catastrophic pattern fails its call with a clear error
instead of freezing the server; the serve core runs transforms on worker threads, never on its event loop.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import regex
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from parrot.engine.tokenizer import encodable
from parrot.errors import InvalidRequestError, ParrotError

MAX_OUTPUT_CHARS = 1_000_000  # per output; ~1 MB of ASCII text
MAX_PATTERN_CHARS = 500
REGEX_TIMEOUT_S = 1.0  # default time limit of one regular-expression search
MAX_INPUTS = 64  # as `NativeCallRequest.inputs` in protocol.py
MAX_OUTPUTS = 16  # as `NativeCallRequest.outputs`
MAX_NAME_CHARS = 256
TEXT = "text"  # the input of every single-input transform
OUTPUT = "output"  # the output of every single-output transform


class TransformError(ParrotError):
    """A native function failed at run time (no regex match, input not JSON, output too large, ...)."""

    code = "transform_failed"


@dataclass(frozen=True)
class TransformContext:
    """What a transform may use besides its inputs: the tokenizer of the model the app targets (only
    `truncate_tokens` needs it) and the output size limit."""

    tokenize: Callable[[str], list[int]] | None = None
    detokenize: Callable[[list[int]], str] | None = None
    max_output_chars: int = MAX_OUTPUT_CHARS
    regex_timeout_s: float = REGEX_TIMEOUT_S  # a user pattern searching longer than this fails its call

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, max_output_chars: int = MAX_OUTPUT_CHARS,
                       regex_timeout_s: float = REGEX_TIMEOUT_S) -> TransformContext:
        """For a `parrot.engine.tokenizer.Tokenizer`: encode without BOS and decode keeping special tokens,
        so `truncate_tokens` counts only the text's own tokens and keeps the text as it was."""
        return cls(
            tokenize=lambda text: tokenizer.encode(text, add_bos=False),
            detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            max_output_chars=max_output_chars,
            regex_timeout_s=regex_timeout_s,
        )


# ---- parameter schemas -----------------------------------------------------------------------------
class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NoParams(Params):
    pass


class StripParams(Params):
    chars: str | None = Field(None, description="characters to remove (default: whitespace)")
    side: Literal["both", "left", "right"] = "both"


class ReplaceParams(Params):
    old: str = Field(min_length=1)
    new: str
    count: int | None = Field(None, ge=0, description="replace at most this many (default: all)")


class RegexExtractParams(Params):
    pattern: str = Field(min_length=1, max_length=MAX_PATTERN_CHARS)
    group: int | str = Field(0, description="group number or name; 0 is the whole match")
    default: str | None = Field(None, description="output when nothing matches (default: fail)")
    _regex: regex.Pattern[str] = PrivateAttr()

    @model_validator(mode="after")
    def _compile(self) -> RegexExtractParams:
        try:
            pattern = regex.compile(self.pattern)
        except (regex.error, RecursionError, OverflowError, ValueError, TypeError) as exc:
            raise ValueError(f"pattern is not a valid regular expression: {exc}") from None
        if isinstance(self.group, int) and not 0 <= self.group <= pattern.groups:
            raise ValueError(f"group {self.group} does not exist (the pattern has {pattern.groups} groups)")
        if isinstance(self.group, str) and self.group not in pattern.groupindex:
            raise ValueError(f"group {self.group!r} does not exist (named groups: {sorted(pattern.groupindex)})")
        self._regex = pattern
        return self


class SplitParams(Params):
    sep: str | None = Field(None, min_length=1, description="separator (default: runs of whitespace)")
    index: int | None = Field(None, description="which piece is the one output (negative counts from the end)")
    maxsplit: int | None = Field(None, ge=0, le=MAX_OUTPUTS - 1, description="split at most this many times")
    default: str | None = Field(None, description="for a piece that does not exist (default: fail)")

    @model_validator(mode="after")
    def _mode(self) -> SplitParams:
        if self.index is None and self.maxsplit is None:
            raise ValueError("give index (one output: that piece) or maxsplit (maxsplit + 1 outputs)")
        return self


class JoinParams(Params):
    sep: str


class TruncateParams(Params):
    n: int = Field(ge=0, description="keep at most this many tokens / characters")
    keep: Literal["start", "end"] = "start"


class JsonFieldParams(Params):
    path: str = Field("", max_length=1000, description="dot-separated keys / list indexes; '' is the whole value")
    default: str | None = Field(None, description="output when the path is missing (default: fail)")

    @model_validator(mode="after")
    def _path(self) -> JsonFieldParams:
        if self.path and any(not part for part in self.path.split(".")):
            raise ValueError(f"path {self.path!r} has an empty segment")
        return self

    @property
    def segments(self) -> list[str]:
        return self.path.split(".") if self.path else []


class FormatParams(Params):
    template: str = Field(max_length=MAX_OUTPUT_CHARS)
    _pieces: list[tuple[str, str | None]] = PrivateAttr()

    @model_validator(mode="after")
    def _parse(self) -> FormatParams:
        pieces: list[tuple[str, str | None]] = []
        try:
            parsed = list(string.Formatter().parse(self.template))
        except ValueError as exc:
            raise ValueError(f"template is malformed: {exc} (write {{{{ and }}}} for literal braces)") from None
        for literal, name, spec, conversion in parsed:
            if name is not None:
                if not name.isidentifier():
                    raise ValueError(
                        f"template field {{{name}}} is not a plain name (positional fields, attribute and "
                        "index access are not allowed)"
                    )
                if spec or conversion:
                    raise ValueError(f"template field {{{name}}} has a conversion or format spec; only {{name}}")
            pieces.append((literal, name))
        self._pieces = pieces
        return self

    @property
    def fields(self) -> list[str]:
        """The template's field names, first occurrence order, without repeats."""
        return list(dict.fromkeys(name for _, name in self._pieces if name is not None))


# ---- the transforms ----------------------------------------------------------------------------------
Fn = Callable[[Any, Mapping[str, str], "TransformCall", TransformContext], list[str]]


@dataclass(frozen=True)
class Transform:
    """One native function. `inputs` / `outputs` give the port names a call must bind; a callable there
    means they depend on the parameters: it returns the names (a tuple) or, for ports the caller names,
    how many there must be (an int; `None` for inputs: one or more, in the order given)."""

    name: str
    summary: str
    params: type[Params]
    run: Fn
    inputs: tuple[str, ...] | Callable[[Any], tuple[str, ...] | None] = (TEXT,)
    outputs: tuple[str, ...] | Callable[[Any], tuple[str, ...] | int] = (OUTPUT,)
    example: tuple[dict[str, Any], dict[str, str], dict[str, str]] = field(default=({}, {}, {}))

    def expected_inputs(self, params: Params) -> tuple[str, ...] | None:
        return self.inputs(params) if callable(self.inputs) else self.inputs

    def expected_outputs(self, params: Params) -> tuple[str, ...] | int:
        return self.outputs(params) if callable(self.outputs) else self.outputs

    def describe(self) -> dict[str, Any]:
        """JSON-able description (name, summary, parameter JSON schema, example) for docs and APIs."""
        params, inputs, outputs = self.example
        return {
            "name": self.name,
            "summary": self.summary,
            "params": self.params.model_json_schema(),
            "example": {"params": params, "inputs": inputs, "outputs": outputs},
        }


@dataclass(frozen=True)
class TransformCall:
    """A validated native call: the transform, its parsed parameters, its input and output port names."""

    transform: Transform
    params: Params
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.transform.name


def _budget(call: TransformCall, ctx: TransformContext, size: int) -> None:
    """Refuse before building an output that would exceed the limit."""
    if size > ctx.max_output_chars:
        raise TransformError(
            f"{call.name}: output would be {size} characters, more than the limit of {ctx.max_output_chars}"
        )


def _strip(p: StripParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    text = x[TEXT]
    fn = {"both": text.strip, "left": text.lstrip, "right": text.rstrip}[p.side]
    return [fn(p.chars)]


def _lower(p: NoParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    return [x[TEXT].lower()]


def _upper(p: NoParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    return [x[TEXT].upper()]


def _replace(p: ReplaceParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    text = x[TEXT]
    if len(p.new) > len(p.old):
        hits = text.count(p.old)
        if p.count is not None:
            hits = min(hits, p.count)
        _budget(call, ctx, len(text) + hits * (len(p.new) - len(p.old)))
    return [text.replace(p.old, p.new, -1 if p.count is None else p.count)]


def _regex_extract(
    p: RegexExtractParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext
) -> list[str]:
    try:  # concurrent: the search releases the GIL, so the server's other threads run meanwhile
        match = p._regex.search(x[TEXT], timeout=ctx.regex_timeout_s, concurrent=True)
    except TimeoutError:
        raise TransformError(
            f"regex_extract: pattern {p.pattern!r} ran longer than the limit of {ctx.regex_timeout_s:g} s on this "
            f"input ({len(x[TEXT])} characters): it backtracks catastrophically; make it less ambiguous "
            "(e.g. no nested quantifiers like (a+)+)") from None
    value = match.group(p.group) if match else None
    if value is None:  # no match, or the group did not take part in it
        if p.default is None:
            what = "does not match" if match is None else f"matches, but group {p.group!r} did not take part"
            raise TransformError(f"regex_extract: pattern {p.pattern!r} {what} (input {_preview(x[TEXT])})")
        return [p.default]
    return [value]


def _pieces(n: int) -> str:
    return "1 piece" if n == 1 else f"{n} pieces"


def _split(p: SplitParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    pieces = x[TEXT].split(p.sep, -1 if p.maxsplit is None else p.maxsplit)
    if p.index is not None:
        if -len(pieces) <= p.index < len(pieces):
            return [pieces[p.index]]
        if p.default is None:
            raise TransformError(f"split: piece {p.index} does not exist (the input has {_pieces(len(pieces))})")
        return [p.default]
    assert p.maxsplit is not None
    want = p.maxsplit + 1
    if len(pieces) < want:
        if p.default is None:
            raise TransformError(f"split: the input has {_pieces(len(pieces))}, {want} outputs need {want}")
        pieces += [p.default] * (want - len(pieces))
    return pieces


def _join(p: JoinParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    values = [x[name] for name in call.inputs]
    _budget(call, ctx, sum(map(len, values)) + len(p.sep) * (len(values) - 1))
    return [p.sep.join(values)]


def _concat(p: NoParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    values = [x[name] for name in call.inputs]
    _budget(call, ctx, sum(map(len, values)))
    return ["".join(values)]


def _cut(items: Sequence[Any], n: int, keep: str) -> Sequence[Any]:
    if len(items) <= n:
        return items
    return items[:n] if keep == "start" else items[len(items) - n :]


def _truncate_chars(p: TruncateParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    return [str(_cut(x[TEXT], p.n, p.keep))]


def _truncate_tokens(
    p: TruncateParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext
) -> list[str]:
    if ctx.tokenize is None or ctx.detokenize is None:
        raise TransformError("truncate_tokens: no tokenizer is available for this call's model")
    text = x[TEXT]
    try:
        ids = list(ctx.tokenize(text))
        if len(ids) <= p.n:
            return [text]
        kept = list(_cut(ids, p.n, p.keep))
        out = ctx.detokenize(kept)
        # a multi-byte character cut in two decodes to U+FFFD; drop the broken piece rather than invent text
        while kept and p.keep == "start" and out.endswith("\ufffd") and not text.startswith(out):
            kept.pop()
            out = ctx.detokenize(kept)
        while kept and p.keep == "end" and out.startswith("\ufffd") and not text.endswith(out):
            kept.pop(0)
            out = ctx.detokenize(kept)
    except TransformError:
        raise
    except Exception as exc:  # the tokenizer is not ours to trust with types
        raise TransformError(f"truncate_tokens: the tokenizer failed ({type(exc).__name__}: {exc})") from exc
    return [out]


def _json_field(p: JsonFieldParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    try:
        value: Any = json.loads(x[TEXT])
    except (ValueError, RecursionError) as exc:
        raise TransformError(f"json_field: the input is not JSON ({exc}; input {_preview(x[TEXT])})") from None
    for depth, key in enumerate(p.segments):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and re.fullmatch(r"-?\d{1,9}", key) and -len(value) <= int(key) < len(value):
            value = value[int(key)]
        else:
            if p.default is not None:
                return [p.default]
            where = ".".join(p.segments[: depth + 1])
            raise TransformError(f"json_field: path {p.path!r} is missing at {where!r} (input {_preview(x[TEXT])})")
    if isinstance(value, str):
        return [value]
    try:
        return [json.dumps(value, ensure_ascii=False)]
    except (ValueError, RecursionError) as exc:  # e.g. NaN is fine, but very deep values are not
        raise TransformError(f"json_field: cannot render the value at {p.path!r} ({exc})") from None


def _format(p: FormatParams, x: Mapping[str, str], call: TransformCall, ctx: TransformContext) -> list[str]:
    _budget(call, ctx, sum(len(lit) + (len(x[name]) if name is not None else 0) for lit, name in p._pieces))
    return ["".join(lit + (x[name] if name is not None else "") for lit, name in p._pieces)]


def _preview(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _split_outputs(p: SplitParams) -> tuple[str, ...] | int:
    return (OUTPUT,) if p.index is not None else p.maxsplit + 1  # type: ignore[operator]


_ALL: list[Transform] = [
    Transform("strip", "remove leading and/or trailing characters (whitespace by default)", StripParams, _strip,
              example=({}, {TEXT: "  hi \n"}, {OUTPUT: "hi"})),
    Transform("lower", "lower-case", NoParams, _lower, example=({}, {TEXT: "Hello"}, {OUTPUT: "hello"})),
    Transform("upper", "upper-case", NoParams, _upper, example=({}, {TEXT: "Hello"}, {OUTPUT: "HELLO"})),
    Transform("replace", "replace occurrences of a substring", ReplaceParams, _replace,
              example=({"old": "cat", "new": "dog"}, {TEXT: "cat and cat"}, {OUTPUT: "dog and dog"})),
    Transform("regex_extract", "the first match of a regular expression (or one of its groups)",
              RegexExtractParams, _regex_extract,
              example=({"pattern": r"Answer:\s*(\w+)", "group": 1}, {TEXT: "... Answer: Paris."}, {OUTPUT: "Paris"})),
    Transform("split", "split on a separator: one piece (index) or the first maxsplit + 1 pieces", SplitParams,
              _split, outputs=_split_outputs,
              example=({"sep": ",", "maxsplit": 1}, {TEXT: "a,b,c"}, {"head": "a", "rest": "b,c"})),
    Transform("join", "the inputs in the order given, with a separator between them", JoinParams, _join,
              inputs=lambda p: None, example=({"sep": "\n"}, {"a": "x", "b": "y"}, {OUTPUT: "x\ny"})),
    Transform("concat", "the inputs in the order given, back to back", NoParams, _concat,
              inputs=lambda p: None, example=({}, {"a": "x", "b": "y"}, {OUTPUT: "xy"})),
    Transform("truncate_tokens", "at most n tokens of the model's tokenizer", TruncateParams, _truncate_tokens,
              example=({"n": 2}, {TEXT: "one two three"}, {OUTPUT: "one two"})),
    Transform("truncate_chars", "at most n characters", TruncateParams, _truncate_chars,
              example=({"n": 3}, {TEXT: "abcdef"}, {OUTPUT: "abc"})),
    Transform("json_field", "a field of a JSON document by path (strings as is, anything else as JSON)",
              JsonFieldParams, _json_field,
              example=({"path": "items.0.name"}, {TEXT: '{"items": [{"name": "pen"}]}'}, {OUTPUT: "pen"})),
    Transform("format", "fill a template's {name} fields from the inputs of those names", FormatParams, _format,
              inputs=lambda p: tuple(p.fields),
              example=({"template": "Q: {q}\nA: {a}"}, {"q": "1+1?", "a": "2"}, {OUTPUT: "Q: 1+1?\nA: 2"})),
]
TRANSFORMS: dict[str, Transform] = {t.name: t for t in _ALL}


# ---- API ---------------------------------------------------------------------------------------------
def validate_call(
    transform: str, params: dict[str, Any] | None, inputs: list[str], outputs: list[str]
) -> TransformCall:
    """Check a native call before it enters the graph; raises InvalidRequestError naming the problem."""
    spec = TRANSFORMS.get(transform)
    if spec is None:
        raise InvalidRequestError(f"unknown transform {transform!r}; known transforms: {', '.join(sorted(TRANSFORMS))}")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{transform}: params must be an object, got {type(params).__name__}")
    try:
        parsed = spec.params.model_validate(params)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'params'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False)
        )
        raise InvalidRequestError(f"{transform}: invalid params: {problems}") from None
    ins = _names(transform, "input", inputs, MAX_INPUTS)
    outs = _names(transform, "output", outputs, MAX_OUTPUTS)
    want_in = spec.expected_inputs(parsed)
    if want_in is None:
        if not ins:
            raise InvalidRequestError(f"{transform}: needs at least one input (any names; they are used in order)")
    elif set(ins) != set(want_in):
        raise InvalidRequestError(f"{transform}: inputs must be exactly {sorted(want_in)}, got {sorted(ins)}")
    want_out = spec.expected_outputs(parsed)
    if isinstance(want_out, int):
        if len(outs) != want_out:
            raise InvalidRequestError(f"{transform}: with these params it has {want_out} outputs, got {len(outs)}")
    elif set(outs) != set(want_out):
        raise InvalidRequestError(f"{transform}: outputs must be exactly {sorted(want_out)}, got {sorted(outs)}")
    return TransformCall(spec, parsed, ins, outs)


def _names(transform: str, kind: str, names: Sequence[str], limit: int) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence | Mapping):
        raise InvalidRequestError(f"{transform}: {kind}s must be a list of names")
    out = tuple(names)
    if len(out) > limit:
        raise InvalidRequestError(f"{transform}: at most {limit} {kind}s, got {len(out)}")
    for name in out:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise InvalidRequestError(f"{transform}: {kind} names must be 1 to {MAX_NAME_CHARS} characters: {name!r}")
    if len(set(out)) != len(out):
        dupes = sorted({n for n in out if out.count(n) > 1})
        raise InvalidRequestError(f"{transform}: duplicate {kind} names {dupes}")
    return out


def run_transform(call: TransformCall, inputs: Mapping[str, str], ctx: TransformContext) -> dict[str, str]:
    """Run a validated call on its input values; raises TransformError naming the problem."""
    missing = [name for name in call.inputs if name not in inputs]
    if missing:
        raise TransformError(f"{call.name}: missing input values for {missing}")
    for name in call.inputs:
        if not isinstance(inputs[name], str):
            raise TransformError(f"{call.name}: input {name!r} is {type(inputs[name]).__name__}, not a string")
    try:
        values = call.transform.run(call.params, inputs, call, ctx)
    except TransformError:
        raise
    except Exception as exc:  # a bug here must not take the serve loop down; say so plainly
        raise TransformError(f"{call.name}: unexpected internal error ({type(exc).__name__}: {exc})") from exc
    if len(values) != len(call.outputs):  # pragma: no cover - a bug in a transform above
        raise TransformError(f"{call.name}: produced {len(values)} values for {len(call.outputs)} outputs")
    result: dict[str, str] = {}
    for name, value in zip(call.outputs, values, strict=True):
        if len(value) > ctx.max_output_chars:
            raise TransformError(
                f"{call.name}: output {name!r} is {len(value)} characters, more than the limit of "
                f"{ctx.max_output_chars}"
            )
        result[name] = encodable(value)  # (JSON's "\ud800" parses to a lone surrogate, which no UTF-8 writer takes)
    return result


def describe_transforms() -> list[dict[str, Any]]:
    """Every transform's name, summary, parameter schema and example (for docs and a listing endpoint)."""
    return [t.describe() for t in _ALL]
