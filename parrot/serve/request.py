"""Request templates: `{{name}}` placeholders -> chunks -> parsed request -> completion chains.

A template is text with `{{name}}` placeholders (`[A-Za-z_][A-Za-z0-9_]*`, spaces allowed inside the
braces: `{{ name }}`). Single braces are plain text. Each placeholder is bound to one `Parameter`: an
input (filled with a semantic variable's content or a literal value) or an output (generated into a
semantic variable). Everything is validated up front; a bad request raises `InvalidRequestError` with a
message naming the problem.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parrot.errors import InvalidRequestError

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPEN, _CLOSE = "{{", "}}"


@dataclass(frozen=True)
class TextChunk:
    """Constant text of the template."""

    text: str


@dataclass(frozen=True)
class PlaceholderChunk:
    """A `{{name}}` placeholder."""

    name: str


Chunk = TextChunk | PlaceholderChunk


@dataclass
class Parameter:
    """The binding of one placeholder.

    Input: exactly one of `var_id` (an existing semantic variable) or `value` (literal text).
    Output: `var_id` names the variable to generate into (None: the session creates one); no `value`;
    `sampling_config` (a dict of sampling settings, or None for the defaults) says how to generate.
    """

    name: str
    is_output: bool
    var_id: str | None = None
    value: str | None = None
    sampling_config: dict[str, Any] | None = None


@dataclass
class ParsedRequest:
    """A validated request: its chunks in template order and its parameters by name."""

    chunks: list[Chunk]
    params: dict[str, Parameter] = field(default_factory=dict)

    def param_of(self, chunk: PlaceholderChunk) -> Parameter:
        return self.params[chunk.name]

    def is_output(self, chunk: Chunk) -> bool:
        return isinstance(chunk, PlaceholderChunk) and self.params[chunk.name].is_output

    @property
    def inputs(self) -> list[Parameter]:
        return [p for p in self.params.values() if not p.is_output]

    @property
    def outputs(self) -> list[Parameter]:
        return [p for p in self.params.values() if p.is_output]

    def completion_chains(self) -> list[list[Chunk]]:
        return split_completion_chains(self.chunks, self.params)


def _excerpt(template: str, pos: int, width: int = 20) -> str:
    return repr(template[max(0, pos - width): pos + width])


def parse_template(template: str) -> list[Chunk]:
    """Split a template into text and placeholder chunks. Empty text between placeholders is omitted."""
    if not isinstance(template, str):
        raise InvalidRequestError(f"template must be a string, got {type(template).__name__}")
    if template == "":
        raise InvalidRequestError("template is empty")
    chunks: list[Chunk] = []
    pos = 0
    while pos < len(template):
        open_at = template.find(_OPEN, pos)
        close_at = template.find(_CLOSE, pos)
        if close_at != -1 and (open_at == -1 or close_at < open_at):
            raise InvalidRequestError(
                f"unbalanced braces: '}}}}' at offset {close_at} without a matching '{{{{' near "
                f"{_excerpt(template, close_at)}")
        if open_at == -1:
            chunks.append(TextChunk(template[pos:]))
            break
        if open_at > pos:
            chunks.append(TextChunk(template[pos:open_at]))
        end = template.find(_CLOSE, open_at + 2)
        if end == -1:
            raise InvalidRequestError(
                f"unbalanced braces: '{{{{' at offset {open_at} is never closed near {_excerpt(template, open_at)}")
        inner = template[open_at + 2:end]
        nested = inner.find(_OPEN)
        if nested != -1:
            raise InvalidRequestError(
                f"unbalanced braces: '{{{{' at offset {open_at} is not closed before the next '{{{{' "
                f"at offset {open_at + 2 + nested} near {_excerpt(template, open_at)}")
        name = inner.strip()
        if not NAME_RE.fullmatch(name):
            raise InvalidRequestError(
                f"invalid placeholder name {inner!r} at offset {open_at}: names match [A-Za-z_][A-Za-z0-9_]*")
        chunks.append(PlaceholderChunk(name))
        pos = end + 2
    return chunks


def render_chunks(chunks: Iterable[Chunk]) -> str:
    """The canonical template of chunks (`{{name}}` without inner spaces); inverse of `parse_template`."""
    return "".join(c.text if isinstance(c, TextChunk) else f"{{{{{c.name}}}}}" for c in chunks)


def _check_parameter(p: Parameter) -> None:
    if p.is_output:
        if p.value is not None:
            raise InvalidRequestError(f"output parameter {p.name!r} must not have a value")
    else:
        if p.var_id is None and p.value is None:
            raise InvalidRequestError(f"input parameter {p.name!r} needs a var_id or a value")
        if p.var_id is not None and p.value is not None:
            raise InvalidRequestError(f"input parameter {p.name!r} has both a var_id and a value; give one")
        if p.sampling_config is not None:
            raise InvalidRequestError(f"input parameter {p.name!r} has a sampling_config; only outputs generate")
    if p.value is not None and not isinstance(p.value, str):
        raise InvalidRequestError(f"value of parameter {p.name!r} must be a string")
    if p.sampling_config is not None and not isinstance(p.sampling_config, dict):
        raise InvalidRequestError(f"sampling_config of parameter {p.name!r} must be an object")


def parse_request(template: str, parameters: Sequence[Parameter]) -> ParsedRequest:
    """Parse a template and bind its placeholders to parameters, validating both."""
    chunks = parse_template(template)
    params: dict[str, Parameter] = {}
    for p in parameters:
        if p.name in params:
            raise InvalidRequestError(f"duplicate parameter {p.name!r}")
        _check_parameter(p)
        params[p.name] = p

    output_var_ids = Counter(p.var_id for p in params.values() if p.is_output and p.var_id is not None)
    for var_id, n in output_var_ids.items():
        if n > 1:
            raise InvalidRequestError(f"variable {var_id!r} is bound to {n} output parameters; an output has one")

    uses = Counter(c.name for c in chunks if isinstance(c, PlaceholderChunk))
    for name in uses:
        if name not in params:
            raise InvalidRequestError(f"placeholder {{{{{name}}}}} has no parameter")
    for name, p in params.items():
        if name not in uses:
            raise InvalidRequestError(f"parameter {name!r} is not used in the template")
        if p.is_output and uses[name] > 1:
            raise InvalidRequestError(f"output placeholder {{{{{name}}}}} is used {uses[name]} times; an output once")

    first = chunks[0]
    if isinstance(first, PlaceholderChunk) and params[first.name].is_output:
        raise InvalidRequestError(
            f"the template starts with output placeholder {{{{{first.name}}}}}: there is nothing to condition on")
    for a, b in zip(chunks, chunks[1:], strict=False):
        if (isinstance(a, PlaceholderChunk) and isinstance(b, PlaceholderChunk)
                and params[a.name].is_output and params[b.name].is_output):
            raise InvalidRequestError(
                f"output placeholders {{{{{a.name}}}}} and {{{{{b.name}}}}} are adjacent; put text between them")
    return ParsedRequest(chunks, params)


def split_completion_chains(chunks: Sequence[Chunk], params: Mapping[str, Parameter]) -> list[list[Chunk]]:
    """Split chunks into completion chains: runs of fill chunks (text and input placeholders), each ending
    with one output placeholder.

    Fill chunks after the last output placeholder are dropped: they generate nothing, so no chain needs
    them. A request without outputs therefore has no chains. `params` tells inputs from outputs.
    """
    chains: list[list[Chunk]] = []
    current: list[Chunk] = []
    for chunk in chunks:
        current.append(chunk)
        if isinstance(chunk, PlaceholderChunk) and params[chunk.name].is_output:
            chains.append(current)
            current = []
    return chains
