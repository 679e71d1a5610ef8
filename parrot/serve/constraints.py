"""Output constraints checked where a request arrives, before any engine work.

A request's `json_schema`, `regex`, `choice` or `grammar` (SamplingParams) is turned into an llguidance
grammar and validated by llguidance (`LLMatcher.validate_grammar`, no tokenizer needed) on a worker
thread with a time limit, so an invalid schema, regex or grammar, or a schema feature the matcher does
not support, is a 400 with the matcher's message, and a pathological one cannot stall the server. One that
no output satisfies (a regex of an empty class, a schema or rule defined only by itself) is found by a
matcher over a byte-level vocabulary and refused as well. The
engines compile the same grammar against their vocabulary when the generate arrives (and would refuse
it there too). Results are cached, so a schema used again costs nothing: the latest 1024, keyed by a digest of
the constraint's text (a schema may be megabytes: the cache holds no schema, only each one's short answer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from parrot.engine.structured import matcher_error
from parrot.engine.tokenizer import Tokenizer
from parrot.errors import InvalidRequestError
from parrot.protocol import SamplingParams

CHECK_TIMEOUT_S = 10.0
CACHED = 1024  # answers kept
MAX_MESSAGE = 2000  # characters of a matcher's message kept (it may quote the constraint)
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="parrot-constraint")


def constraint_of(params: SamplingParams) -> tuple[str, str] | None:
    """(field, canonical JSON text of its value) of the request's constraint, or None."""
    field = params.constraint
    if field is None:
        return None
    return field, json.dumps(getattr(params, field), sort_keys=True, ensure_ascii=False)


class _Answers:
    """`_problem`'s answers by (field, digest of the text), least recently used forgotten first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._answers: OrderedDict[tuple[str, bytes], str | None] = OrderedDict()

    def get(self, field: str, value_json: str) -> str | None:
        key = (field, hashlib.sha256(value_json.encode("utf-8", "surrogatepass")).digest())
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key]
        answer = _problem(field, value_json)  # (outside the lock: two threads may compute one answer twice)
        with self._lock:
            self._answers[key] = answer
            while len(self._answers) > self.size:
                self._answers.popitem(last=False)
        return answer

    def __len__(self) -> int:
        return len(self._answers)


_answers = _Answers(CACHED)


def _problem(field: str, value_json: str) -> str | None:
    """The matcher's message for an invalid constraint, or None when it is valid."""
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency; the engines check then
        return None
    value = json.loads(value_json)
    try:
        if field == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(value_json)
        elif field == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(value)
        elif field == "choice":
            grammar = llguidance.grammar_from("choice", value_json)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(value)
        message = llguidance.LLMatcher.validate_grammar(grammar)
        if not message:  # well formed: does any output satisfy it (a byte-level vocabulary tells)
            matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
            matcher.compute_bitmask()
            if matcher.is_error():
                message = matcher_error(matcher.get_error())
    except (ValueError, TypeError, RuntimeError) as exc:
        message = str(exc)
    if not message:
        return None
    message = message.strip()
    return f"invalid {field}: {message[:MAX_MESSAGE]}{' ...' if len(message) > MAX_MESSAGE else ''}"


@functools.cache
def _byte_tokenizer() -> Any:
    """llguidance's view of the byte-level vocabulary (`Tokenizer.byte_level`): any text can be spelled in it, so
    a grammar it allows no token of admits no output in any model's vocabulary."""
    import llguidance

    vocab = Tokenizer.byte_level()
    return llguidance.LLTokenizer(vocab.to_json(), n_vocab=vocab.vocab_size, eos_token=sorted(vocab.stop_token_ids))


def check(params: SamplingParams) -> None:
    """Raise InvalidRequestError with the matcher's message if the constraint is invalid (blocking)."""
    key = constraint_of(params)
    if key is not None and (problem := _answers.get(*key)) is not None:
        raise InvalidRequestError(problem)


async def validate(params: SamplingParams, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """`check` off the event loop, within `timeout_s` (InvalidRequestError when it takes longer)."""
    key = constraint_of(params)
    if key is None:
        return
    fut = asyncio.get_running_loop().run_in_executor(_pool, check, params)
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except TimeoutError:
        raise InvalidRequestError(f"the {key[0]} took longer than {timeout_s:g} s to compile: simplify it") from None

