"""Decode attention on GPUs: one Pallas (Triton) kernel reads each sequence's KV pages where they are.

XLA's own lowering of paged decode attention (attention.py) first gathers every sequence's pages into a
contiguous copy, then turns the small per-sequence products into reduction fusions: on an H100 that
gather alone was 2.8 of 11.8 ms of device time in a batch-64 step of an 8B model. JAX ships a paged
decode kernel for GPUs (`jax.experimental.pallas.ops.gpu.paged_attention`) on the same
`[Hkv, pages, page_size, D]` layout as this engine's KV pool; this module picks its block sizes per shape
and checks once per process that it compiles on the device, so a backend where it does not falls back
to XLA's lowering with a warning.

Measured there (docs/benchmarks.md, Accelerators): 2.4% faster than XLA's lowering at batch 64 and
level at batch 1 for the 8B shape (4 query heads per KV head); for a 1.7B model with one query head per
KV head (padded to 16 rows per program here) serving was slower up to 16 sequences. The runner takes it
for 4+ query heads per KV head (`EngineConfig.decode_attention`). Used for plain decode steps (one query
per sequence, no shared prefix) with a bfloat16 cache: a float32 cache keeps the exact XLA path (Triton
multiplies float32 in TF32).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

MAX_SPLITS = 16  # partitions of a sequence's pages run in parallel (programs per sequence and KV head)
MAX_PAGES_PER_BLOCK = 8  # pages one step of a partition's loop reads (with 16-token pages: 128 keys)
BLOCK_H = 16  # query heads of one KV head per program (the kernel's minimum; a smaller group is padded)


def _pow2_divisor(n: int, limit: int) -> int:
    """The largest power of two <= limit that divides n."""
    d = 1
    while d * 2 <= limit and n % (d * 2) == 0:
        d *= 2
    return d


def block_sizes(pages: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for a block table of `pages` pages: both powers of two that
    divide it, as the kernel requires."""
    splits = _pow2_divisor(pages, MAX_SPLITS)
    return splits, _pow2_divisor(pages // splits, MAX_PAGES_PER_BLOCK)


def paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                 kv_lens: jax.Array, scale: float, interpret: bool = False) -> jax.Array:
    """q: [B, H, D]; caches: [Hkv, pages, page_size, D]; block_tables: [B, P]; kv_lens: [B] (0: a padding
    row, which gets zeros). Returns [B, H, D] in q's dtype. `interpret`: run the kernel on any backend
    (tests on CPUs)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    splits, per_block = block_sizes(int(block_tables.shape[1]))
    return paged_attention((q * scale).astype(k_cache.dtype), k_cache, v_cache, block_tables,
                           kv_lens.astype(jnp.int32), block_h=BLOCK_H, pages_per_compute_block=per_block,
                           k_splits=splits, interpret=interpret).astype(q.dtype)


@functools.cache
def available() -> bool:
    """Whether the kernel compiles and runs on this process's default device (GPUs only; probed once)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        k = jnp.zeros((1, 4, 16, 64), jnp.bfloat16)
        out = jax.jit(paged_decode, static_argnums=5)(jnp.ones((2, 2, 64), jnp.bfloat16), k, k,
                                                       jnp.zeros((2, 2), jnp.int32), jnp.array([5, 0], jnp.int32),
                                                       0.125)
        jax.block_until_ready(out)
        return True
    except Exception as exc:  # a Triton / Pallas lowering this backend lacks
        log.warning("GPU decode attention kernel unavailable (%s: %s); using XLA's lowering",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
