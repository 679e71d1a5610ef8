"""A decode step's decoder layers as one loop over the layers, for multi-step decode on a CPU.

A multi-step decode loop (runner.py `decode_loop`) compiled the whole model into each executable: its
30 layers unrolled, ~0.7 MB of executable and traced program per layer (~30 MB a loop freshly compiled,
~47 MB loaded from the compilation cache), and a server holds one loop per batch bucket. Here the
layers are the body of a `fori_loop` instead: one layer's code, whatever the depth.

Each call inside the body takes every layer's matrices (or caches) and the layer index, and the native
kernel uses that layer's (`kernels.qmatmul_pick`, `paged_decode_pick`, `rope_kv_pick`): XLA passes
pointers, so nothing is sliced or copied; the KV caches are updated in place (aliased). The norm
weights, a few KB a layer, are stacked and indexed. The operations are `DecoderLayer`'s, in its order,
on the native path it takes for a decode shape on a CPU (quantized matrices, attention reading the
pages in place, one token row per sequence), so the results are the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from parrot.engine import kernels, quant
from parrot.engine.attention import in_place
from parrot.engine.batch import ForwardBatch
from parrot.engine.models.llama import Llama, LlamaConfig, rms_norm

_MATRICES = (("attn", "wqkv"), ("attn", "wo"), ("mlp", "w_gate_up"), ("mlp", "w_down"))


@dataclass(frozen=True)
class LayerLoop:
    """What the loop needs beyond the layers' arrays: each matrix kind's block type (the same in every
    layer), the dtype products are asked in (`quant.linear`'s `dtype`), and the model's shape."""

    cfg: LlamaConfig
    qtypes: tuple[str, str, str, str]  # QKV, O, gate|up, down
    qdtype: jnp.dtype

    @staticmethod
    def of(model: Llama, cache_dtype: jnp.dtype, v_dtype: jnp.dtype | None = None) -> LayerLoop | None:
        """The loop for `model`'s decode steps, or None where they cannot run as one: no native kernels,
        a float (not block-quantized) matrix, block types that differ between layers, tensor parallelism,
        or caches (the keys' `cache_dtype`, the values' `v_dtype`) the kernels do not read in place."""
        cfg = model.cfg
        if not kernels.available() or not in_place(cache_dtype, cfg.head_dim, v_dtype) or not model.layers:
            return None
        kinds = set()
        for layer in model.layers:
            attn, mlp = layer.attn, layer.mlp
            if attn.tp != 1 or attn.decode_kernel:
                return None
            kinds.add((attn.wqkv_q, attn.wo_q, mlp.w_gate_up_q, mlp.w_down_q, jnp.dtype(attn.qdtype)))
        if len(kinds) != 1:
            return None
        *qtypes, qdtype = kinds.pop()
        if any(q is None for q in qtypes):
            return None
        return LayerLoop(cfg, tuple(qtypes), qdtype)  # type: ignore[arg-type]

    def __call__(self, layers: list[dict], x: jax.Array, cos: jax.Array, sin: jax.Array, batch: ForwardBatch,
                 ks: list[jax.Array], vs: list[jax.Array]) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
        """Every layer of a decode step (`layers`: each layer's state as a plain dict, as the runner holds
        them; one token row per sequence): the hidden states after the last layer, and the caches."""
        cfg = self.cfg
        if x.shape[0] != batch.q_index.shape[0] or x.shape[0] > quant.KERNEL_MAX_ROWS:
            raise ValueError("a layer loop runs decode shapes only: one token row per sequence")
        mats = [[layer[group][name] for layer in layers] for group, name in _MATRICES]
        tiled = [[layer[group].get(name + "_t") for layer in layers] for group, name in _MATRICES]
        attn_norms = jnp.stack([layer["attn_norm"]["weight"] for layer in layers])
        ffn_norms = jnp.stack([layer["ffn_norm"]["weight"] for layer in layers])
        bias = jnp.stack([layer["attn"]["bqkv"] for layer in layers]) if cfg.qkv_bias else None
        bf16 = self.qdtype == jnp.bfloat16
        fill = batch.fill_rows if bf16 else jnp.minimum(batch.fill_rows, 0)  # as quant.linear
        limbs = 2 if bf16 else 3

        def project(i: jax.Array, h: jax.Array, m: int, swiglu: bool = False) -> jax.Array:
            return kernels.qmatmul_pick(h, i, mats[m], tiled[m], self.qtypes[m], fill, limbs,
                                        swiglu).astype(h.dtype)

        def layer(i: jax.Array, carry: tuple) -> tuple:
            x, ks, vs = carry
            qkv = project(i, rms_norm(x, attn_norms[i], cfg.rms_eps), 0)
            if bias is not None:
                qkv = qkv + bias[i]
            q, ks, vs = kernels.rope_kv_pick(i, qkv, cos, sin, batch.slot_mapping, ks, vs, cfg.num_heads)
            o = kernels.paged_decode_pick(q, i, ks, vs, batch.block_tables, batch.kv_offset, batch.kv_lens,
                                          batch.prefix_pages, batch.prefix_len, batch.in_prefix,
                                          cfg.head_dim**-0.5, bf16).astype(q.dtype)
            x = x + project(i, o.reshape(x.shape[0], -1), 1)
            x = x + project(i, project(i, rms_norm(x, ffn_norms[i], cfg.rms_eps), 2, swiglu=True), 3)
            return x, ks, vs

        x, ks, vs = jax.lax.fori_loop(0, len(layers), layer, (x, list(ks), list(vs)))
        return x, ks, vs
