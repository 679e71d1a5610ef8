"""Paged attention over the flat token batch (see batch.py for the layout).

Queries are regrouped per sequence (`[B, Q]`), keys/values gathered from each sequence's pages
(`[B, P * page_size]`), causal + length mask applied, and the result scattered back to the flat array.

Shared-prefix (cascade) attention, for decode batches whose sequences were forked from one context:
the prefix keys/values are gathered once and all member queries are stacked into one matrix product
against them; each sequence's own suffix is attended separately; the two partial results are merged
exactly through their log-sum-exp (flash-attention style), so the output equals ordinary attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parrot.engine.batch import ForwardBatch

_MASKED = -1e30  # finite, so fully masked rows give zeros instead of NaNs


def write_kv(cache: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Store `new` ([T, Hkv, D]) into `cache` ([pages, page_size, Hkv, D]) at flat slots."""
    page_size = cache.shape[1]
    return cache.at[slot_mapping // page_size, slot_mapping % page_size].set(new)


def gather_pages(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[pages, page_size, Hkv, D] x [..., P] -> [..., P * page_size, Hkv, D]."""
    g = cache[block_tables]
    return g.reshape(*block_tables.shape[:-1], block_tables.shape[-1] * cache.shape[1], *cache.shape[2:])


def _partial(s: jax.Array, mask: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Masked scores -> (row max, unnormalised probabilities, row sum)."""
    s = jnp.where(mask, s, _MASKED)
    m = jnp.max(s, axis=axis, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    return m, e, jnp.sum(e, axis=axis, keepdims=True)


def paged_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: ForwardBatch, scale: float
) -> jax.Array:
    """q: [T, H, D] (flat). Returns [T, H, D]; tokens not in `q_index` get zeros."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    group = h // hkv
    bsz, qlen = batch.q_index.shape
    qb = q.at[batch.q_index].get(mode="fill", fill_value=0).reshape(bsz, qlen, hkv, group, d) * scale
    qpos = batch.positions.at[batch.q_index].get(mode="fill", fill_value=-1)  # [B, Q]
    k = gather_pages(k_cache, batch.block_tables)  # [B, L, Hkv, D]
    v = gather_pages(v_cache, batch.block_tables)
    kv_pos = batch.kv_offset[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]  # [B, L]
    mask = (kv_pos[:, None, :] <= qpos[:, :, None]) & (kv_pos[:, None, :] < batch.kv_lens[:, None, None])
    if qlen == 1:
        o = _decode_attention(qb[:, 0], k, v, mask[:, 0], k_cache, v_cache, batch)[:, None]
    else:
        s = jnp.einsum("bqhgd,blhd->bqhgl", qb, k)
        p = jax.nn.softmax(jnp.where(mask[:, :, None, None, :], s, _MASKED), axis=-1)
        o = jnp.einsum("bqhgl,blhd->bqhgd", p, v)
    o = o.reshape(bsz * qlen, h, d).astype(q.dtype)
    out = jnp.zeros((t, h, d), q.dtype)
    return out.at[batch.q_index.reshape(-1)].set(o, mode="drop")


def _decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    batch: ForwardBatch,
) -> jax.Array:
    """One query per sequence. q: [B, Hkv, G, D]; k, v: [B, L, Hkv, D]; mask: [B, L]. -> [B, Hkv, G, D]."""
    # multiply-and-sum beats a batched matmul with a single query row on CPU
    kt = k.transpose(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, D]
    vt = v.transpose(0, 2, 1, 3)[:, :, None]
    s = jnp.sum(q[:, :, :, None, :] * kt, axis=-1)  # [B, Hkv, G, L]
    m_s, e_s, l_s = _partial(s, mask[:, None, None, :])
    o_s = jnp.sum(e_s[..., None] * vt, axis=3)  # [B, Hkv, G, D]
    if batch.prefix_pages.shape[0] == 0:
        return o_s / jnp.maximum(l_s, 1e-30)
    # shared prefix: read once, every member's queries in one matrix product per KV head
    kp = gather_pages(k_cache, batch.prefix_pages)  # [Lp, Hkv, D]
    vp = gather_pages(v_cache, batch.prefix_pages)
    s_p = jnp.einsum("bhgd,lhd->bhgl", q, kp)
    mask_p = (jnp.arange(kp.shape[0])[None, :] < batch.prefix_len) & batch.in_prefix[:, None]  # [B, Lp]
    m_p, e_p, l_p = _partial(s_p, mask_p[:, None, None, :])
    o_p = jnp.einsum("bhgl,lhd->bhgd", e_p, vp)
    m = jnp.maximum(m_s, m_p)
    a_s, a_p = jnp.exp(m_s - m), jnp.exp(m_p - m)
    return (o_s * a_s + o_p * a_p) / jnp.maximum(l_s * a_s + l_p * a_p, 1e-30)
