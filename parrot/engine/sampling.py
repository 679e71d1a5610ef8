"""Sampling parameters and the jitted sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from parrot.errors import InvalidRequestError
from parrot.protocol import SamplingParams

__all__ = ["SamplingBatch", "SamplingParams", "check_sampling", "greedy_sample", "sample"]


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """What the schema cannot check: bounds that depend on the model."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
    if any(not s for s in params.stop):
        raise InvalidRequestError("stop strings must not be empty")


@jax.tree_util.register_dataclass
@dataclass
class SamplingBatch:
    temperature: jax.Array  # [B] float32 (0: greedy)
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32 (0: off)
    seeds: jax.Array  # [B] uint32
    steps: jax.Array  # [B] int32 tokens generated so far (folded into the key)

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
        return cls(temp, top_p, top_k, seeds, st)


def greedy_sample(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """logits [B, V] -> token ids [B]. Rows with temperature 0 take the argmax."""
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(sb.temperature, 1e-5)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
    # top-k: keep logits >= the k-th largest
    k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # top-p: keep the smallest prefix of sorted tokens whose mass reaches top_p
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    n_keep = jnp.sum((cum - probs) < sb.top_p[:, None], axis=-1)
    pth = jnp.take_along_axis(sorted_logits, (jnp.maximum(n_keep, 1) - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)

    def draw(seed: jax.Array, step: jax.Array, row: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row)

    sampled = jax.vmap(draw)(sb.seeds, sb.steps, masked).astype(jnp.int32)
    return jnp.where(sb.temperature > 0, sampled, greedy)
