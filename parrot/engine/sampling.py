"""Sampling parameters and the jitted samplers.

Three compiled variants per batch size: `greedy_sample` (argmax), `sample` (temperature, top-k, top-p,
per-request seed) and `sample_processed`, which first processes the logits (repetition, frequency and
presence penalties, logit_bias, the allowed-token bitmask of constraints and min_tokens) and also
samples with min-p and returns log probabilities. A batch takes the cheapest variant that serves all its
sequences (`SamplerExtras.build` says whether it needs the processed one); in a processed batch a
sequence that asked for nothing gets neutral values (no penalty, zero bias, an all-ones mask), so its
tokens are the same as in a plain batch.

Log probabilities are the model's raw distribution: log_softmax of the logits before temperature,
penalties, logit_bias and masks (vLLM's "raw_logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from parrot.engine.sequence import Job
from parrot.engine.structured import fill_masks, mask_words
from parrot.errors import InvalidRequestError
from parrot.protocol import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

__all__ = ["SamplerExtras", "SamplingBatch", "SamplingParams", "check_sampling", "greedy_sample", "sample",
           "sample_processed"]


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """What the schema cannot check: bounds that depend on the model."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
    if any(not s for s in params.stop):
        raise InvalidRequestError("stop strings must not be empty")
    bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")


def needs_processing(job: Job, lazy: bool = False) -> bool:
    """True when the job's next token needs `sample_processed`: a constraint, logprobs, logit_bias,
    penalties, or stop tokens still suppressed by min_tokens. (Temperature, top-k, top-p and min-p run in
    the plain sampler, on the device: an OpenAI request with llama.cpp's default min-p 0.05 keeps the
    fast path and the engine's overlap.) With `lazy`, a `lazily_constrained` job does not: its grammar is
    checked on the host after sampling."""
    p = job.sampling
    assert p is not None
    constrained = job.constraint is not None and not (lazy and lazily_constrained(job))
    return (constrained or p.logprobs is not None or bool(p.logit_bias) or p.penalized
            or (len(job.output_ids) < p.min_tokens and bool(job.stop_ids)))


def lazily_constrained(job: Job) -> bool:
    """A greedy constrained job whose logits nothing else changes (no logprobs, logit_bias, penalties or
    suppressed stop tokens): its token can be the unmasked argmax, checked against its grammar afterwards
    (`structured.check_greedy`), which is the masked argmax whenever the grammar accepts it."""
    p = job.sampling
    assert p is not None
    return (job.constraint is not None and p.greedy and p.logprobs is None and not p.logit_bias and not p.penalized
            and not (len(job.output_ids) < p.min_tokens and bool(job.stop_ids)))


@jax.tree_util.register_dataclass
@dataclass
class SamplingBatch:
    temperature: jax.Array  # [B] float32 (0: greedy)
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32 (0: off)
    seeds: jax.Array  # [B] uint32
    steps: jax.Array  # [B] int32 tokens generated so far (folded into the key)
    min_p: jax.Array  # [B] float32 (0: off)

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], batch_size: int,
              default_seeds: list[int]) -> SamplingBatch:
        n = len(params)
        temp = np.zeros(batch_size, np.float32)
        top_p = np.ones(batch_size, np.float32)
        top_k = np.zeros(batch_size, np.int32)
        seeds = np.zeros(batch_size, np.uint32)
        st = np.zeros(batch_size, np.int32)
        temp[:n] = [p.temperature for p in params]
        top_p[:n] = [p.top_p for p in params]
        top_k[:n] = [p.top_k for p in params]
        seeds[:n] = [p.seed if p.seed is not None else d for p, d in zip(params, default_seeds, strict=True)]
        st[:n] = steps
        min_p = np.zeros(batch_size, np.float32)
        min_p[:n] = [p.min_p for p in params]
        return cls(temp, top_p, top_k, seeds, st, min_p)


@jax.tree_util.register_dataclass
@dataclass
class SamplerExtras:
    """The inputs of `sample_processed` besides the SamplingBatch (host arrays, padded to the batch)."""

    mask: jax.Array  # [B, ceil(V / 32)] int32 allowed-token bits (-1: all allowed)
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32 (padding: token 0 with bias 0)
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] float32
    presence: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    repetition: jax.Array  # [B] float32 (1: off)
    min_p: jax.Array  # [B] float32 (0: off)
    logprobs: jax.Array  # [B] bool: the row wants logprobs (none does: they are not computed)

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int) -> SamplerExtras:
        return cls(np.full((batch_size, mask_words(vocab_size)), -1, np.int32),
                   np.zeros((batch_size, MAX_LOGIT_BIAS), np.int32), np.zeros((batch_size, MAX_LOGIT_BIAS), np.float32),
                   np.zeros(batch_size, np.float32), np.zeros(batch_size, np.float32),
                   np.ones(batch_size, np.float32), np.zeros(batch_size, np.float32), np.zeros(batch_size, bool))

    @classmethod
    def build(cls, jobs: list[Job | None], batch_size: int, vocab_size: int,
              lazy: bool = False) -> tuple[SamplerExtras, np.ndarray | None] | None:
        """For the jobs sampling in a batch (None: a row that does not sample): the extras and, when some
        job has a penalty, the token counts `[B, V]` int32 (2 x times generated + 1 if in the context), or
        None when no job needs `sample_processed`. Constraint masks are computed here, on the host; with
        `lazy`, not for `lazily_constrained` jobs (their rows stay all-allowed)."""
        live = [(i, j) for i, j in enumerate(jobs) if j is not None and needs_processing(j, lazy)]
        if not live:
            return None
        ex = cls.neutral(batch_size, vocab_size)
        fill_masks([(j.constraint, i) for i, j in live if j.constraint is not None
                    and not (lazy and lazily_constrained(j))], ex.mask)
        counts = None
        for i, job in live:
            p = job.sampling
            assert p is not None
            if len(job.output_ids) < p.min_tokens and job.stop_ids:
                _clear_bits(ex.mask[i], job.stop_ids, keep_one=job.constraint is not None)
            if p.logit_bias:
                ex.bias_ids[i, : len(p.logit_bias)] = list(p.logit_bias)
                ex.bias[i, : len(p.logit_bias)] = list(p.logit_bias.values())
            ex.min_p[i] = p.min_p
            ex.logprobs[i] = p.logprobs is not None
            if p.penalized:
                ex.presence[i], ex.frequency[i], ex.repetition[i] = (p.presence_penalty, p.frequency_penalty,
                                                                     p.repetition_penalty)
                if counts is None:
                    counts = np.zeros((batch_size, vocab_size), np.int32)
                counts[i] = 2 * np.bincount(job.output_ids, minlength=vocab_size)[:vocab_size]
                counts[i] += np.bincount(job.context_tokens, minlength=vocab_size)[:vocab_size] > 0
        return ex, counts


def _clear_bits(row: np.ndarray, tokens: frozenset[int], keep_one: bool) -> None:
    """Disallow `tokens` in one packed mask row; with keep_one, not when nothing else would be allowed (a
    grammar that can only end ends: min_tokens does not outrank it)."""
    before = row.copy() if keep_one else None
    for t in tokens:
        row[t >> 5] &= np.int32(~(1 << (t & 31)) if (t & 31) != 31 else 0x7FFFFFFF)
    if before is not None and not row.any():
        row[:] = before


ARGMAX_SPAN = 512  # the vocabulary's spans in `argmax`


def argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis ([B, V] -> [B] int32, the first of equal maxima; a row with NaNs gets
    some position in range, as a vectorized maximum does not reliably carry NaN), in two levels: each
    span's maximum (a plain vectorized reduction), the first span holding the largest, then the first
    position of it in that span. XLA's CPU backend compiles a one-level argmax into a scalar loop over
    (value, index) pairs: 4.6 ms for 64 rows of a 49,152-token vocabulary against 0.5 ms this way."""
    batch, vocab = logits.shape
    c = min(ARGMAX_SPAN, vocab)
    spans = -(-vocab // c)
    if spans * c != vocab:  # pad with -inf, which is never the first maximum unless everything is -inf
        logits = jnp.pad(logits, ((0, 0), (0, spans * c - vocab)), constant_values=-jnp.inf)
    r = logits.reshape(batch, spans, c)
    span = jnp.argmax(jnp.max(r, axis=-1), axis=-1)
    row = jnp.take_along_axis(r, span[:, None, None], axis=1)[:, 0]
    return (span * c + jnp.argmax(row, axis=-1)).astype(jnp.int32)


def greedy_sample(logits: jax.Array) -> jax.Array:
    return argmax(logits)


def sample(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """logits [B, V] -> token ids [B]. Rows with temperature 0 take the argmax."""
    return _choose(logits, sb, sb.min_p)


def sample_processed(logits: jax.Array, sb: SamplingBatch, ex: SamplerExtras,
                     counts: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [B, V] -> (token ids [B], their raw logprobs [B], the MAX_LOGPROBS most likely tokens [B, K]
    and their raw logprobs [B, K]). The logits get the penalties (with `counts`, see `SamplerExtras.build`),
    logit_bias and the mask before greedy or stochastic sampling with min-p."""
    batch, vocab = logits.shape
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    x = logits
    if counts is not None:
        generated = counts >> 1
        r = ex.repetition[:, None]
        x = jnp.where(counts > 0, jnp.where(x > 0, x / r, x * r), x)
        x = x - ex.frequency[:, None] * generated - ex.presence[:, None] * (generated > 0)
    x = x.at[jnp.arange(batch)[:, None], ex.bias_ids].add(ex.bias)
    bits = (ex.mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(batch, -1)[:, :vocab] != 0
    x = jnp.where(allowed, x, -jnp.inf)
    # only the work some row needs: the sort of stochastic sampling, the top tokens of logprobs
    tokens = jax.lax.cond(jnp.any(sb.temperature > 0), lambda v: _choose(v, sb, ex.min_p), greedy_sample, x)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]

    def top(r: jax.Array) -> tuple[jax.Array, jax.Array]:
        lp, ids = jax.lax.top_k(r, MAX_LOGPROBS)
        return lp, ids.astype(jnp.int32)

    def none(r: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((batch, MAX_LOGPROBS), r.dtype), jnp.zeros((batch, MAX_LOGPROBS), jnp.int32)

    top_lp, top_ids = jax.lax.cond(jnp.any(ex.logprobs), top, none, raw)
    return tokens, chosen, top_ids, top_lp


FAST_TOP_K = 64  # a batch whose sampled rows all keep at most this many tokens skips the full sort


def _choose(logits: jax.Array, sb: SamplingBatch, min_p: jax.Array | None) -> jax.Array:
    """Greedy rows take the argmax; sampled rows draw from the tokens that survive top-k, top-p and min-p.
    The cut-off needs the largest logits in order: a full sort of the vocabulary (slow on CPUs) only when
    some sampled row filters without a top-k of at most FAST_TOP_K; none when no sampled row filters. A
    row's cut-off is the same whichever way its batch took."""
    batch, vocab = logits.shape
    head = min(FAST_TOP_K, vocab)
    greedy = argmax(logits)
    scaled = logits / jnp.maximum(sb.temperature, 1e-5)[:, None]
    top = jnp.max(scaled, axis=-1, keepdims=True)
    norm = jnp.sum(jnp.exp(scaled - top), axis=-1, keepdims=True)
    min_p = jnp.zeros(batch, jnp.float32) if min_p is None else min_p
    stochastic = sb.temperature > 0
    unfiltered = (sb.top_k == 0) & (sb.top_p >= 1.0) & (min_p <= 0.0)
    bounded = (sb.top_k > 0) & (sb.top_k <= head)
    off = jnp.full((batch, 1), -jnp.inf, scaled.dtype)

    def cut(desc: jax.Array) -> jax.Array:
        """[B, n] the n largest scaled logits, descending -> each row's threshold [B, 1]."""
        n = desc.shape[-1]
        k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, n), n)  # top-k: keep logits >= the k-th largest
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
        probs = jnp.exp(desc - top) / norm  # top-p: the smallest prefix whose mass reaches top_p
        cum = jnp.cumsum(probs, axis=-1)
        n_keep = jnp.sum((cum - probs) < sb.top_p[:, None], axis=-1)
        pth = jnp.take_along_axis(desc, (jnp.maximum(n_keep, 1) - 1)[:, None], axis=-1)
        # min-p: keep p >= min_p * p_max, i.e. scaled >= max + log(min_p) (log 0 = -inf: off)
        return jnp.maximum(jnp.maximum(kth, pth), top + jnp.log(min_p)[:, None])

    def none(s: jax.Array) -> jax.Array:
        return off

    def fast(s: jax.Array) -> jax.Array:
        return jnp.where(unfiltered[:, None], off, cut(jax.lax.top_k(s, head)[0]))

    def full(s: jax.Array) -> jax.Array:
        desc = jnp.sort(s, axis=-1)[:, ::-1]
        return jnp.where(unfiltered[:, None], off, jnp.where(bounded[:, None], cut(desc[:, :head]), cut(desc)))

    calm = ~stochastic | unfiltered
    branch = jnp.where(jnp.all(calm), 0, jnp.where(jnp.all(calm | bounded), 1, 2))
    threshold = jax.lax.switch(branch, [none, fast, full], scaled)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)

    def draw(seed: jax.Array, step: jax.Array, row: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row)

    sampled = jax.vmap(draw)(sb.seeds, sb.steps, masked).astype(jnp.int32)
    return jnp.where(stochastic, sampled, greedy)


processed_sampler = jax.jit(sample_processed)  # `counts` None or not: two executables per batch size
