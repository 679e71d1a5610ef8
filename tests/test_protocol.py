"""The shared schemas' own checks (parrot/protocol.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from parrot.protocol import MAX_STOP_CHARS, TOP_K_ALL, SamplingParams


def test_a_top_k_past_any_vocabulary_is_taken_as_the_whole_of_it() -> None:
    assert SamplingParams(top_k=40).top_k == 40
    assert SamplingParams(top_k=10**30).top_k == TOP_K_ALL == 2**31 - 1  # the sampler packs it as an int32
    with pytest.raises(ValidationError):
        SamplingParams(top_k=-1)


def test_seeds_and_logprobs_keep_their_ranges() -> None:
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # 64 bits, as vLLM's seeds
    for bad in ({"seed": 2**64}, {"seed": -1}, {"logprobs": 21}, {"max_tokens": 0}, {"min_tokens": 9, "max_tokens": 8}):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)


def test_stop_strings_are_bounded_in_number_and_length_and_never_empty() -> None:
    assert SamplingParams(stop=["x" * MAX_STOP_CHARS] * 16).stop[0] == "x" * MAX_STOP_CHARS
    for bad in ([""], ["a"] * 17, ["x" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(ValidationError, match="stop"):
            SamplingParams(stop=bad)
