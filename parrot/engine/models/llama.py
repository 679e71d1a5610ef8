"""Llama-family decoder in Flax NNX (SmolLM2, Llama, Qwen2-style qkv bias).

Weights use the Hugging Face layout (Q/K rows in rotate-half order), stored transposed as
`[in, out]` so every projection is `x @ W`, or kept block-quantized as the GGUF file holds them
(`quant.QuantizedTensor`: `[out]` rows of blocks, a static `qtype` beside the uint8 array). The
forward works on a flat token batch (batch.py) and a paged KV cache: one `[kv_heads, pages,
page_size, head_dim]` array per layer for K and for V.

Tensor parallelism (`tp` > 1, engine/tensor_parallel.py): the same modules run inside `shard_map` on
each device's shard. The fused QKV and gate/up matrices are split by output columns (whole heads; each
device's columns hold its Q | K | V and gate | up). O and down (`row_project`) are split Megatron style
by input rows, their partial products summed over the `TP_AXIS` mesh axis; or, `tp_exact`, by output
columns after their input is gathered, so every output is the same sum as on one device. The
embedding and the output projection are split by vocabulary (`embed_tokens` / `lm_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parrot.engine import huge_pages, kernels, quant
from parrot.engine.attention import in_place, paged_attention, write_kv
from parrot.engine.batch import ForwardBatch
from parrot.engine.precision import exact
from parrot.engine.quant import QuantizedTensor

KVCache = tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]  # (k per layer, v per layer)
TP_AXIS = "tp"  # the mesh axis tensor-parallel shards are split over


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = True
    qkv_bias: bool = False

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + self.num_layers * (attn + mlp + 2 * h) + h + head


Weight = np.ndarray | QuantizedTensor


def _param(w: np.ndarray | jax.Array, dtype: jnp.dtype) -> nnx.Param:
    if isinstance(w, np.ndarray):
        return nnx.Param(huge_pages.put(w.astype(jnp.dtype(dtype), copy=False)))
    return nnx.Param(jnp.asarray(w, dtype=dtype))


def _matrix(w: Weight, dtype: jnp.dtype) -> tuple[nnx.Param, str | None]:
    """A projection's parameter and its block type (None: a float matrix in `dtype`)."""
    if isinstance(w, QuantizedTensor):
        return nnx.Param(huge_pages.put(w.data)), w.qtype
    return _param(w, dtype), None


def _tiled(w: Weight, enabled: bool) -> nnx.Param | None:
    """A quantized matrix's copy tiled for the native integer codes' lanes (kernels.tile_rows), which its
    products of generated rows (decode steps) read instead; None where not `enabled` (tensor parallelism
    shards the matrices), for float matrices and where the native kernels are unavailable."""
    if not enabled or not isinstance(w, QuantizedTensor):
        return None
    tiled = quant.tiled(w)
    return None if tiled is None else nnx.Param(huge_pages.put(tiled))


def _value(p: nnx.Param | None) -> jax.Array | None:
    return None if p is None else p[...]


def _fuse(parts: list[Weight]) -> Weight:
    """Projections side by side along `out` (Q|K|V, gate|up); quantized ones only if of one block type."""
    if all(isinstance(p, QuantizedTensor) for p in parts):
        try:
            return quant.concat_rows(parts)  # type: ignore[arg-type]
        except ValueError:
            pass
    return np.concatenate([p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts], axis=1)


def project(x: jax.Array, w: jax.Array, qtype: str | None, dtype: jnp.dtype,
            fill: jax.Array | None = None, tiled: jax.Array | None = None) -> jax.Array:
    """x @ W for a float [in, out] matrix, or a block-quantized one (`dtype`: what a dequantized matrix is
    multiplied in when XLA does the product, and by the native kernel for prompt tokens' rows: `fill`,
    see quant.linear; `tiled`: its copy for the VNNI code, see `_tiled`)."""
    if qtype is None:
        return matmul(x, w)
    return quant.linear(x, w, qtype, dtype, fill, tiled)


def row_project(x: jax.Array, w: jax.Array, qtype: str | None, dtype: jnp.dtype, tp: int, exact: bool,
                fill: jax.Array | None = None, tiled: jax.Array | None = None) -> jax.Array:
    """O and down under tensor parallelism (inside `shard_map`): `x` holds this device's heads (FFN
    columns). Megatron: `w` holds the matching input rows and the partial products are summed over
    the devices (one all-reduce; the order of the sum changes with tp). `exact`: `w` holds all input rows
    of this device's output columns, `x` is gathered first and the outputs after (two all-gathers;
    each output is computed as on one device, so greedy outputs do not change with tp)."""
    if tp == 1:
        return project(x, w, qtype, dtype, fill, tiled)
    if not exact:
        return jax.lax.psum(project(x, w, qtype, dtype, fill), TP_AXIS)
    full = jax.lax.all_gather(x, TP_AXIS, axis=1, tiled=True)
    return jax.lax.all_gather(project(full, w, qtype, dtype, fill), TP_AXIS, axis=1, tiled=True)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in the weight's dtype, accumulated and returned in x's dtype (bf16 weights with float32
    activations run on the CPU's bf16 matrix units)."""
    if w.dtype == x.dtype:
        return jnp.dot(x, w, precision=exact(x, w))
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, weight: np.ndarray, eps: float, dtype: jnp.dtype) -> None:
        self.weight = _param(weight, dtype)  # the activation dtype
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept) by the same additions whatever the number of rows: halves added
    elementwise while the width is even, then the remaining columns in order. (XLA's CPU reduction of a
    single row sums in another order than that of several rows, so a sequence's norms, and then its
    greedy tokens, changed with the size of its decode batch.)"""
    while x.shape[-1] % 2 == 0 and x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    total = x[..., :1]
    for i in range(1, x.shape[-1]):
        total = total + x[..., i : i + 1]
    return total


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    var = row_sum(jnp.square(x)) * (1.0 / x.shape[-1])
    return x * jax.lax.rsqrt(var + eps) * weight


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x: [T, heads, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def qkv_heads(cfg: LlamaConfig, qkv: jax.Array, heads: int, kv_heads: int, cos: jax.Array,
              sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused projection's output [T, (heads + 2 kv_heads) * head_dim] -> q, k (both rotated) and v."""
    t, d = qkv.shape[0], cfg.head_dim
    qd, kvd = heads * d, kv_heads * d
    q = apply_rope(qkv[:, :qd].reshape(t, heads, d), cos, sin)
    k = apply_rope(qkv[:, qd : qd + kvd].reshape(t, kv_heads, d), cos, sin)
    return q, k, qkv[:, qd + kvd :].reshape(t, kv_heads, d)


def swiglu(gu: jax.Array) -> jax.Array:
    """silu(gate) * up of the fused gate|up projection's output."""
    f = gu.shape[-1] // 2
    return jax.nn.silu(gu[:, :f]) * gu[:, f:]


class Attention(nnx.Module):
    """Q, K and V come from one fused `[hidden, (heads + 2 kv_heads) * head_dim]` projection."""

    def __init__(self, cfg: LlamaConfig, w: dict[str, Weight], dtype: jnp.dtype, qdtype: jnp.dtype,
                 tp: int = 1, tp_exact: bool = False, decode_kernel: bool = False, decode_fused: bool = False) -> None:
        self.cfg = cfg
        self.qdtype = qdtype
        self.decode_kernel = decode_kernel  # decode steps through gpu_attention's kernel (see paged_attention)
        self.decode_fused = decode_fused  # decode steps in XLA's lowering without a gathered copy of the pages
        self.tp, self.tp_exact = tp, tp_exact  # tp > 1: this device's heads only (see `row_project`)
        qkv = _fuse([w["wq"], w["wk"], w["wv"]])
        self.wqkv, self.wqkv_q = _matrix(qkv, dtype)
        self.wo, self.wo_q = _matrix(w["wo"], dtype)
        self.wqkv_t, self.wo_t = _tiled(qkv, tp == 1), _tiled(w["wo"], tp == 1)
        if cfg.qkv_bias:
            self.bqkv = _param(np.concatenate([w["bq"], w["bk"], w["bv"]]), dtype)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, batch: ForwardBatch, k_cache: jax.Array,
        v_cache: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        t = x.shape[0]
        fill = batch.fill_rows
        qkv = project(x, self.wqkv[...], self.wqkv_q, self.qdtype, fill, _value(self.wqkv_t))
        if cfg.qkv_bias:
            qkv = qkv + self.bqkv[...]
        heads = cfg.num_heads // self.tp
        if self.tp == 1 and qkv.dtype == jnp.float32 and in_place(k_cache.dtype, cfg.head_dim, v_cache.dtype):
            # one native pass (RoPE and the KV writes; the same bits as XLA's code of them)
            q, k_cache, v_cache = kernels.rope_kv(qkv, cos, sin, batch.slot_mapping, k_cache, v_cache, heads)
        else:
            q, k, v = qkv_heads(cfg, qkv, heads, cfg.num_kv_heads // self.tp, cos, sin)
            k_cache = write_kv(k_cache, k, batch.slot_mapping)
            v_cache = write_kv(v_cache, v, batch.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, batch, cfg.head_dim**-0.5, self.decode_kernel,
                            bf16=jnp.dtype(self.qdtype) == jnp.bfloat16, fused=self.decode_fused)
        out = row_project(o.reshape(t, -1), self.wo[...], self.wo_q, self.qdtype, self.tp, self.tp_exact, fill,
                          _value(self.wo_t))
        return out, k_cache, v_cache


class MLP(nnx.Module):
    """SwiGLU with the gate and up projections fused into one `[hidden, 2 * ffn]` matrix."""

    def __init__(self, w: dict[str, Weight], dtype: jnp.dtype, qdtype: jnp.dtype, tp: int = 1,
                 tp_exact: bool = False) -> None:
        self.qdtype = qdtype
        self.tp, self.tp_exact = tp, tp_exact  # tp > 1: this device's share of the FFN (see `row_project`)
        gate_up = _fuse([w["w_gate"], w["w_up"]])
        self.w_gate_up, self.w_gate_up_q = _matrix(gate_up, dtype)
        self.w_down, self.w_down_q = _matrix(w["w_down"], dtype)
        self.w_gate_up_t, self.w_down_t = _tiled(gate_up, tp == 1), _tiled(w["w_down"], tp == 1)

    def __call__(self, x: jax.Array, fill: jax.Array | None = None) -> jax.Array:
        w, qtype, tiled = self.w_gate_up[...], self.w_gate_up_q, _value(self.w_gate_up_t)
        if qtype is not None and quant.native(x.shape[0]):  # silu(gate) * up in the native product
            h = quant.linear(x, w, qtype, self.qdtype, fill, tiled, swiglu=True)
        else:
            h = swiglu(project(x, w, qtype, self.qdtype, fill, tiled))
        return row_project(h, self.w_down[...], self.w_down_q, self.qdtype, self.tp, self.tp_exact, fill,
                           _value(self.w_down_t))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, w: dict[str, Weight], dtype: jnp.dtype, act_dtype: jnp.dtype,
                 qdtype: jnp.dtype, tp: int = 1, tp_exact: bool = False, decode_kernel: bool = False,
                 decode_fused: bool = False) -> None:
        self.attn_norm = RMSNorm(w["attn_norm"], cfg.rms_eps, act_dtype)
        self.attn = Attention(cfg, w, dtype, qdtype, tp, tp_exact, decode_kernel, decode_fused)
        self.ffn_norm = RMSNorm(w["ffn_norm"], cfg.rms_eps, act_dtype)
        self.mlp = MLP(w, dtype, qdtype, tp, tp_exact)

    def __call__(self, x, cos, sin, batch, k_cache, v_cache):  # noqa: ANN001, ANN204
        a, k_cache, v_cache = self.attn(self.attn_norm(x), cos, sin, batch, k_cache, v_cache)
        x = x + a
        return x + self.mlp(self.ffn_norm(x), batch.fill_rows), k_cache, v_cache


class Llama(nnx.Module):
    """The decoder. `weights` holds numpy arrays (or `QuantizedTensor`s) named as in `weight_names(cfg)`.

    `dtype` is the dtype of float embedding and projection weights; `act_dtype` that of activations,
    norms and attention (e.g. bf16 weights with float32 activations on a CPU with bf16 matrix units);
    `qdtype` that in which a quantized matrix is multiplied when XLA does the product (large batches).
    `tp` > 1: the layers run on tensor-parallel shards (engine/tensor_parallel.py arranges the weights;
    the runner calls the layers inside `shard_map`; `tp_exact`: see `row_project`). `decode_kernel`: decode
    attention through the GPU kernel (engine/gpu_attention.py) where the cache is bfloat16; `decode_fused`:
    through XLA's lowering without a gathered copy of the pages (attention.paged_attention)."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, Weight], dtype: jnp.dtype = jnp.float32,
                 act_dtype: jnp.dtype | None = None, qdtype: jnp.dtype | None = None, tp: int = 1,
                 tp_exact: bool = False, decode_kernel: bool = False, decode_fused: bool = False):
        self.cfg = cfg
        act_dtype = act_dtype or dtype
        self.act_dtype = act_dtype
        self.qdtype = qdtype or act_dtype
        # the embedding keeps GGUF's [vocab, hidden] row layout, quantized or not
        embed = weights["embed"]
        self.embed, self.embed_q = _matrix(embed, dtype)
        # the output projection's copy for the VNNI code (the tied embedding's, or lm_head's)
        self.head_t = _tiled(embed if cfg.tie_word_embeddings else weights["lm_head"], tp == 1)
        self.layers = nnx.List(
            DecoderLayer(cfg, {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")},
                         dtype, act_dtype, self.qdtype, tp, tp_exact, decode_kernel, decode_fused)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(weights["norm"], cfg.rms_eps, act_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head, self.lm_head_q = _matrix(weights["lm_head"], dtype)

    def __call__(self, batch: ForwardBatch, kv: KVCache) -> tuple[jax.Array, KVCache]:
        """Returns the logits ([B, vocab], float32) of each sequence's `logits_index` token and the KV.
        (The runner calls the same pieces separately: `embed_tokens`, the layers, `lm_logits`.)"""
        x, cos, sin = embed_tokens(self.cfg, self.embedding(), batch.input_ids, batch.positions, self.act_dtype)
        ks, vs = list(kv[0]), list(kv[1])
        for i, layer in enumerate(self.layers):
            x, ks[i], vs[i] = layer(x, cos, sin, batch, ks[i], vs[i])
        return lm_logits(self.head_weights(), x, batch.logits_index), (tuple(ks), tuple(vs))

    def embedding(self) -> Embedding:
        return Embedding(self.embed[...], self.embed_q)

    def head_weights(self) -> HeadWeights:
        tied = self.cfg.tie_word_embeddings
        proj, qtype = (self.embed[...], self.embed_q) if tied else (self.lm_head[...], self.lm_head_q)
        return HeadWeights(self.norm.weight[...], proj, self.cfg.rms_eps, tied, qtype, self.qdtype, _value(self.head_t))


@jax.tree_util.register_dataclass
@dataclass
class Embedding:
    """The [vocab, hidden] token embedding: floats, or GGUF block rows of type `qtype`."""

    table: jax.Array
    qtype: str | None = field(default=None, metadata={"static": True})


def embed_tokens(cfg: LlamaConfig, embed: Embedding, input_ids: jax.Array, positions: jax.Array,
                 act_dtype: jnp.dtype, tp_axis: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token embeddings ([T, hidden]) and the RoPE tables of their positions. With `tp_axis` (inside
    `shard_map`), `embed` is this device's slice of the vocabulary: rows of other slices read as zeros
    and the slices are summed (exact: one term per token is not zero)."""
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    ids, inside = input_ids, None
    if tp_axis is not None:
        rows = embed.table.shape[0]
        ids = input_ids - jax.lax.axis_index(tp_axis) * rows
        inside = (ids >= 0) & (ids < rows)
        ids = jnp.where(inside, ids, 0)
    if embed.qtype is not None:
        x = quant.dequantize_rows(embed.table, ids, embed.qtype, cfg.hidden_size, act_dtype)
    else:
        x = embed.table[ids].astype(act_dtype)
    if tp_axis is not None:
        x = jax.lax.psum(jnp.where(inside[:, None], x, jnp.zeros((), x.dtype)), tp_axis)
    return x, cos, sin


@jax.tree_util.register_dataclass
@dataclass
class HeadWeights:
    """The final norm and the output projection: `proj` is [hidden, vocab], or the [vocab, hidden]
    embedding itself when `tied` (transposed inside the jitted function, never copied); quantized
    (`qtype`), it is [vocab] rows of blocks either way."""

    norm: jax.Array
    proj: jax.Array
    eps: float = field(metadata={"static": True})
    tied: bool = field(metadata={"static": True})
    qtype: str | None = field(default=None, metadata={"static": True})
    qdtype: jnp.dtype = field(default=jnp.float32, metadata={"static": True})
    tiled: jax.Array | None = None  # quantized `proj`'s copy for the VNNI code (models/llama.py `_tiled`)


def lm_logits(w: HeadWeights, x: jax.Array, logits_index: jax.Array, tp_axis: str | None = None,
              vocab_size: int | None = None) -> jax.Array:
    """Final norm and projection of the tokens at `logits_index` (-1: a padding row, whose logits may be zeros):
    float32 logits [B, vocab]. With
    `tp_axis` (inside `shard_map`), `w.proj` is this device's slice of the vocabulary: the slices'
    logits are gathered, and cut to `vocab_size` (the vocabulary may be padded to a multiple of tp)."""
    h = rms_norm(x[jnp.maximum(logits_index, 0)], w.norm, w.eps)
    if w.qtype is not None:  # padding rows (index -1) are skipped by the native product: zero logits
        logits = quant.linear(h, w.proj, w.qtype, w.qdtype, jnp.where(logits_index < 0, -1, 0),
                              w.tiled).astype(jnp.float32)
    else:
        logits = matmul(h, w.proj.T if w.tied else w.proj).astype(jnp.float32)
    if tp_axis is not None:
        logits = jax.lax.all_gather(logits, tp_axis, axis=1, tiled=True)[:, :vocab_size]
    return logits


def weight_names(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model expects, with its shape (projections as [in, out])."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
    names: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        names["lm_head"] = (h, cfg.vocab_size)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names |= {
            p + "attn_norm": (h,), p + "ffn_norm": (h,),
            p + "wq": (h, qd), p + "wk": (h, kvd), p + "wv": (h, kvd), p + "wo": (qd, h),
            p + "w_gate": (h, f), p + "w_up": (h, f), p + "w_down": (f, h),
        }
        if cfg.qkv_bias:
            names |= {p + "bq": (qd,), p + "bk": (kvd,), p + "bv": (kvd,)}
    return names


def random_weights(cfg: LlamaConfig, seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random weights for tests (norm weights near 1 so activations stay in range)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_names(cfg).items():
        if name.endswith("norm"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out
