"""TokenTexts: each token's bytes and printable text, and TokenLogprob from the sampler's output; prompt
logprobs: a Fill with `logprobs` scores its tokens like the model run on each prefix."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest

from parrot.engine import kernels
from parrot.engine.engine import LLMEngine
from parrot.engine.logprobs import SampledLogprob, TokenTexts, token_logprobs
from parrot.protocol import MAX_LOGPROBS, FillRequest, GenerateRequest, SamplingParams
from tests.conftest import tiny_engine_config, tiny_model, tiny_tokenizer


def test_token_bytes_and_text() -> None:
    tok = tiny_tokenizer()
    texts = TokenTexts(tok)
    a, = tok.encode("a")
    e_acute = tok.encode("é")  # two byte tokens, neither whole UTF-8
    assert texts.piece(a) == ("a", [97])
    assert [texts.piece(t) for t in e_acute] == [("bytes:\\xc3", [0xC3]), ("bytes:\\xa9", [0xA9])]
    assert texts.piece(257) == ("<|im_end|>", list(b"<|im_end|>"))  # a control token: its literal text


def test_token_logprob_with_alternatives() -> None:
    tok = tiny_tokenizer()
    texts = TokenTexts(tok)
    a, b, c = tok.encode("abc")
    sampled = SampledLogprob(-0.25, np.array([b, a, c], np.int32), np.array([-0.25, -1.5, -3.0], np.float32))
    lp = texts.logprob(b, sampled, 2)
    assert (lp.token_id, lp.token, lp.bytes, lp.logprob) == (b, "b", [98], -0.25)
    assert [(t.token_id, t.token, t.logprob) for t in lp.top] == [(b, "b", -0.25), (a, "a", -1.5)]
    assert texts.logprob(b, sampled, 0).top == []


def test_token_logprobs_are_the_log_softmax_at_the_targets() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 300)).astype(np.float32) * 4
    targets = np.array([3, 0, 299, 17, 42], np.int32)
    chosen, top_ids, top_lp = (np.asarray(a) for a in token_logprobs(logits, targets))
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    np.testing.assert_allclose(chosen, ref[np.arange(5), targets], atol=1e-5)
    assert top_ids.shape == (5, MAX_LOGPROBS)
    np.testing.assert_array_equal(top_ids[:, 0], ref.argmax(-1))
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, -1), atol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are unavailable")
@pytest.mark.parametrize("vocab", [30, 300, 49152])
def test_native_logprobs_equal_xlas(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.logprobs (a row at a time: span maxima, one sum, the top K from the best spans) against XLA's
    log_softmax and top_k: the same ids in the same order (ties: the lower id first), logprobs within
    float32 rounding of log(sum); rows with masked (-inf) tokens and with ties; a NaN row gives NaNs; rows
    that do not ask get zeros."""
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    logits[1, rng.random(vocab) < 0.5] = -np.inf
    logits[2] = np.round(logits[2])  # many ties
    logits[3, :] = 1.0  # all equal
    targets = np.array([0, 3, vocab - 1, 5, -1, 7], np.int32)
    got = {}
    for which in ("1", "0"):
        monkeypatch.setenv("PARROT_CPU_SAMPLER", which)
        got[which] = [np.asarray(a) for a in jax.jit(lambda x, t: token_logprobs(x, t))(logits, targets)]
    (c1, i1, l1), (c0, i0, l0) = got["1"], got["0"]
    k = min(MAX_LOGPROBS, vocab)
    np.testing.assert_array_equal(i1[:, :k], i0[:, :k])
    np.testing.assert_allclose(l1[:, :k], l0[:, :k], rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(c1, c0, rtol=1e-6, atol=2e-6)
    bad = logits.copy()
    bad[0, 4] = np.nan
    want = np.array([1, 1, 0, 1, 1, 1], np.int32)
    chosen, ids, lps = (np.asarray(a) for a in jax.jit(kernels.logprobs, static_argnums=3)(bad, targets, want,
                                                                                            MAX_LOGPROBS))
    assert np.isnan(chosen[0]) and np.isnan(lps[0]).all()
    assert chosen[2] == 0 and not lps[2].any() and not ids[2].any()
    np.testing.assert_allclose(chosen[3:], c1[3:], rtol=1e-6)


# ---- prompt logprobs: a Fill with `logprobs` scores its tokens --------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    """Chunks of at most 32 tokens, so a prompt of 70 spans three steps (and the row buckets 16 and 32)."""
    eng = LLMEngine(tiny_model(), tiny_engine_config(kv_memory_mb=8, max_num_batched_tokens=32,
                                                     token_buckets=[4, 8, 16, 32])).start(precompile=False)
    yield eng
    eng.shutdown()


def _reference(eng: LLMEngine, ids: list[int]) -> np.ndarray:
    """log_softmax of the logits after each prefix of `ids` ([len - 1, vocab]): one whole-prefix model call
    each, into scratch pages no context holds (before the test's contexts exist)."""
    runner = eng.runner
    pages = list(range(runner.num_pages - (len(ids) + runner.page_size - 1) // runner.page_size, runner.num_pages))
    rows = [np.asarray(runner.prefill_logits(ids[:k], 0, pages))[0] for k in range(1, len(ids))]
    logits = np.stack(rows).astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)


def test_fill_logprobs_equal_the_whole_prompt_logits(engine: LLMEngine) -> None:
    """A 70-token fill scored in three chunks, two fills of one context (the second feeds the first's last
    token again) and a fork, two scored fills in one step: every token's logprob and top tokens are those
    of the model run on the prefix before it; only a context's first token has none."""
    tok = engine.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs!")[:70]
    ref = _reference(engine, ids)

    def check(lps: list, first: int) -> None:  # lps: the logprobs of ids[first:first + len(lps)]
        for i, lp in enumerate(lps, start=first):
            assert lp.token_id == ids[i] and lp.token == tok.decode([ids[i]])
            if i == 0:
                assert lp.logprob is None and lp.top == []
                continue
            assert abs(lp.logprob - ref[i - 1, ids[i]]) < 1e-4, i
            assert [t.token_id for t in lp.top][:1] == [int(ref[i - 1].argmax())]
            assert len(lp.top) == 3 and all(abs(t.logprob - ref[i - 1, t.token_id]) < 1e-4 for t in lp.top)

    whole = engine.fill_future(FillRequest(context_id="whole", token_ids=ids, logprobs=3)).result(300)
    assert whole.num_tokens == len(ids) and len(whole.logprobs) == len(ids)
    check(whole.logprobs, 0)
    head = engine.fill_future(FillRequest(context_id="parts", token_ids=ids[:21], logprobs=3)).result(300)
    tail = engine.fill_future(FillRequest(context_id="parts", token_ids=ids[21:], logprobs=3)).result(300)
    check(head.logprobs, 0)
    check(tail.logprobs, 21)
    fork = engine.fill_future(FillRequest(context_id="fork", parent_context_id="whole", parent_num_tokens=40,
                                          token_ids=ids[40:], logprobs=3)).result(300)
    check(fork.logprobs, 40)
    futures = [engine.fill_future(FillRequest(context_id=f"batch{i}", token_ids=ids[: 30 + i], logprobs=3))
               for i in range(2)]
    for fut in futures:
        check(fut.result(300).logprobs, 0)
    assert engine.fill_future(FillRequest(context_id="plain", token_ids=ids)).result(300).logprobs is None
    # the scored context generates as any other
    gen = engine.generate_future(GenerateRequest(context_id="whole", sampling=SamplingParams(
        max_tokens=3, ignore_eos=True))).result(300)
    plain = engine.generate_future(GenerateRequest(context_id="plain", sampling=SamplingParams(
        max_tokens=3, ignore_eos=True))).result(300)
    assert gen.token_ids == plain.token_ids
