"""Sampling parameters and the jitted samplers.

Two compiled samplers per batch size: `greedy_sample` (argmax) and `sample_processed`, which processes
the logits where some row asks (repetition, frequency and presence penalties, logit_bias, the
allowed-token bitmask of constraints and min_tokens), samples (temperature, top-k, top-p, min-p,
per-request seed) and returns log probabilities where some row asks. A batch in which every row is
greedy takes the argmax; any other batch the processed sampler, with neutral values (no penalty, zero
bias, an all-ones mask) where nothing was asked, so a row's tokens are the same in either kind of batch.
`sample` (the same draws without processing) runs inside multi-step decode loops. On a CPU with the
native kernels the cut-offs and draws (`kernels.sample`) and the log probabilities (`kernels.logprobs`) are
FFI calls that take a row at a time while it is in the cache; elsewhere (or with `PARROT_CPU_SAMPLER=0`)
XLA's code below computes the same tokens.

Each part of a sampler runs only where some row of its batch needs it. By default the compiled sampler
decides that on the device (`lax.cond`), so one executable serves every batch; on a GPU such a branch copies
its predicate to the host and waits for the device (XLA's conditional thunk), draining the queue of steps
the engine dispatched ahead. There the host, which built the batch, names the parts instead (`Stages`, a
static argument): no branch is left on the device, at the cost of an executable per combination used.

Log probabilities are the model's raw distribution: log_softmax of the logits before temperature,
penalties, logit_bias and masks (vLLM's "raw_logprobs").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from parrot.engine import kernels
from parrot.engine.sequence import Job
from parrot.engine.structured import fill_masks, mask_words
from parrot.errors import InvalidRequestError
from parrot.protocol import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

__all__ = ["SamplerExtras", "SamplingBatch", "SamplingParams", "Stages", "check_sampling", "greedy_sample",
           "sample", "sample_processed"]


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
    seeds: jax.Array  # [B, 2] uint32: each row's 64-bit seed as (high, low) words, a threefry key's data
    steps: jax.Array  # [B] int32 tokens generated so far (folded into the key)
    min_p: jax.Array  # [B] float32 (0: off)

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], batch_size: int,
              default_seeds: list[int]) -> SamplingBatch:
        n = len(params)
        temp = np.zeros(batch_size, np.float32)
        top_p = np.ones(batch_size, np.float32)
        top_k = np.zeros(batch_size, np.int32)
        seeds = np.zeros((batch_size, 2), np.uint32)
        st = np.zeros(batch_size, np.int32)
        temp[:n] = [p.temperature for p in params]
        top_p[:n] = [p.top_p for p in params]
        top_k[:n] = [p.top_k for p in params]
        whole = [p.seed if p.seed is not None else d for p, d in zip(params, default_seeds, strict=True)]
        if n:  # a seed below 2**32 keys as jax.random.key(seed) does
            seeds[:n] = [(s >> 32, s & 0xFFFFFFFF) for s in whole]
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
    logprobs: jax.Array  # [B] bool: the row wants logprobs (none does: they are not computed)

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int) -> SamplerExtras:
        return cls(np.full((batch_size, mask_words(vocab_size)), -1, np.int32),
                   np.zeros((batch_size, MAX_LOGIT_BIAS), np.int32), np.zeros((batch_size, MAX_LOGIT_BIAS), np.float32),
                   np.zeros(batch_size, np.float32), np.zeros(batch_size, np.float32),
                   np.ones(batch_size, np.float32), np.zeros(batch_size, bool))

    @classmethod
    def build(cls, jobs: list[Job | None], batch_size: int, vocab_size: int, lazy: bool = False,
              before: Sequence[Sequence[int]] | None = None) -> tuple[SamplerExtras, np.ndarray | None] | None:
        """For the jobs sampling in a batch (None: a row that does not sample): the extras and, when some
        job has a penalty, the token counts `[B, V]` int32 (2 x times generated + 1 if in the context), or
        None when no job needs `sample_processed`. Constraint masks are computed here, on the host; with
        `lazy`, not for `lazily_constrained` jobs (their rows stay all-allowed). `before[i]`: tokens row i
        samples after beyond its job's output (a speculative verify row: the draft's tokens before it), which
        count for its penalties and min_tokens as output does, and which its grammar's mask comes after."""
        live = [(i, j) for i, j in enumerate(jobs) if j is not None and needs_processing(j, lazy)]
        if not live:
            return None
        ex = cls.neutral(batch_size, vocab_size)
        fill_masks([(j.constraint.after(before[i] if before is not None else ()), i) for i, j in live
                    if j.constraint is not None and not (lazy and lazily_constrained(j))], ex.mask)
        counts = None
        for i, job in live:
            p = job.sampling
            assert p is not None
            pre = list(before[i]) if before is not None else []
            if len(job.output_ids) + len(pre) < p.min_tokens and job.stop_ids:
                _clear_bits(ex.mask[i], job.stop_ids, keep_one=job.constraint is not None)
            if p.logit_bias:
                ex.bias_ids[i, : len(p.logit_bias)] = list(p.logit_bias)
                ex.bias[i, : len(p.logit_bias)] = list(p.logit_bias.values())
            ex.logprobs[i] = p.logprobs is not None
            if p.penalized:
                ex.presence[i], ex.frequency[i], ex.repetition[i] = (p.presence_penalty, p.frequency_penalty,
                                                                     p.repetition_penalty)
                if counts is None:
                    counts = np.zeros((batch_size, vocab_size), np.int32)
                counts[i] = 2 * np.bincount(job.output_ids + pre, minlength=vocab_size)[:vocab_size]
                counts[i] += np.bincount(job.context_tokens + pre, minlength=vocab_size)[:vocab_size] > 0
        return ex, counts


@dataclass(frozen=True)
class Stages:
    """The parts of sampling some row of a batch needs, as the host knows them from the batch it built (a
    static argument of the samplers: see the module's docstring). The defaults: the argmax alone."""

    process: bool = False  # penalties, logit_bias or a mask change the logits
    stochastic: bool = False  # some row draws (temperature > 0)
    bounded: bool = False  # some drawing row has a top-k of at most FAST_TOP_K
    wide_k: bool = False  # some drawing row has a larger top-k (filtering over the whole vocabulary)
    top_p: bool = False  # some drawing row without a bounded top-k has a top-p (over the whole vocabulary)
    logprobs: bool = False  # some row asks for log probabilities

    @classmethod
    def of(cls, sb: SamplingBatch, vocab_size: int, ex: SamplerExtras | None = None,
           counts: np.ndarray | None = None) -> Stages:
        """The parts a host batch needs: the same tests the device-side branches make (`_choose`,
        `sample_processed`), on the host's arrays. `counts`: the token counts passed, if any."""
        temp, top_k, top_p = (np.asarray(a) for a in (sb.temperature, sb.top_k, sb.top_p))
        stochastic = temp > 0
        head = min(FAST_TOP_K, vocab_size)
        bounded = stochastic & (top_k > 0) & (top_k <= head)
        wide_k = stochastic & (top_k > head)
        by_p = stochastic & ~bounded & (top_p < 1.0)
        process = logprobs = False
        if ex is not None:
            process = bool(np.any(np.asarray(ex.bias) != 0.0) or np.any(np.asarray(ex.mask) != -1))
            if counts is not None:
                process |= bool(np.any((np.asarray(ex.repetition) != 1.0) | (np.asarray(ex.frequency) != 0.0)
                                       | (np.asarray(ex.presence) != 0.0)))
            logprobs = bool(np.any(np.asarray(ex.logprobs)))
        return cls(process, bool(stochastic.any()), bool(bounded.any()), bool(wide_k.any()), bool(by_p.any()),
                   logprobs)


GREEDY = Stages()  # the argmax alone
PLAIN = Stages(stochastic=True)  # temperature (and min-p) draws: an OpenAI request's defaults
# the draws most requests make, whose one-step samplers precompile compiles where the host names the parts:
# temperature alone, with top-p (OpenAI's other knob), with a small top-k (llama.cpp's defaults: 40 and 0.95)
COMMON_DRAWS = (PLAIN, Stages(stochastic=True, top_p=True), Stages(stochastic=True, bounded=True))


def _said(stages: Stages | None, part: str) -> bool | None:
    """Whether the host said a batch needs a part of sampling (None: it left that to the device)."""
    return None if stages is None else getattr(stages, part)


def _branch(known: bool | None, pred: jax.Array, yes: Callable, no: Callable, *args: jax.Array) -> object:
    """`lax.cond(pred, yes, no, *args)` where the host did not say which branch runs (`known` None); else the
    branch it named, traced alone."""
    if known is None:
        return jax.lax.cond(pred, yes, no, *args)
    return (yes if known else no)(*args)


def _clear_bits(row: np.ndarray, tokens: frozenset[int], keep_one: bool) -> None:
    """Disallow `tokens` in one packed mask row; with keep_one, not when nothing else would be allowed (a
    grammar that can only end ends: min_tokens does not outrank it)."""
    before = row.copy() if keep_one else None
    for t in tokens:
        row[t >> 5] &= np.int32(~(1 << (t & 31)) if (t & 31) != 31 else 0x7FFFFFFF)
    if before is not None and not row.any():
        row[:] = before


ARGMAX_SPAN = 512  # the vocabulary's spans in `argmax`


def _spans(x: jax.Array, c: int, fill: float) -> jax.Array:
    """[B, V] -> [B, ceil(V / c), c]: the rows in spans of c values, the last one padded with `fill`."""
    batch, vocab = x.shape
    spans = -(-vocab // c)
    if spans * c != vocab:
        x = jnp.pad(x, ((0, 0), (0, spans * c - vocab)), constant_values=fill)
    return x.reshape(batch, spans, c)


def argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis ([B, V] -> [B] int32, the first of equal maxima; a row with NaNs gets
    some position in range, as a vectorized maximum does not reliably carry NaN), in two levels: each
    span's maximum (a plain vectorized reduction), the first span holding the largest, then the first
    position of it in that span. XLA's CPU backend compiles a one-level argmax into a scalar loop over
    (value, index) pairs: 4.6 ms for 64 rows of a 49,152-token vocabulary against 0.5 ms this way."""
    c = min(ARGMAX_SPAN, logits.shape[1])
    r = _spans(logits, c, -jnp.inf)  # -inf is never the first maximum unless everything is -inf
    span = jnp.argmax(jnp.max(r, axis=-1), axis=-1)
    row = jnp.take_along_axis(r, span[:, None, None], axis=1)[:, 0]
    return (span * c + jnp.argmax(row, axis=-1)).astype(jnp.int32)


def greedy_sample(logits: jax.Array) -> jax.Array:
    return argmax(logits)


def sample(logits: jax.Array, sb: SamplingBatch, stages: Stages | None = None) -> jax.Array:
    """logits [B, V] -> token ids [B]. Rows with temperature 0 take the argmax. `stages`: the parts the host
    says the batch needs (None: each decided on the device)."""
    return _choose(logits, sb, stages)


def sample_processed(logits: jax.Array, sb: SamplingBatch, ex: SamplerExtras,
                     counts: jax.Array | None = None,
                     stages: Stages | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [B, V] -> (token ids [B], their raw logprobs [B], the MAX_LOGPROBS most likely tokens [B, K]
    and their raw logprobs [B, K]). The logits get the penalties (with `counts`, see `SamplerExtras.build`),
    logit_bias and the mask before greedy or stochastic sampling (temperature, top-k, top-p and min-p from
    `sb`). Each stage runs only where some row of the batch needs it (the logprobs are zeros where no row
    asks for them), so neutral extras and zero counts sample as `sample` does, and one executable per
    batch size serves every sampled step; with `stages`, one per batch size and combination the host names
    (`Stages.of` this batch: the same tokens)."""
    batch, vocab = logits.shape
    logits = logits.astype(jnp.float32)

    def process(x: jax.Array) -> jax.Array:  # neutral values change nothing
        if counts is not None:
            generated = counts >> 1
            r = ex.repetition[:, None]
            x = jnp.where(counts > 0, jnp.where(x > 0, x / r, x * r), x)
            x = x - ex.frequency[:, None] * generated - ex.presence[:, None] * (generated > 0)
        x = x.at[jnp.arange(batch)[:, None], ex.bias_ids].add(ex.bias)
        bits = (ex.mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
        allowed = bits.reshape(batch, -1)[:, :vocab] != 0
        return jnp.where(allowed, x, -jnp.inf)

    needed = jnp.any(ex.bias != 0.0) | jnp.any(ex.mask != -1)
    if counts is not None:
        needed |= jnp.any((ex.repetition != 1.0) | (ex.frequency != 0.0) | (ex.presence != 0.0))

    def choose(v: jax.Array) -> jax.Array:  # only the work some row needs (the native sampler takes both kinds)
        if native_sampler():
            return _choose(v, sb)
        return _branch(_said(stages, "stochastic"), jnp.any(sb.temperature > 0), lambda v: _choose(v, sb, stages),
                       greedy_sample, v)

    # each branch samples, so that the logits are not copied out of a branch that leaves them as they are
    tokens = _branch(_said(stages, "process"), needed, lambda v: choose(process(v)), choose, logits)

    if native_sampler():  # rows that do not ask are skipped (zeros)
        chosen, top_ids, top_lp = kernels.logprobs(logits, tokens, ex.logprobs, MAX_LOGPROBS)
        return tokens, chosen, top_ids, top_lp

    def report(v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        raw = jax.nn.log_softmax(v, axis=-1)
        chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
        lp, ids = jax.lax.top_k(raw, MAX_LOGPROBS)
        return chosen, lp, ids.astype(jnp.int32)

    def none(v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros(batch, v.dtype), jnp.zeros((batch, MAX_LOGPROBS), v.dtype),
                jnp.zeros((batch, MAX_LOGPROBS), jnp.int32))

    chosen, top_lp, top_ids = _branch(_said(stages, "logprobs"), jnp.any(ex.logprobs), report, none, logits)
    return tokens, chosen, top_ids, top_lp


FAST_TOP_K = 64  # rows keeping at most this many tokens take their cut-off from the top FAST_TOP_K logits
DRAW_SPAN = 512  # the vocabulary's spans in `_draw`


def _choose(logits: jax.Array, sb: SamplingBatch, stages: Stages | None = None) -> jax.Array:
    """Greedy rows take the argmax; sampled rows draw from the tokens that survive top-k, top-p and min-p.
    A row with a top-k of at most FAST_TOP_K takes its cut-off from the top FAST_TOP_K logits; other
    filtering rows find theirs over the whole vocabulary by bisection on a CPU (`_select`: a sort of 49,152
    logits took ~9 ms a row there), in the sorted row on accelerators (`whole_vocabulary_by_sort`); min-p
    alone needs neither. Each part runs only when some row needs it, and a row's cut-off and draw are the
    same whichever parts its batch ran. One uniform number per row picks the token (`_draw`)."""
    def uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.wrap_key_data(seed, impl="threefry2x32")  # (high, low): all 64 bits of the seed
        return jax.random.uniform(jax.random.fold_in(key, step), ())

    u = jax.vmap(uniform)(sb.seeds, sb.steps)
    if native_sampler():  # the same definitions, a row at a time in the cache (kernels/sampler.h)
        return kernels.sample(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p, u)
    batch, vocab = logits.shape
    head = min(FAST_TOP_K, vocab)
    greedy = argmax(logits)
    scaled = logits / jnp.maximum(sb.temperature, 1e-5)[:, None]
    top = jnp.max(scaled, axis=-1, keepdims=True)
    e = jnp.exp(scaled - top)
    stochastic = sb.temperature > 0
    bounded = stochastic & (sb.top_k > 0) & (sb.top_k <= head)
    by_k = stochastic & (sb.top_k > head)  # top-k over the whole vocabulary
    by_p = stochastic & ~bounded & (sb.top_p < 1.0)  # top-p over the whole vocabulary
    off = jnp.full((batch, 1), -jnp.inf, scaled.dtype)
    # min-p: keep p >= min_p * p_max, i.e. scaled >= max + log(min_p) (log 0 = -inf: off)
    min_p_cut = top + jnp.log(sb.min_p)[:, None]

    def cut(desc: jax.Array, parts: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
        """[B, n] the n largest scaled logits, descending -> each row's top-k and top-p threshold [B, 1]
        (with `parts`, the two apart). Top-p takes the smallest prefix whose probability, renormalized over
        the tokens top-k and min-p keep (as vLLM, Hugging Face and llama.cpp renormalize), reaches top_p."""
        n = desc.shape[-1]
        k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, n), n)  # top-k: keep logits >= the k-th largest
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
        kept = desc >= jnp.maximum(kth, min_p_cut)
        probs = jnp.where(kept, jnp.exp(desc - top), 0.0)
        cum = jnp.cumsum(probs, axis=-1)
        mass = sb.top_p[:, None] * cum[:, -1:]
        n_keep = jnp.sum(kept & ((cum - probs) < mass), axis=-1)
        pth = jnp.take_along_axis(desc, (jnp.maximum(n_keep, 1) - 1)[:, None], axis=-1)
        return (kth, pth) if parts else jnp.maximum(kth, pth)

    def skip(s: jax.Array) -> jax.Array:
        return off

    threshold = jnp.where(bounded[:, None], _branch(_said(stages, "bounded"), jnp.any(bounded),
                                                    lambda s: cut(_top_values(s, head)), skip, scaled), off)
    if whole_vocabulary_by_sort():  # accelerators sort fast; `cut` finds both cut-offs in the sorted row
        def kth_and_pth(s: jax.Array) -> tuple[jax.Array, jax.Array]:
            return cut(jnp.sort(s, axis=-1)[:, ::-1], parts=True)

        either = None if stages is None else stages.wide_k or stages.top_p
        kth, pth = _branch(either, jnp.any(by_k | by_p), kth_and_pth, lambda s: (off, off), scaled)
    else:
        k = jnp.minimum(jnp.maximum(sb.top_k, 1), vocab)[:, None]
        kth = _branch(_said(stages, "wide_k"), jnp.any(by_k),
                      lambda s: _select(s, lambda key, t: jnp.sum(key >= t, axis=-1) >= k[:, 0], True), skip, scaled)

        def top_p_cut(s: jax.Array) -> jax.Array:
            kept = jnp.where(s >= jnp.maximum(jnp.where(by_k[:, None], kth, off), min_p_cut), e, 0.0)
            mass = sb.top_p * jnp.sum(kept, axis=-1)
            return _select(s, lambda key, t: jnp.sum(jnp.where(key > t, kept, 0.0), axis=-1) < mass, False)

        pth = _branch(_said(stages, "top_p"), jnp.any(by_p), top_p_cut, skip, scaled)
    threshold = jnp.maximum(threshold, jnp.where(by_k[:, None], kth, off))
    threshold = jnp.maximum(threshold, jnp.where(by_p[:, None], pth, off))
    threshold = jnp.maximum(threshold, min_p_cut)

    sampled = _draw(jnp.where(scaled >= threshold, e, 0.0), u)
    return jnp.where(stochastic, sampled, greedy)


def native_sampler() -> bool:
    """Whether `_choose` runs as the native CPU kernel (`kernels.sample`: each row's passes over its own
    logits while they are in the cache; XLA's code reads the whole batch's arrays pass after pass) rather
    than as the XLA code below: where the native kernels are available, unless `PARROT_CPU_SAMPLER=0`
    (read when a sampler is traced)."""
    return os.environ.get("PARROT_CPU_SAMPLER", "1") != "0" and jax.default_backend() == "cpu" and kernels.available()


def host_stages() -> bool:
    """Whether the engine names its samplers' parts on the host (`Stages`) instead of branching on the
    device: on accelerators, where a branch waits for the device (see the module's docstring); not on a CPU,
    where a branch reads its predicate in the same process and one executable serves every batch
    (`PARROT_HOST_STAGES=1` / `0` forces either; read when an engine starts)."""
    forced = os.environ.get("PARROT_HOST_STAGES")
    return forced == "1" if forced in ("0", "1") else jax.default_backend() != "cpu"


def whole_vocabulary_by_sort() -> bool:
    """Whether rows filtering over the whole vocabulary (a top-k above FAST_TOP_K, top-p without a small
    top-k) find their cut-offs in a sorted row instead of by bisection: on accelerators, where XLA sorts
    fast and a loop of 64 reductions costs more; never on a CPU, where a row's sort takes ~9 ms
    (`PARROT_SAMPLER_SORT=1` / `0` forces either; read when a sampler is traced)."""
    forced = os.environ.get("PARROT_SAMPLER_SORT")
    return forced == "1" if forced in ("0", "1") else jax.default_backend() != "cpu"


TOP_SPAN = 64  # `_top_values` looks for the k largest values in the k spans of this many tokens with the largest maxima


def _top_values(s: jax.Array, k: int) -> jax.Array:
    """The k largest values of each row of s [B, V], descending: `lax.top_k(s, k)[0]`, taken from the k spans
    of TOP_SPAN values with the largest maxima. Every value above the row's k-th largest lies in those
    spans, and with it enough values equal to it, so the k values are exact; the last top_k reads k x
    TOP_SPAN values instead of V (49,152 -> 4,096 for k = 64)."""
    batch, vocab = s.shape
    c = TOP_SPAN
    if vocab < 4 * k * c:  # small vocabularies: directly
        return jax.lax.top_k(s, k)[0]
    r = _spans(s, c, -jnp.inf)
    best = jax.lax.top_k(jnp.max(r, axis=-1), k)[1]
    return jax.lax.top_k(jnp.take_along_axis(r, best[:, :, None], axis=1).reshape(batch, k * c), k)[0]


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (negative floats below positive ones)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _from_order_key(k: jax.Array) -> jax.Array:
    b = jnp.where((k >> 31) == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _select(s: jax.Array, holds: object, largest: bool) -> jax.Array:
    """Per row of s [B, V], a value of s found by bisection over the 32-bit order of float32 values
    (32 passes over the row, each a comparison and a sum): the largest t with holds(keys, t) (which must
    hold from the bottom up to t: `largest`), or the smallest t with it (from t up). Returns [B, 1]."""
    key = _order_key(s)
    batch = s.shape[0]
    lo = jnp.zeros(batch, jnp.uint32)
    hi = jnp.full(batch, 0xFFFFFFFF, jnp.uint32)

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        span = hi - lo
        if largest:  # holds at lo; find the last t that holds
            mid = lo + (span >> 1) + (span & 1)
            ok = holds(key, mid[:, None])
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - (span > 0).astype(jnp.uint32))
        mid = lo + (span >> 1)  # holds at hi; find the first t that holds
        ok = holds(key, mid[:, None])
        return jnp.where(ok, lo, mid + (span > 0).astype(jnp.uint32)), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return _from_order_key(lo if largest else hi)[:, None]


def _draw(p: jax.Array, u: jax.Array) -> jax.Array:
    """Per row of p [B, V] (non-negative weights, some positive), the token whose cumulative weight in
    vocabulary order first exceeds u * total (u [B] in [0, 1)): spans of DRAW_SPAN tokens first, then
    within the span; never a token of weight 0."""
    c = min(DRAW_SPAN, p.shape[1])
    r = _spans(p, c, 0.0)
    spans = r.shape[1]
    span_mass = jnp.sum(r, axis=-1)
    cs = jnp.cumsum(span_mass, axis=-1)
    target = u * cs[:, -1]
    last = spans - 1 - jnp.argmax(span_mass[:, ::-1] > 0, axis=-1)  # the last span with weight
    span = jnp.minimum(jnp.sum(cs <= target[:, None], axis=-1), last)
    before = jnp.take_along_axis(cs - span_mass, span[:, None], axis=-1)[:, 0]
    within = jnp.take_along_axis(r, span[:, None, None], axis=1)[:, 0]
    cw = jnp.cumsum(within, axis=-1)
    rest = jnp.maximum(target - before, 0.0)
    lastw = c - 1 - jnp.argmax(within[:, ::-1] > 0, axis=-1)
    idx = jnp.minimum(jnp.sum(cw <= rest[:, None], axis=-1), lastw)
    return (span * c + idx).astype(jnp.int32)


# the engine always passes `counts` (zeros: no penalties)
processed_sampler = jax.jit(sample_processed, static_argnames=("stages",))
