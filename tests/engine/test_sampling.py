"""The samplers: the processed variant against a numpy reference (penalties, logit_bias, masks, min-p, raw
logprobs), neutral rows equal to the plain samplers, and through the engine: min_tokens, logprobs and
batching invariance of greedy requests beside constrained and penalized ones."""

from __future__ import annotations

import concurrent.futures as cf

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import kernels
from parrot.engine.engine import LLMEngine
from parrot.engine.sampling import (
    FAST_TOP_K,
    GREEDY,
    PLAIN,
    SamplerExtras,
    SamplingBatch,
    Stages,
    _clear_bits,
    _select,
    _top_values,
    argmax,
    greedy_sample,
    sample,
    sample_processed,
)
from parrot.errors import InvalidRequestError
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams
from tests.conftest import tiny_engine_config, tiny_model

TIMEOUT = 300
V = 100


class Samplers:
    """The plain and processed samplers traced under one setting of PARROT_CPU_SAMPLER (new functions, so
    that jit's trace cache does not hand back the other setting's)."""

    def __init__(self) -> None:
        self.plain = jax.jit(lambda logits, sb: sample(logits, sb))
        self.processed = jax.jit(lambda *a: sample_processed(*a))


@pytest.fixture(params=["native", "xla"])
def samplers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Samplers:
    """Each test of the sampling definitions runs on the native CPU kernel (kernels/sampler.h) and on XLA's
    code (accelerators, and CPUs without the kernels)."""
    if request.param == "native" and not kernels.available():
        pytest.skip("the native CPU kernels are unavailable")
    monkeypatch.setenv("PARROT_CPU_SAMPLER", "1" if request.param == "native" else "0")
    return Samplers()


@pytest.mark.parametrize("vocab", [7, 512, 1000, 49152])
def test_argmax_equals_numpy_first_maximum(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1, :] = 3.0  # all equal: the first
    x[2, vocab // 3] = x[2, vocab - 1] = 50.0  # a tie across spans: the first
    x[3, :] = -np.inf  # nothing finite: 0, as numpy
    x[4, vocab - 1] = 1e30  # the last position, in a padded span when vocab % 512 != 0
    x[5, vocab // 2] = np.nan  # a NaN row: some position in range
    got = np.asarray(jax.jit(argmax)(x))
    np.testing.assert_array_equal(got[:5], np.argmax(x[:5], axis=-1))
    assert got.dtype == np.int32 and 0 <= got[5] < vocab


def _logits(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (batch, V)).astype(np.float32)


def _batch(temps: list[float], seeds: list[int] | None = None) -> SamplingBatch:
    params = [SamplingParams(temperature=t, seed=s) for t, s in zip(temps, seeds or [7] * len(temps), strict=True)]
    return SamplingBatch.build(params, [3] * len(temps), len(temps), [0] * len(temps))


def _only(tokens: list[int], batch: int = 1) -> SamplerExtras:
    ex = SamplerExtras.neutral(batch, V)
    ex.mask[:] = 0
    for t in tokens:
        ex.mask[:, t >> 5] |= np.int32(-(1 << 31)) if t & 31 == 31 else np.int32(1 << (t & 31))
    return ex


def test_neutral_rows_sample_as_the_plain_samplers(samplers: Samplers) -> None:
    logits = _logits(4)
    sb = _batch([0.0, 0.8, 0.0, 1.3])
    ex = SamplerExtras.neutral(4, V)
    ex.logprobs[:] = True
    tokens, chosen, top_ids, top_lp = samplers.processed(logits, sb, ex)
    assert np.array_equal(np.asarray(tokens), np.asarray(samplers.plain(logits, sb)))
    assert np.array_equal(np.asarray(tokens)[[0, 2]], np.asarray(greedy_sample(logits))[[0, 2]])
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(chosen), raw[np.arange(4), np.asarray(tokens)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(top_lp), -np.sort(-raw, axis=-1)[:, :20], rtol=1e-6)
    assert np.array_equal(np.asarray(top_ids)[:, 0], raw.argmax(-1))
    greedy = _batch([0.0] * 4)  # all greedy: the sort is skipped, the argmax is the same
    assert np.array_equal(np.asarray(samplers.processed(logits, greedy, ex)[0]), np.asarray(greedy_sample(logits)))


def test_a_rows_draw_does_not_depend_on_the_cut_off_path_of_its_batch(samplers: Samplers) -> None:
    """A row with a small top-k (no full sort needed) or with no filter at all draws the same token alone
    and beside a row that makes the batch sort the whole vocabulary."""
    logits = _logits(2, seed=9)
    logits[1] = logits[0]
    rows = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1),
            SamplingParams(temperature=0.9, seed=1)]
    sorting = SamplingParams(temperature=0.7, top_p=0.8, seed=2)  # top-p without top-k: the full sort
    fn = samplers.plain
    for row in rows:
        for step in range(20):
            alone = SamplingBatch.build([row, row], [step, step], 2, [0, 0])
            beside = SamplingBatch.build([row, sorting], [step, step], 2, [0, 0])
            assert int(fn(logits, alone)[0]) == int(fn(logits, beside)[0])


def test_every_bit_of_a_seed_keys_the_draws(samplers: Samplers) -> None:
    """A seed's 64 bits key the draws (seeds equal in their low 32 bits draw apart); a seed below 2**32 keys
    them as `jax.random.key(seed)` does."""
    logits = _logits(1, seed=5)
    seeds = [7, 7 + 2**32, 7 + 2**63, 2**64 - 1]
    sbs = [SamplingBatch.build([SamplingParams(temperature=1.0, seed=s)], [0], 1, [0]) for s in seeds]
    assert np.asarray(sbs[1].seeds).tolist() == [[1, 7]]
    draws = [[int(np.asarray(samplers.plain(logits, SamplingBatch.build(
        [SamplingParams(temperature=1.0, seed=s)], [step], 1, [0])))[0]) for step in range(24)] for s in seeds]
    assert len({tuple(d) for d in draws}) == len(seeds)
    key = jax.random.fold_in(jax.random.key(7), 0)
    assert float(jax.random.uniform(key, ())) == float(jax.random.uniform(
        jax.random.fold_in(jax.random.wrap_key_data(np.asarray(sbs[0].seeds)[0]), 0), ()))


def test_top_k_top_p_and_min_p_keep_the_right_tokens(samplers: Samplers) -> None:
    logits = np.full((1, V), -20.0, np.float32)
    logits[0, :6] = [3.0, 2.9, 2.8, 1.0, 0.5, 0.0]
    fn = samplers.plain
    for params, kept in [(dict(top_k=2), {0, 1}), (dict(top_p=0.5), {0, 1}), (dict(top_k=40, top_p=0.5), {0, 1}),
                         (dict(top_k=3), {0, 1, 2})]:
        drawn = {int(fn(logits, SamplingBatch.build([SamplingParams(temperature=1.0, seed=s, **params)], [0], 1,
                                                    [0]))[0]) for s in range(150)}
        assert drawn == kept, params


def test_whole_vocabulary_cut_offs_equal_a_sort() -> None:
    """Top-k above FAST_TOP_K and top-p without a small top-k find their cut-off by bisection over the
    values' order: the same value as sorting the row gives (k-th largest; smallest value whose larger
    values' mass is below top_p)."""
    rng = np.random.default_rng(21)
    s = (rng.standard_normal((6, 3000)) * 2.5).astype(np.float32)
    s[1, :40] = s[1, 0]  # ties
    for k in [1, 65, 700, 2999, 3000]:
        def at_least_k(key: jax.Array, t: jax.Array, k: int = k) -> jax.Array:
            return jnp.sum(key >= t, axis=-1) >= k

        got = np.asarray(jax.jit(lambda s, holds=at_least_k: _select(s, holds, True))(s))
        np.testing.assert_array_equal(got[:, 0], -np.sort(-s, axis=-1)[:, k - 1])
    e = np.exp(s.astype(np.float64) - s.max(axis=-1, keepdims=True))
    e32 = jnp.asarray(e, jnp.float32)
    for top_p in [0.05, 0.3, 0.9, 0.999]:
        mass = top_p * e.sum(axis=-1)

        def below(key: jax.Array, t: jax.Array, mass: np.ndarray = mass) -> jax.Array:
            return jnp.sum(jnp.where(key > t, e32, 0.0), axis=-1) < jnp.asarray(mass, jnp.float32)

        got = np.asarray(jax.jit(lambda s, holds=below: _select(s, holds, False))(s))[:, 0]
        for row in range(len(s)):
            desc = -np.sort(-s[row])
            before = np.cumsum(np.exp(desc.astype(np.float64) - desc[0])) - np.exp(desc.astype(np.float64) - desc[0])
            assert got[row] == desc[np.sum(before < mass[row]) - 1], (top_p, row)


def test_sorted_and_bisected_cut_offs_draw_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerators find whole-vocabulary cut-offs in the sorted row, CPUs by bisection: the same tokens
    (forced here both ways on the CPU)."""
    logits = (np.random.default_rng(17).standard_normal((6, 3000)) * 2.0).astype(np.float32)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=9)
              for t, k, p, m in [(0.9, 0, 0.7, 0.0), (1.0, 300, 1.0, 0.0), (0.7, 200, 0.9, 0.0), (1.3, 0, 0.95, 0.02),
                                 (0.8, 40, 0.9, 0.0), (0.0, 0, 1.0, 0.0)]]
    monkeypatch.setenv("PARROT_CPU_SAMPLER", "0")  # XLA's code, which has both ways
    draws = {}
    for forced in ("1", "0"):
        monkeypatch.setenv("PARROT_SAMPLER_SORT", forced)
        fn = jax.jit(lambda logits, sb: sample(logits, sb))  # traced anew under each setting
        draws[forced] = [np.asarray(fn(logits, SamplingBatch.build(params, [s] * 6, 6, [0] * 6))) for s in range(25)]
    assert all(np.array_equal(a, b) for a, b in zip(draws["1"], draws["0"], strict=True))
    assert len({int(d[0]) for d in draws["0"]}) > 3  # row 0 really samples


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are unavailable")
@pytest.mark.parametrize("vocab", [100, 3000, 49152])
def test_the_native_sampler_draws_what_xla_draws(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.sample (a row at a time: span maxima, top-p by narrowing passes, a draw by spans) against
    XLA's code of the same definitions, the same uniform numbers: the same tokens for every kind of row,
    over flat and peaked rows, ties, masked (-inf) tokens, a top-k above the vocabulary, top-p near 0 and 1,
    and min-p 1 (the largest values only)."""
    rng = np.random.default_rng(vocab)
    rows = [(rng.standard_normal(vocab) * 2.0).astype(np.float32),  # flat
            (-2.5 * np.log(rng.permutation(vocab) + 1.0)).astype(np.float32),  # peaked
            np.round(rng.standard_normal(vocab), 1).astype(np.float32)]  # many ties
    masked = rows[0].copy()
    masked[rng.random(vocab) < 0.7] = -np.inf
    rows.append(masked)
    kinds = [(1.0, 0, 1.0, 0.0), (0.8, 0, 0.95, 0.0), (0.8, 40, 1.0, 0.0), (0.8, 40, 0.95, 0.05), (0.7, 0, 1.0, 0.05),
             (1.2, 300, 1.0, 0.0), (0.9, 900, 0.9, 0.0), (0.0, 0, 1.0, 0.0), (1.0, 0, 0.02, 0.0), (1.0, 0, 0.999, 0.0),
             (1.3, 70, 0.5, 0.02), (1.0, vocab + 5, 0.7, 0.0), (0.5, 0, 1.0, 1.0), (1e-6, 0, 1.0, 0.0)]
    logits = np.stack([rows[i % len(rows)] for i in range(len(kinds))])
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=i)
              for i, (t, k, p, m) in enumerate(kinds)]
    draws = {}
    for which in ("1", "0"):
        monkeypatch.setenv("PARROT_CPU_SAMPLER", which)
        fn = jax.jit(lambda logits, sb: sample(logits, sb))
        draws[which] = np.stack([np.asarray(fn(logits, SamplingBatch.build(params, [s] * len(kinds), len(kinds),
                                                                          [0] * len(kinds)))) for s in range(25)])
    np.testing.assert_array_equal(draws["1"], draws["0"])
    assert np.isfinite(logits[np.arange(len(kinds)), draws["1"]]).all()  # never a masked token
    assert len(set(draws["1"][:, 0])) > 3  # the plain row really samples


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are unavailable")
def test_the_native_sampler_takes_rows_without_a_finite_logit() -> None:
    """NaN logits are never drawn; a row with no finite logit gets a token in range, as the argmax does; out
    of range parameters give a token in range."""
    x = np.random.default_rng(2).standard_normal((3, 700)).astype(np.float32)
    x[0, ::3] = np.nan
    x[1, :] = -np.inf
    x[2, 5] = np.inf
    one = np.ones(3, np.float32)
    tokens = np.asarray(jax.jit(kernels.sample)(x, one, np.zeros(3, np.int32), one * 0.9, one * 0, one * 0.5))
    assert tokens[0] % 3 != 0 and tokens[1] == 0 and tokens[2] == 5
    # parameters the API refuses still give a token in range: a min-p above 1 keeps nothing (the argmax)
    y = np.nan_to_num(x, nan=0.0, neginf=0.0, posinf=0.0)
    tokens = np.asarray(jax.jit(kernels.sample)(y, one, np.full(3, -5, np.int32), one * 7, one * 1.5, one * 0.999))
    np.testing.assert_array_equal(tokens, y.argmax(-1))


def test_top_values_from_the_best_spans_equal_top_k() -> None:
    """The k largest values taken from the k spans with the largest maxima are lax.top_k's, ties included
    (values repeated across and within spans, a vocabulary that is not a multiple of the span)."""
    rng = np.random.default_rng(8)
    s = np.round(rng.standard_normal((5, 20_011)) * 3, 1).astype(np.float32)  # many ties
    s[1, 5_000:5_300] = s[1].max()  # more maxima than k
    s[2, :] = 0.0
    s[3, ::97] = 9.0  # one per span, in every span
    for k in [1, 17, 64]:
        want = np.asarray(jax.lax.top_k(jnp.asarray(s), k)[0])
        got = np.asarray(jax.jit(_top_values, static_argnums=1)(jnp.asarray(s), k))
        np.testing.assert_array_equal(got, want)


def test_draws_follow_the_kept_distribution(samplers: Samplers) -> None:
    """The inverse-CDF draw: over many seeds each kept token comes up in proportion to its probability
    (within 4.5 standard deviations), and a cut token never does."""
    logits = np.full((1, V), -30.0, np.float32)
    logits[0, [7, 40, 41, 99]] = np.log([0.5, 0.3, 0.15, 0.05])
    logits[0, 60] = np.log(0.001)  # below min-p 0.01 of the top: cut
    fn = samplers.plain
    n = 3000
    drawn = np.array([int(fn(logits, SamplingBatch.build([SamplingParams(temperature=1.0, seed=i, min_p=0.01)], [i % 7],
                                                         1, [0]))[0]) for i in range(n)])
    probs = {7: 0.5, 40: 0.3, 41: 0.15, 99: 0.05}  # the -30 logits' mass is below 1e-10
    assert set(drawn) <= set(probs)
    for token, p in probs.items():
        assert abs(np.sum(drawn == token) - n * p) < 4.5 * np.sqrt(n * p * (1 - p)), token


def test_a_whole_vocabulary_row_draws_the_same_in_any_batch(samplers: Samplers) -> None:
    """A top-p row (bisection) and a row with a large top-k draw the same alone, beside a small-top-k row,
    beside a greedy row and beside each other."""
    logits = _logits(2, seed=13)
    logits[1] = logits[0]
    fn = samplers.plain
    rows = [SamplingParams(temperature=0.9, top_p=0.8, seed=3), SamplingParams(temperature=1.1, top_k=90, seed=3)]
    others = [SamplingParams(temperature=0.9, top_k=5, seed=4), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, min_p=0.2, seed=4)] + rows
    for row in rows:
        for step in range(15):
            alone = int(fn(logits, SamplingBatch.build([row, row], [step, step], 2, [0, 0]))[0])
            for other in others:
                assert int(fn(logits, SamplingBatch.build([row, other], [step, step], 2, [0, 0]))[0]) == alone


def test_top_p_renormalizes_over_what_top_k_and_min_p_keep(samplers: Samplers) -> None:
    """As in vLLM, Hugging Face and llama.cpp, top-p measures mass among the tokens top-k (and min-p) keep:
    with probabilities 0.3, 0.2, 0.1 and a tail of 0.4, top-k 3 renormalizes them to 0.5, 0.33, 0.17, and
    top-p 0.55 then keeps two (over the whole vocabulary it would keep three). The same whether the row's
    cut-off comes from the top values (top-k <= 64) or from the whole vocabulary (top-k 70)."""
    logits = np.full((1, V), np.log(0.4 / 97), np.float32)
    logits[0, :3] = np.log([0.3, 0.2, 0.1])
    fn = samplers.plain
    for params, kept in [(dict(top_k=3, top_p=0.55), {0, 1}), (dict(top_p=0.55), {0, 1, 2}),
                         (dict(min_p=0.2, top_p=0.55), {0, 1}), (dict(top_k=3), {0, 1, 2}),
                         (dict(top_k=70, top_p=0.55, min_p=0.2), {0, 1})]:
        drawn = {int(fn(logits, SamplingBatch.build([SamplingParams(temperature=1.0, seed=s, **params)], [0], 1,
                                                    [0]))[0]) for s in range(150)}
        assert drawn == kept, params


def test_mask_bits_include_the_sign_bit(samplers: Samplers) -> None:
    logits = _logits(1)
    for allowed in ([31], [63, 5], [99]):
        tokens, *_ = samplers.processed(logits, _batch([0.0]), _only(allowed))
        assert int(tokens[0]) == max(allowed, key=lambda t: logits[0, t])
        tokens, *_ = samplers.processed(logits, _batch([1.0], [11]), _only(allowed))
        assert int(tokens[0]) in allowed


def test_clearing_stop_bits_keeps_a_grammar_that_can_only_end() -> None:
    row = _only([31, 40]).mask[0]
    _clear_bits(row, frozenset({31}), keep_one=False)
    assert row[0] == 0 and row[1] == 1 << 8
    row = _only([31]).mask[0]
    _clear_bits(row, frozenset({31}), keep_one=True)  # nothing else allowed: the end stays allowed
    assert row[0] == np.int32(-(1 << 31))


def test_penalties_and_bias_follow_their_definitions(samplers: Samplers) -> None:
    """Repetition (vLLM / HF) over prompt + generated tokens, presence and frequency (OpenAI) over the
    generated ones, then logit_bias; greedy picks the argmax of the result, logprobs stay raw."""
    logits = _logits(1, seed=4)
    prompt, generated = [1, 2, 3], [3, 4, 4, 4]
    counts = np.zeros((1, V), np.int32)
    counts[0] = 2 * np.bincount(generated, minlength=V) + (np.bincount(prompt + generated, minlength=V) > 0)
    ex = SamplerExtras.neutral(1, V)
    ex.repetition[0], ex.presence[0], ex.frequency[0] = 1.7, 0.5, 0.3
    ex.bias_ids[0, :2] = [10, 11]
    ex.bias[0, :2] = [2.5, -100.0]
    ex.logprobs[0] = True
    expected = logits[0].copy()
    for t in set(prompt + generated):
        expected[t] = expected[t] / 1.7 if expected[t] > 0 else expected[t] * 1.7
    for t in set(generated):
        expected[t] -= 0.5 + 0.3 * generated.count(t)
    expected[10] += 2.5
    expected[11] -= 100.0
    tokens, chosen, *_ = samplers.processed(logits, _batch([0.0]), ex, counts)
    assert int(tokens[0]) == int(expected.argmax())
    raw = np.asarray(jax.nn.log_softmax(logits[0]))
    assert float(chosen[0]) == pytest.approx(float(raw[int(tokens[0])]), rel=1e-6)
    ex.bias[0, 0] = 100.0  # +100 as good as forces a token
    assert int(samplers.processed(logits, _batch([1.0], [5]), ex, counts)[0][0]) == 10


def _min_p(min_p: float, seed: int) -> SamplingBatch:
    return SamplingBatch.build([SamplingParams(temperature=1.0, seed=seed, min_p=min_p)], [3], 1, [0])


def test_min_p_drops_unlikely_tokens(samplers: Samplers) -> None:
    logits = np.full((1, V), -10.0, np.float32)
    logits[0, [3, 4, 5]] = [2.0, 1.5, 0.0]  # probabilities relative to the top: 1, 0.61, 0.14
    ex = SamplerExtras.neutral(1, V)
    drawn = {int(samplers.processed(logits, _min_p(0.5, s), ex)[0][0]) for s in range(200)}
    assert drawn == {3, 4}
    drawn = {int(samplers.processed(logits, _min_p(0.0, s), ex)[0][0]) for s in range(200)}
    assert {3, 4, 5} <= drawn
    # the plain sampler applies min-p itself (a request with only min-p set keeps the fast path), with the
    # same draws as the processed one
    sampler = samplers.plain
    for s in range(50):
        sb = _min_p(0.5, s)
        assert int(sampler(logits, sb)[0]) == int(samplers.processed(logits, sb, ex)[0][0]) in (3, 4)


def test_min_p_holds_for_a_row_beside_one_that_needs_processing(samplers: Samplers) -> None:
    """Every row's min-p comes from the SamplingBatch: a min-p-only row keeps it when another row of its
    batch (here one asking for logprobs) sends the batch through the processed sampler."""
    logits = np.full((2, V), -10.0, np.float32)
    logits[:, [3, 4, 5]] = [2.0, 1.5, 0.0]
    ex = SamplerExtras.neutral(2, V)
    ex.logprobs[1] = True
    drawn = set()
    for s in range(200):
        sb = SamplingBatch.build([SamplingParams(temperature=1.0, seed=s, min_p=0.5),
                                  SamplingParams(temperature=1.0, seed=s, logprobs=1)], [3, 3], 2, [0, 0])
        drawn.add(int(samplers.processed(logits, sb, ex)[0][0]))
    assert drawn == {3, 4}


def test_zero_counts_and_neutral_extras_sample_as_the_plain_sampler(samplers: Samplers) -> None:
    """The engine's one sampler per batch size: with zero counts and neutral extras it draws what the plain
    sampler draws and reports no logprobs; counts only count where a row has a penalty."""
    logits = _logits(4, seed=3)
    ex = SamplerExtras.neutral(4, V)
    zeros = np.zeros((4, V), np.int32)
    plain = samplers.plain
    for step in range(10):
        sb = SamplingBatch.build([SamplingParams(temperature=t, top_k=k, top_p=p, seed=5)
                                  for t, k, p in [(0.0, 0, 1.0), (0.8, 40, 1.0), (1.0, 0, 0.9), (1.2, 0, 1.0)]],
                                 [step] * 4, 4, [0] * 4)
        tokens, chosen, top_ids, top_lp = samplers.processed(logits, sb, ex, zeros)
        assert np.array_equal(np.asarray(tokens), np.asarray(plain(logits, sb)))
        assert not np.asarray(chosen).any() and not np.asarray(top_lp).any() and not np.asarray(top_ids).any()
    counts = np.full((4, V), 5, np.int32)  # counts without a penalty change nothing
    sb = _batch([0.0, 0.9, 0.0, 0.9])
    assert np.array_equal(np.asarray(samplers.processed(logits, sb, ex, counts)[0]), np.asarray(plain(logits, sb)))


def test_stages_name_the_parts_a_batch_needs() -> None:
    """`Stages.of`: the host's reading of a batch, as the device's branches read it (padding rows are greedy)."""
    def of(*params: SamplingParams, ex: SamplerExtras | None = None, counts: np.ndarray | None = None) -> Stages:
        return Stages.of(SamplingBatch.build(list(params), [0] * len(params), 4, [0] * len(params)), V, ex, counts)

    assert of(SamplingParams(), SamplingParams(top_p=0.5, top_k=3)) == GREEDY  # filters of greedy rows: nothing
    assert of(SamplingParams(temperature=0.7, min_p=0.1)) == PLAIN
    assert of(SamplingParams(temperature=1.0, top_k=FAST_TOP_K, top_p=0.5)) == Stages(stochastic=True, bounded=True)
    assert of(SamplingParams(temperature=1.0, top_k=FAST_TOP_K + 1)) == Stages(stochastic=True, wide_k=True)
    assert of(SamplingParams(temperature=1.0, top_p=0.9), SamplingParams()) == Stages(stochastic=True, top_p=True)
    small = Stages.of(SamplingBatch.build([SamplingParams(temperature=1.0, top_k=50)], [0], 1, [0]), 40)
    assert small == Stages(stochastic=True, wide_k=True)  # a top-k above a 40-token vocabulary's head
    ex = SamplerExtras.neutral(4, V)
    assert of(SamplingParams(), ex=ex, counts=np.zeros((4, V), np.int32)) == GREEDY  # neutral extras: nothing
    ex.logprobs[2] = True
    assert of(SamplingParams(), ex=ex) == Stages(logprobs=True)
    ex.presence[1] = 0.5
    assert of(SamplingParams(), ex=ex) == Stages(logprobs=True)  # a penalty without counts is not applied
    assert of(SamplingParams(), ex=ex, counts=np.zeros((4, V), np.int32)) == Stages(process=True, logprobs=True)
    ex = SamplerExtras.neutral(4, V)
    ex.mask[0, 0] = 5
    assert of(SamplingParams(), ex=ex).process


@pytest.mark.parametrize("sort", ["1", "0"])
def test_samplers_with_host_named_parts_sample_as_device_branches(sort: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the host names a batch's parts (`Stages`, accelerators) the samplers trace no branch on the
    device, and give every output the branching samplers give: random batches of greedy and drawing rows
    (top-k small and large, top-p, min-p), logit_bias, masks, penalties and logprobs, by sort and by
    bisection. Naming fewer parts than the batch needs changes the tokens (the names are obeyed)."""
    monkeypatch.setenv("PARROT_CPU_SAMPLER", "0")  # XLA's code: the one with branches
    monkeypatch.setenv("PARROT_SAMPLER_SORT", sort)
    rng = np.random.default_rng(int(sort) + 40)
    branching = jax.jit(lambda *a: sample_processed(*a))
    named = jax.jit(sample_processed, static_argnames=("stages",))
    plain_named = jax.jit(sample, static_argnames=("stages",))
    plain = jax.jit(lambda logits, sb: sample(logits, sb))
    vocab, seen = 700, set()
    batch = 4  # one shape: each combination of parts compiles once
    for trial in range(16):
        logits = (rng.standard_normal((batch, vocab)) * 2.0).astype(np.float32)
        params = []
        for _ in range(batch):
            kind = 0 if trial == 0 else 1 if trial == 1 else rng.integers(5)  # all greedy, all plain, mixed
            params.append(SamplingParams(
                temperature=0.0 if kind == 0 else float(rng.uniform(0.5, 1.5)),
                top_k=int(rng.choice([0, 5, FAST_TOP_K, 300])) if kind in (2, 4) else 0,
                top_p=float(rng.uniform(0.5, 0.95)) if kind in (3, 4) else 1.0,
                min_p=0.05 if kind == 1 else 0.0, seed=trial))
        sb = SamplingBatch.build(params, [trial] * batch, batch, [0] * batch)
        ex = SamplerExtras.neutral(batch, vocab)
        counts = None
        if trial % 3 == 1:
            ex.bias_ids[0, :2], ex.bias[0, :2] = [7, 8], [3.0, -50.0]
            ex.logprobs[-1] = True
        if trial % 3 == 2:
            ex.mask[0, 1:] = 0  # row 0 may only take the first 32 tokens
            counts = np.zeros((batch, vocab), np.int32)
            counts[-1, :40] = 3
            ex.repetition[-1], ex.frequency[-1] = 1.3, 0.2
        stages = Stages.of(sb, vocab, ex, counts)
        seen.add(stages)
        want = branching(logits, sb, ex, counts)
        got = named(logits, sb, ex, counts, stages=stages)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        plain_stages = Stages.of(sb, vocab)
        np.testing.assert_array_equal(np.asarray(plain_named(logits, sb, stages=plain_stages)),
                                      np.asarray(plain(logits, sb)))
    assert len(seen) >= 6  # many combinations met
    assert GREEDY in seen or any(not s.stochastic for s in seen)
    # a drawing batch named greedy takes the argmax: the names decide what is traced
    logits = (rng.standard_normal((2, vocab)) * 0.1).astype(np.float32)
    sb = SamplingBatch.build([SamplingParams(temperature=1.5, seed=s) for s in (1, 2)], [0, 0], 2, [0, 0])
    ex = SamplerExtras.neutral(2, vocab)
    assert np.array_equal(np.asarray(named(logits, sb, ex, stages=GREEDY)[0]), np.asarray(argmax(logits)))
    assert not np.array_equal(np.asarray(named(logits, sb, ex, stages=PLAIN)[0]), np.asarray(argmax(logits)))


def test_named_parts_trace_no_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the parts named, the compiled samplers hold no conditional (a GPU's conditional copies its
    predicate to the host and waits): the branching ones hold several."""
    monkeypatch.setenv("PARROT_CPU_SAMPLER", "0")
    monkeypatch.setenv("PARROT_SAMPLER_SORT", "1")
    logits = np.zeros((4, V), np.float32)
    sb = SamplingBatch.build([SamplingParams(temperature=1.0, top_p=0.9, seed=1)] * 4, [0] * 4, 4, [0] * 4)
    ex, counts = SamplerExtras.neutral(4, V), np.zeros((4, V), np.int32)

    def conditionals(stages: Stages | None) -> int:
        jaxpr = jax.make_jaxpr(lambda *a: sample_processed(*a, stages=stages))(logits, sb, ex, counts)
        return str(jaxpr).count(" cond[")

    assert conditionals(None) >= 4
    assert conditionals(Stages(True, True, True, True, True, True)) == 0
    assert conditionals(Stages.of(sb, V, ex, counts)) == 0


# ---- through the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)  # the shapes its tests meet
    yield eng
    eng.shutdown()


def _generate(eng: LLMEngine, ctx: str, prompt: list[int], **sampling):
    eng.fill_future(FillRequest(context_id=ctx, token_ids=prompt)).result(TIMEOUT)
    try:
        return eng.generate_future(GenerateRequest(context_id=ctx, sampling=SamplingParams(**sampling))).result(TIMEOUT)
    finally:
        eng.free_future(ctx).result(TIMEOUT)


def test_min_tokens_holds_back_the_end(engine: LLMEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    prompt = list(b"Hello")
    r = _generate(engine, "eos", prompt, max_tokens=20, logit_bias={eos: 100.0})
    assert r.token_ids == [] and r.finish_reason == "stop"
    r = _generate(engine, "min", prompt, max_tokens=20, logit_bias={eos: 100.0}, min_tokens=6)
    assert len(r.token_ids) == 6 and eos not in r.token_ids and r.finish_reason == "stop"


def test_logprobs_align_with_the_tokens(engine: LLMEngine) -> None:
    prompt = list(b"Logprobs ")
    chunks = []
    engine.fill_future(FillRequest(context_id="lp", token_ids=prompt)).result(TIMEOUT)
    req = GenerateRequest(context_id="lp", sampling=SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True))
    r = engine.generate_future(req, on_chunk=chunks.append).result(TIMEOUT)
    engine.free_future("lp").result(TIMEOUT)
    assert r.logprobs is not None and [lp.token_id for lp in r.logprobs] == r.token_ids
    for lp in r.logprobs:
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy: the most likely one
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob and lp.logprob <= 0
        assert lp.bytes == list(engine.token_texts.piece(lp.token_id)[1])
    assert [c.logprob for c in chunks if c.token_id is not None] == r.logprobs
    plain = _generate(engine, "plain", prompt, max_tokens=6, ignore_eos=True)
    assert plain.token_ids == r.token_ids and plain.logprobs is None


def test_sampling_values_the_model_bounds(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.generate_future(GenerateRequest(context_id="x", sampling=SamplingParams(logit_bias={100000: 1.0})))


def test_greedy_output_is_the_same_beside_constrained_and_penalized_requests(smollm_engine: LLMEngine) -> None:
    """The default model: an unconstrained greedy request alone, then in batches with a JSON-schema
    request, a penalized sampled one and one asking for logprobs: identical tokens."""
    eng = smollm_engine
    tok = eng.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    plain = dict(max_tokens=24)
    alone = _generate(eng, "inv-alone", chat("Name three colors."), **plain).token_ids
    schema = {"type": "object", "properties": {"color": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["color", "count"], "additionalProperties": False}
    others = [dict(max_tokens=24, json_schema=schema), dict(max_tokens=24, temperature=0.9, seed=2,
                                                            repetition_penalty=1.3, frequency_penalty=0.5,
                                                            logit_bias={tok.encode(" red")[0]: 3.0}, min_p=0.05),
              dict(max_tokens=24, logprobs=5, min_tokens=4)]

    def run(i: int):
        if i == 0:
            return _generate(eng, "inv-0", chat("Name three colors."), **plain)
        return _generate(eng, f"inv-{i}", chat("Describe a color as JSON."), **others[i - 1])

    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(run, range(4)))
    assert results[0].token_ids == alone
    assert results[3].logprobs is not None and len(results[3].logprobs) == len(results[3].token_ids)
