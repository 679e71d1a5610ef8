"""Tensor parallelism: one engine's model split over `tp` devices of a `jax.sharding.Mesh`, Megatron style.

- Attention heads and KV heads are split: each device holds whole heads. Where `tp` does not divide the
  head counts (the default model has 9 query and 3 KV heads), heads are added with zero weights. That is
  exact: a zero query head attends uniformly to zero values, and the output projection's rows for it are
  zero, so the model computes what it did before. The FFN width and the vocabulary are padded the same
  way (zero gate/up columns and down rows; zero embedding rows whose logits are cut off).
- The fused QKV and gate/up matrices are column parallel. Their columns are put in device-major order, so
  each device's block is its own `Q | K | V` (`gate | up`) and the model code runs unchanged on it.
  O and down are row parallel (Megatron, the default on accelerators): each device multiplies its input
  rows and the partial products are summed (`psum`, models/llama.py `row_project`); or, in the exact mode
  (the default on CPUs), split by output columns: their input is gathered first and their output after,
  so each output is the same sum as on one device. GGUF block-quantized matrices split along whole rows
  or whole 32-weight blocks.
- The embedding and the output projection are split by vocabulary; the KV pool by KV head.
- The runner calls the same jitted step functions inside `shard_map` over the mesh's `tp` axis, so the
  native CPU kernels (XLA custom calls, which GSPMD could not partition) run on each device's shard.

In the exact mode every value is computed as on one device, so greedy outputs equal one device's
(tests/engine/test_tensor_parallel.py checks 1, 2 and 4 devices and two processes). That holds with the
native CPU kernels (the default); without them, one device's own prompt steps are not row-invariant in
XLA's lowering (docs/architecture.md, "An accelerator's paths, rehearsed on a CPU"). In the Megatron
mode O's and down's partial sums are added in another order: logits agree to float rounding, and a
greedy output can change where two tokens' logits nearly tie.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parrot.engine.models.llama import TP_AXIS, LlamaConfig, Weight
from parrot.engine.quant import BLOCK_BYTES, QuantizedTensor
from parrot.errors import ParrotError


class TensorParallelError(ParrotError, ValueError):
    """A tensor-parallel setting this machine or model cannot take."""

    code = "invalid_tensor_parallel_setting"


def make_mesh(tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over the first `tp` devices (of every process, in multi-host runs)."""
    devices = devices if devices is not None else jax.devices()
    if tp < 1:
        raise TensorParallelError("tensor_parallel_size must be at least 1")
    if tp > len(devices):
        hint = ""
        if devices and devices[0].platform == "cpu":
            hint = (f" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tp} splits it into "
                    f"{tp} virtual devices)")
        raise TensorParallelError(
            f"tensor_parallel_size {tp} exceeds the {len(devices)} {devices[0].platform if devices else ''} "
            f"device(s) available{hint}")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def padded_config(cfg: LlamaConfig, tp: int, quantized: bool = False) -> LlamaConfig:
    """The config with head counts, FFN width and vocabulary padded so that `tp` splits them in whole
    heads (and, for block-quantized row-parallel matrices, whole 32-weight blocks)."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise TensorParallelError(f"{cfg.num_heads} query heads are not a multiple of {cfg.num_kv_heads} KV heads")
    group = cfg.num_heads // cfg.num_kv_heads
    kv_heads = _round_up(cfg.num_kv_heads, tp)
    unit = 32 * tp if quantized else tp
    return dataclasses.replace(cfg, num_kv_heads=kv_heads, num_heads=kv_heads * group,
                               intermediate_size=_round_up(cfg.intermediate_size, unit),
                               vocab_size=_round_up(cfg.vocab_size, tp))


def _pad_out(w: Weight, out: int) -> Weight:
    """An [in, out] matrix (or [out] bias) widened to `out` columns of zeros."""
    if isinstance(w, QuantizedTensor):  # `out` rows of blocks
        rows = w.shape[0] if w.rows_are_matrix else w.shape[1]
        data = np.concatenate([w.data, np.zeros((out - rows, w.data.shape[1]), np.uint8)])
        shape = (out, w.shape[1]) if w.rows_are_matrix else (w.shape[0], out)
        return QuantizedTensor(w.qtype, data, shape, w.rows_are_matrix)
    if w.ndim == 1:
        return np.concatenate([w, np.zeros(out - w.shape[0], w.dtype)])
    return np.concatenate([w, np.zeros((w.shape[0], out - w.shape[1]), w.dtype)], axis=1)


def _pad_in(w: Weight, n_in: int) -> Weight:
    """An [in, out] matrix lengthened to `n_in` input rows of zeros (zero blocks for a quantized one)."""
    if isinstance(w, QuantizedTensor):
        extra = (n_in - w.shape[0]) // 32 * BLOCK_BYTES[w.qtype]
        data = np.concatenate([w.data, np.zeros((w.data.shape[0], extra), np.uint8)], axis=1)
        return QuantizedTensor(w.qtype, data, (n_in, w.shape[1]))
    return np.concatenate([w, np.zeros((n_in - w.shape[0], w.shape[1]), w.dtype)])


def _pad_vocab_rows(w: Weight, vocab: int) -> Weight:
    """The [vocab, hidden] embedding with zero rows added."""
    if isinstance(w, QuantizedTensor):
        return _pad_out(w, vocab)
    return np.concatenate([w, np.zeros((vocab - w.shape[0], w.shape[1]), w.dtype)])


def pad_weights(cfg: LlamaConfig, weights: dict[str, Weight], padded: LlamaConfig) -> dict[str, Weight]:
    """The weights of `cfg` as those of the zero-padded `padded` (same outputs; see the module text).
    Added query heads come after the real ones, so the GQA groups of the real heads are kept."""
    d = cfg.head_dim
    qd, kvd, f, v = padded.num_heads * d, padded.num_kv_heads * d, padded.intermediate_size, padded.vocab_size
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        short = name.rsplit(".", 1)[-1]
        if short in ("wq", "bq") and qd != cfg.num_heads * d:
            w = _pad_out(w, qd)
        elif short in ("wk", "wv", "bk", "bv") and kvd != cfg.num_kv_heads * d:
            w = _pad_out(w, kvd)
        elif short == "wo" and qd != cfg.num_heads * d:
            w = _pad_in(w, qd)
        elif short in ("w_gate", "w_up") and f != cfg.intermediate_size:
            w = _pad_out(w, f)
        elif short == "w_down" and f != cfg.intermediate_size:
            w = _pad_in(w, f)
        elif name == "embed" and v != cfg.vocab_size:
            w = _pad_vocab_rows(w, v)
        elif name == "lm_head" and v != cfg.vocab_size:
            w = _pad_out(w, v)
        out[name] = w
    return out


def device_major(a: np.ndarray, sections: list[int], tp: int, axis: int) -> np.ndarray:
    """Reorder `a`'s `axis` from `[s0 | s1 | ...]` (each section split in `tp` equal parts) to `tp` blocks,
    block r holding part r of every section in order: block r of a column-parallel split is then device
    r's own fused matrix (e.g. its `Q | K | V`)."""
    parts = np.split(a, np.cumsum(sections)[:-1], axis=axis)
    chunks = [np.split(p, tp, axis=axis) for p in parts]
    return np.concatenate([c[r] for r in range(tp) for c in chunks], axis=axis)


def exact_default(platform: str) -> bool:
    """The exact mode where it costs little (CPUs: virtual devices and loopback processes, where tensor
    parallelism serves correctness and memory more than speed); Megatron's one all-reduce elsewhere."""
    return platform == "cpu"


def layer_specs(layer: dict, cfg: LlamaConfig, tp: int, exact: bool) -> tuple[dict, dict]:
    """For one decoder layer's pure dict (global arrays, fused as the model fuses them): the arrays in
    device-major order, and the PartitionSpec of each (`exact`: O and down split by output columns)."""
    d = cfg.head_dim
    qkv = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    gate_up = [cfg.intermediate_size] * 2
    arrays: dict = {}
    specs: dict = {}
    for group, params in layer.items():
        arrays[group], specs[group] = {}, {}
        for name, a in params.items():
            quantized = np.dtype(a.dtype) == np.uint8  # rows of blocks: [out, in bytes]
            if name in ("wqkv", "bqkv", "w_gate_up"):  # column parallel
                sections = gate_up if name == "w_gate_up" else qkv
                axis = 0 if quantized or a.ndim == 1 else 1
                a = device_major(np.asarray(a), sections, tp, axis)
                spec = P(TP_AXIS) if a.ndim == 1 else (P(TP_AXIS, None) if quantized else P(None, TP_AXIS))
            elif name in ("wo", "w_down"):  # row parallel, or split by output column (exact)
                by_input = P(None, TP_AXIS) if quantized else P(TP_AXIS, None)
                spec = (P(TP_AXIS, None) if quantized else P(None, TP_AXIS)) if exact else by_input
            else:  # norms: every device holds them
                spec = P()
            arrays[group][name], specs[group][name] = a, spec
    return arrays, specs


def kv_spec() -> P:
    """The KV pool ([kv_heads, pages, page_size, head_dim] per layer) is split by KV head."""
    return P(TP_AXIS)


def vocab_rows_spec() -> P:
    """The embedding ([vocab, hidden], or its block rows) and a tied or quantized head: split by vocabulary."""
    return P(TP_AXIS, None)


def head_proj_spec(tied: bool, quantized: bool) -> P:
    return vocab_rows_spec() if tied or quantized else P(None, TP_AXIS)


def place(tree: object, specs: object, mesh: Mesh) -> object:
    """Put host arrays on the mesh with their specs (every process passes the same arrays)."""
    def put(spec: P, a: object) -> jax.Array:
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])

    return jax.tree.map(put, specs, tree, is_leaf=lambda x: isinstance(x, P))
