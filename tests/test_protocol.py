"""The shared schemas' own checks (parrot/protocol.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from parrot.protocol import MAX_STOP_CHARS, TOP_K_ALL, EngineHeartbeat, EngineRegistration, RuntimeInfo, SamplingParams


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


def _runtime() -> RuntimeInfo:
    return RuntimeInfo(model="m", max_context_len=64, page_size=16, total_pages=8, free_pages=8, num_contexts=0,
                       num_cached_tokens=0, running=0, waiting=0, recent_step_ms=0.0, steps=0, shape_misses=0,
                       preemptions=0, evictions=0, cascade_steps=0)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9001", "https://engine.internal", "http://[::1]:8000/", "http://h:1/p"])
def test_an_engine_registers_with_an_http_url(url: str) -> None:
    assert EngineRegistration(name="e", url=url, model="m", max_context_len=8).url == url
    assert EngineHeartbeat(name="e", runtime=_runtime(), url=url).url == url


@pytest.mark.parametrize("url", ["ftp://h", "file:///etc/passwd", "http://", "127.0.0.1:9001", "http://user:pw@h:1",
                                 "http://h:1/?next=x", "http://h:1/#f", "http://h:99999", "http://h:0",
                                 "javascript:alert(1)", "", "http://h/" + "a" * 3000])
def test_an_engine_url_the_core_would_misread_is_refused(url: str) -> None:
    """The serve core calls a registered engine at its URL with the engine key: a URL of another scheme, without a
    host, or with credentials, a query or a fragment is refused at registration (422), and a heartbeat too."""
    with pytest.raises(ValidationError, match="url"):
        EngineRegistration(name="e", url=url, model="m", max_context_len=8)
    with pytest.raises(ValidationError, match="url"):
        EngineHeartbeat(name="e", runtime=_runtime(), url=url)
