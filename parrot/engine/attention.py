"""Paged attention over the flat token batch (see batch.py for the layout).

KV cache layout, per layer: `[Hkv, pages, page_size, D]` (head-major). Gathering a sequence's pages
yields `[Hkv, B, L, D]`, already in the `[batch..., rows, D]` order XLA's dot wants, so neither the
gathered keys/values nor the score matrices are ever transposed. Queries are regrouped per sequence
(`[B, Q]` via `q_index`), every (query, group) row of one KV head goes into one matrix product, a
causal + length mask is applied, and the result is scattered back to the flat token array.

Shared-prefix (cascade) attention, for decode batches whose sequences were forked from one context:
the prefix keys/values are gathered once and all member queries are stacked into one matrix product
against them; each sequence's own suffix is attended separately; the two partial results are merged
exactly through their log-sum-exp (flash-attention style), so the output equals ordinary attention.

Steps on a CPU with the native kernels (kernels/cpu_kernels.cc) skip the gathers altogether: each
sequence's keys and values are read in place from its pages (a decode batch's shared prefix through the
same pages), with an online softmax, and nothing is copied. Prefill steps there go through
kernels/prefill_attention.h: causal, up to each query's own position only (half the padded square), and
each token's result the same whatever chunk or batch it is filled in; a mixed step's decode rows (one
generated token beside prompt chunks) go through the decode kernel, so their results equal a decode step's.
On GPUs plain decode steps over a bfloat16 cache do the same through a Pallas kernel (gpu_attention.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parrot.engine import gpu_attention, kernels
from parrot.engine.batch import ForwardBatch
from parrot.engine.precision import exact

_MASKED = -1e30  # finite, so fully masked rows give zeros instead of NaNs


def write_kv(cache: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Store `new` ([T, Hkv, D]) into `cache` ([Hkv, pages, page_size, D]) at flat slots.

    A bfloat16 cache is stored as uint16 bit patterns: XLA's CPU backend widens a bfloat16 scatter to
    float32 and back, copying the whole pool in every step, while an integer scatter stays in place. A
    float8 cache (uint8: float8_e4m3fn bit patterns) stores the values clipped to +-448, e4m3's largest
    (XLA would make a larger one NaN), rounded to nearest even."""
    page_size = cache.shape[2]
    if cache.dtype == jnp.uint16:
        new = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), jnp.uint16)
    elif cache.dtype == jnp.uint8:
        new = jax.lax.bitcast_convert_type(to_fp8(new), jnp.uint8)
    else:
        new = new.astype(cache.dtype)
    return cache.at[:, slot_mapping // page_size, slot_mapping % page_size].set(new.transpose(1, 0, 2))


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def to_fp8(x: jax.Array) -> jax.Array:
    """`x` as float8_e4m3fn: clipped to +-FP8_MAX, then rounded to nearest even (kernels' e4m3_bits)."""
    return jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def gather_pages(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[Hkv, pages, page_size, D] x [..., P] -> [Hkv, ..., P * page_size, D].

    Pages are gathered as whole rows of a 2-D `[Hkv * pages, page_size * D]` view: XLA's CPU gather
    then copies contiguous rows instead of walking elements."""
    hkv, num_pages, page_size, d = cache.shape
    rows = jnp.arange(hkv, dtype=block_tables.dtype).reshape(hkv, *([1] * block_tables.ndim)) * num_pages
    g = cache.reshape(hkv * num_pages, page_size * d)[rows + block_tables[None]]
    if g.dtype == jnp.uint16:  # a bfloat16 cache's bit patterns
        g = jax.lax.bitcast_convert_type(g, jnp.bfloat16).astype(jnp.float32)
    elif g.dtype == jnp.uint8:  # a float8 cache's
        g = jax.lax.bitcast_convert_type(g, jnp.float8_e4m3fn).astype(jnp.float32)
    return g.reshape(hkv, *block_tables.shape[:-1], block_tables.shape[-1] * page_size, d)


def _partial(s: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Masked scores -> (row max, unnormalised probabilities, row sum) over the last axis."""
    s = jnp.where(mask, s, _MASKED)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    return m, e, jnp.sum(e, axis=-1, keepdims=True)


def in_place(cache_dtype: jnp.dtype, head_dim: int, v_dtype: jnp.dtype | None = None) -> bool:
    """Whether attention over caches of these storage dtypes (the keys'; the values', if other) reads the pages
    in place through the native CPU kernels (decode steps, and prefill steps without a shared prefix) instead
    of gathering them: both alike, or bfloat16 keys with float8 values."""
    k, v = jnp.dtype(cache_dtype), jnp.dtype(v_dtype or cache_dtype)
    pair = k == v or (k == jnp.uint16 and v == jnp.uint8)
    return pair and k in (jnp.float32, jnp.uint16, jnp.uint8) and head_dim % 8 == 0 and kernels.available()


def paged_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: ForwardBatch, scale: float,
    gpu_kernel: bool = False, bf16: bool = False, fused: bool = False,
) -> jax.Array:
    """q: [T, H, D] (flat). Returns [T, H, D]; tokens not in `q_index` get zeros. `gpu_kernel`: plain
    decode steps over a bfloat16 cache go through gpu_attention's kernel; `fused`: plain decode steps
    through XLA's lowering without a gathered copy of the pages (`_decode_fused`). `bf16` (the engine's bfloat16
    mode): where attention reads the pages in place on a CPU, prefill steps may multiply in bfloat16 on
    AMX's bf16 tiles (`kernels.paged_prefill`) and decode steps with AVX512-BF16's pair products
    (`kernels.paged_decode`)."""
    t, h, d = q.shape
    hkv = k_cache.shape[0]
    group = h // hkv
    bsz, qlen = batch.q_index.shape
    if in_place(k_cache.dtype, d, v_cache.dtype):
        if qlen == 1:
            return _decode_in_place(q, k_cache, v_cache, batch, scale, bf16)
        if batch.prefix_pages.shape[0] == 0:
            return _prefill_in_place(q, k_cache, v_cache, batch, scale, bf16)
    if (gpu_kernel and qlen == 1 and k_cache.dtype == v_cache.dtype == jnp.bfloat16
            and batch.prefix_pages.shape[0] == 0):
        return _decode_gpu(q, k_cache, v_cache, batch, scale)
    if fused and qlen == 1 and batch.prefix_pages.shape[0] == 0:
        return _decode_fused(q, k_cache, v_cache, batch, scale)
    qb = q.at[batch.q_index].get(mode="fill", fill_value=0).reshape(bsz, qlen, hkv, group, d) * scale
    # [Hkv, B, Q*G, D]: rows ordered (query, group)
    qh = qb.transpose(2, 0, 1, 3, 4).reshape(hkv, bsz, qlen * group, d)
    qpos = batch.positions.at[batch.q_index].get(mode="fill", fill_value=-1)  # [B, Q]
    k = gather_pages(k_cache, batch.block_tables)  # [Hkv, B, L, D]
    v = gather_pages(v_cache, batch.block_tables)
    mask = jnp.repeat(_visible(batch, k.shape[2], qpos), group, axis=1)[None]  # [1, B, Q*G, L]
    s = jnp.einsum("hbmd,hbld->hbml", qh, k, precision=exact(qh, k))
    m_s, e_s, l_s = _partial(s, mask)
    o = jnp.einsum("hbml,hbld->hbmd", e_s, v, precision=exact(e_s, v))
    if qlen == 1 and batch.prefix_pages.shape[0] > 0:
        o = _merge_shared_prefix(qh, o, m_s, l_s, k_cache, v_cache, batch)
    else:
        o = o / jnp.maximum(l_s, 1e-30)
    o = o.reshape(hkv, bsz, qlen, group, d).transpose(1, 2, 0, 3, 4).reshape(bsz * qlen, h, d).astype(q.dtype)
    out = jnp.zeros((t, h, d), q.dtype)
    return out.at[batch.q_index.reshape(-1)].set(o, mode="drop")


def _visible(batch: ForwardBatch, length: int, qpos: jax.Array) -> jax.Array:
    """[B, Q, L]: which of each sequence's `length` KV positions (from its `kv_offset`) query q sees: up to
    its own position `qpos[b, q]`, within the sequence's KV."""
    kv_pos = batch.kv_offset[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]  # [B, L]
    return (kv_pos[:, None, :] <= qpos[:, :, None]) & (kv_pos[:, None, :] < batch.kv_lens[:, None, None])


def _decode_in_place(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: ForwardBatch,
                     scale: float, bf16: bool = False) -> jax.Array:
    """One query per sequence, through the native kernel that reads the KV pages where they are. Where the
    step has one token row per sequence (a decode shape: build_batch puts sequence b's token in row b and
    pads both alike), the rows are the sequences as they are: no gather or scatter (each an XLA kernel of
    its own, in every layer). A padding sequence has no KV (kv_lens 0): the kernel leaves its row zero."""
    t, h, d = q.shape
    if t == batch.q_index.shape[0]:
        o = kernels.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.kv_offset, batch.kv_lens,
                                 batch.prefix_pages, batch.prefix_len, batch.in_prefix, scale, bf16)
        return o.astype(q.dtype)
    rows = batch.q_index[:, 0]
    qb = q.at[rows].get(mode="fill", fill_value=0)  # [B, H, D]
    o = kernels.paged_decode(qb, k_cache, v_cache, batch.block_tables, batch.kv_offset, batch.kv_lens,
                             batch.prefix_pages, batch.prefix_len, batch.in_prefix, scale, bf16)
    return jnp.zeros((t, h, d), q.dtype).at[rows].set(o.astype(q.dtype), mode="drop")


def _prefill_in_place(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: ForwardBatch,
                      scale: float, bf16: bool = False) -> jax.Array:
    """A step of several query tokens per sequence, through the native kernels that read the KV pages where
    they are. Its decode rows (a sequence's one generated token: a mixed step's decode batch beside a prompt
    chunk) go through the decode kernel, so each gets the very bits a decode step gives it; the prompt
    chunks through the prefill kernel."""
    t, h, d = q.shape
    first = batch.q_index[:, 0]
    single = batch.q_index[:, 1] >= t  # no second query token
    generated = batch.fill_rows.at[first].get(mode="fill", fill_value=-1) == 0
    decode = single & generated & (batch.kv_lens > 0)
    prefill_index = jnp.where(decode[:, None], t, batch.q_index)  # the prefill kernel leaves decode rows out
    o = kernels.paged_prefill(q, k_cache, v_cache, prefill_index, batch.positions, batch.block_tables,
                              batch.kv_offset, batch.kv_lens, scale, bf16)
    qb = q.at[first].get(mode="fill", fill_value=0)  # [B, H, D]
    od = kernels.paged_decode(qb, k_cache, v_cache, batch.block_tables, batch.kv_offset,
                              jnp.where(decode, batch.kv_lens, 0), batch.prefix_pages, batch.prefix_len,
                              jnp.zeros_like(batch.in_prefix), scale, bf16)
    return o.at[jnp.where(decode, first, t)].set(od, mode="drop").astype(q.dtype)


def _decode_gpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: ForwardBatch,
                scale: float) -> jax.Array:
    """One query per sequence, through the GPU kernel that reads the KV pages in place."""
    t, h, d = q.shape
    rows = batch.q_index[:, 0]
    qb = q.at[rows].get(mode="fill", fill_value=0)  # [B, H, D]
    o = gpu_attention.paged_decode(qb, k_cache, v_cache, batch.block_tables, batch.kv_lens, scale)
    return jnp.zeros((t, h, d), q.dtype).at[rows].set(o, mode="drop")


def _decode_fused(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: ForwardBatch,
                  scale: float) -> jax.Array:
    """One query per sequence in XLA's lowering, its scores and outputs written as reductions (multiply and
    sum, not matrix products) over KV rows read through the block table: XLA can then fuse the page gather
    into each reduction (on GPUs), so the pages are read once and never copied, where the gathered lowering
    writes every sequence's pages out and reads them again. Sums in float32."""
    t, h, d = q.shape
    hkv = k_cache.shape[0]
    group = h // hkv
    rows = batch.q_index[:, 0]
    bsz = rows.shape[0]
    qb = q.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32) * scale  # [B, H, D]
    qh = qb.reshape(bsz, hkv, group, d).transpose(1, 0, 2, 3)  # [Hkv, B, G, D]
    # the pages as gather expressions [Hkv, B, L, D], consumed by reductions (never by a matrix product,
    # which would make XLA write them out first)
    k = gather_pages(k_cache, batch.block_tables).astype(jnp.float32)
    v = gather_pages(v_cache, batch.block_tables).astype(jnp.float32)
    s = jnp.sum(qh[:, :, :, None, :] * k[:, :, None, :, :], axis=-1)  # [Hkv, B, G, L]
    qpos = batch.positions.at[rows].get(mode="fill", fill_value=-1)  # [B]
    _, e, total = _partial(s, _visible(batch, k.shape[2], qpos[:, None])[None])  # mask [1, B, 1, L]
    o = jnp.sum(e[..., None] * v[:, :, None, :, :], axis=3) / jnp.maximum(total, 1e-30)
    o = o.transpose(1, 0, 2, 3).reshape(bsz, h, d).astype(q.dtype)  # [B, H, D]
    return jnp.zeros((t, h, d), q.dtype).at[rows].set(o, mode="drop")


def _merge_shared_prefix(
    qh: jax.Array, o_s: jax.Array, m_s: jax.Array, l_s: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    batch: ForwardBatch,
) -> jax.Array:
    """Decode only. qh: [Hkv, B, G, D]; o_s, m_s, l_s: the own-suffix partial results.

    The prefix is read once; all B*G query rows of a KV head form one matrix product against it."""
    hkv, bsz, group, d = qh.shape
    kp = gather_pages(k_cache, batch.prefix_pages)  # [Hkv, Lp, D]
    vp = gather_pages(v_cache, batch.prefix_pages)
    qm = qh.reshape(hkv, bsz * group, d)
    s_p = jnp.einsum("hmd,hld->hml", qm, kp, precision=exact(qm, kp)).reshape(hkv, bsz, group, -1)
    mask_p = (jnp.arange(kp.shape[1])[None, :] < batch.prefix_len) & (batch.in_prefix[:, None] != 0)  # [B, Lp]
    m_p, e_p, l_p = _partial(s_p, mask_p[None, :, None, :])
    em = e_p.reshape(hkv, bsz * group, -1)
    o_p = jnp.einsum("hml,hld->hmd", em, vp, precision=exact(em, vp)).reshape(hkv, bsz, group, d)
    m = jnp.maximum(m_s, m_p)
    a_s, a_p = jnp.exp(m_s - m), jnp.exp(m_p - m)
    return (o_s * a_s + o_p * a_p) / jnp.maximum(l_s * a_s + l_p * a_p, 1e-30)
