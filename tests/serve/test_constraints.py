"""Output constraints are validated by llguidance before any engine work, with the matcher's message."""

from __future__ import annotations

import asyncio

import pytest

from parrot.errors import InvalidRequestError
from parrot.protocol import SamplingParams
from parrot.serve.constraints import check, validate


@pytest.mark.parametrize("kw", [
    {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
    {"regex": r"\d{3}-\d{4}"}, {"choice": ["yes", "no"]}, {"grammar": 'start: "a" | "b"'}, {},
])
def test_valid(kw) -> None:  # noqa: ANN001
    check(SamplingParams(**kw))
    asyncio.run(validate(SamplingParams(**kw)))


@pytest.mark.parametrize(("kw", "message"), [
    ({"json_schema": {"type": "foo"}}, "invalid json_schema: Invalid type: foo"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: foo("}, "invalid grammar"),
])
def test_invalid_is_refused_with_the_matchers_message(kw, message) -> None:  # noqa: ANN001
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(")):
        asyncio.run(validate(SamplingParams(**kw)))


def test_time_limit() -> None:
    with pytest.raises(InvalidRequestError, match="took longer"):
        asyncio.run(validate(SamplingParams(regex="x" + "a" * 50 + "y"), timeout_s=0.0))
