"""Paged attention over the flat token batch (see batch.py for the layout).

Queries are regrouped per sequence (`[B, Q]`), keys/values gathered from each sequence's pages
(`[B, P * page_size]`), causal + length mask applied, and the result scattered back to the flat array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parrot.engine.batch import ForwardBatch

_MASKED = -1e30  # finite, so fully padded rows give zeros instead of NaNs


def write_kv(cache: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Store `new` ([T, Hkv, D]) into `cache` ([pages, page_size, Hkv, D]) at flat slots."""
    page_size = cache.shape[1]
    return cache.at[slot_mapping // page_size, slot_mapping % page_size].set(new)


def gather_pages(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[pages, page_size, Hkv, D] x [B, P] -> [B, P * page_size, Hkv, D]."""
    b, p = block_tables.shape
    g = cache[block_tables]
    return g.reshape(b, p * cache.shape[1], *cache.shape[2:])


def paged_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: ForwardBatch, scale: float
) -> jax.Array:
    """q: [T, H, D] (flat). Returns [T, H, D]; tokens not in `q_index` get zeros."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    group = h // hkv
    bsz, qlen = batch.q_index.shape
    qb = q.at[batch.q_index].get(mode="fill", fill_value=0).reshape(bsz, qlen, hkv, group, d)
    qpos = batch.positions.at[batch.q_index].get(mode="fill", fill_value=-1)  # [B, Q]
    k = gather_pages(k_cache, batch.block_tables)  # [B, L, Hkv, D]
    v = gather_pages(v_cache, batch.block_tables)
    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = (kv_pos[None, None, :] <= qpos[:, :, None]) & (kv_pos[None, None, :] < batch.kv_lens[:, None, None])
    if qlen == 1:
        # decode: multiply-and-sum is faster than a batched matmul with one query row on CPU
        kt = k.transpose(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, D]
        vt = v.transpose(0, 2, 1, 3)[:, :, None]
        s = jnp.sum(qb[:, 0, :, :, None, :] * kt, axis=-1)[:, None]  # [B, 1, Hkv, G, L]
    else:
        s = jnp.einsum("bqhgd,blhd->bqhgl", qb, k)
    s = jnp.where(mask[:, :, None, None, :], s * scale, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    if qlen == 1:
        o = jnp.sum(p[:, 0, :, :, :, None] * vt, axis=3)[:, None]  # [B, 1, Hkv, G, D]
    else:
        o = jnp.einsum("bqhgl,blhd->bqhgd", p, v)
    o = o.reshape(bsz * qlen, h, d)
    out = jnp.zeros((t, h, d), q.dtype)
    return out.at[batch.q_index.reshape(-1)].set(o, mode="drop")
