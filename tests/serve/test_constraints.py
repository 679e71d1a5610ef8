"""Output constraints are validated by llguidance before any engine work, with the matcher's message."""

from __future__ import annotations

import asyncio
import json

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


def test_answers_are_kept_by_digest_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache holds the latest answers, keyed by a digest (not the constraint's text, which may be megabytes),
    least recently used forgotten first."""
    from parrot.serve import constraints

    computed: list[str] = []
    real = constraints._problem
    monkeypatch.setattr(constraints, "_problem", lambda f, v: computed.append(v) or real(f, v))
    answers = constraints._Answers(2)
    big = [json.dumps({"type": "string", "pattern": f"^{i}" + "x" * 100_000}) for i in range(3)]
    for value in (big[0], big[1], big[0], big[2], big[0], big[1]):
        assert answers.get("json_schema", value) is None  # valid
    # big[0] stayed (used), big[1] was forgotten and computed again (counted: these; a check another test left
    # running on the module's pool may compute its own meanwhile)
    assert len(answers) == 2 and len([v for v in computed if v in big]) == 4
    assert all(len(repr(k)) < 200 for k in answers._answers)  # digests, not texts
    assert answers.get("regex", json.dumps("[")).startswith("invalid regex")
