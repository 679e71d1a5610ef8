"""Block-quantized weights kept as the GGUF file stores them (Q8_0, Q4_0, Q4_1), and the products that
read them.

A `QuantizedTensor` is a `[in, out]` model matrix held as its `out` rows of `in / 32` blocks each
(`data`: uint8 `[out, in / 32 * block_bytes]`, exactly the file's bytes). Dequantization is exact: every
weight is `d * q (+ m)` with the block's float16 scale `d` (and minimum `m`), computed in float32.

`linear(x, data, qtype)` multiplies activations by such a matrix inside jitted code:
- where the native CPU kernel runs (kernels/cpu_kernels.cc), up to `KERNEL_MAX_ROWS` rows: it
  dequantizes each block in registers (decode) or 16 rows at a time into a small panel (several rows),
  so a step reads the weights in their quantized size (Q4_1: 5 bits a weight, not 32); an engine that
  fills prompts in bfloat16 multiplies prompt tokens' rows on AMX's bf16 tiles where the CPU has them
  (kernels/amx_bf16.h);
- otherwise: dequantized by XLA to `dtype` and multiplied by XLA's dot.
Both compute the product with the same dequantized matrix; they differ only in summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from parrot.engine import kernels
from parrot.engine.precision import exact

# bytes per block of 32 weights
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
# the GGML type names these come from
GGML_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
# products up to this many rows use the native kernel (prefill chunks included: on a 2-core AMD EPYC the
# panel kernel beat XLA's dequantize-then-dot at 64-512 rows, 1.1-2.6x); larger ones go through XLA
KERNEL_MAX_ROWS = 4096


@dataclass
class QuantizedTensor:
    """A model matrix of logical shape `shape`, stored as rows of GGUF blocks: a projection `(in, out)`
    as its `out` rows, or (`rows_are_matrix`, the embedding) a `(rows, K)` matrix as those rows."""

    qtype: str
    data: np.ndarray  # uint8 [rows, K / 32 * BLOCK_BYTES[qtype]]
    shape: tuple[int, int]
    rows_are_matrix: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """The exact float32 matrix, in its logical shape."""
        k = self.shape[1] if self.rows_are_matrix else self.shape[0]
        rows = np.asarray(dequantize(jnp.asarray(self.data), self.qtype, k))
        return rows if self.rows_are_matrix else np.ascontiguousarray(rows.T)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Matrices side by side along `out` (e.g. Q, K and V fused into one projection): rows stacked."""
    qtype, k = parts[0].qtype, parts[0].shape[0]
    if any(p.qtype != qtype or p.shape[0] != k for p in parts):
        raise ValueError("only matrices of one block type and input size can be fused")
    return QuantizedTensor(qtype, np.concatenate([p.data for p in parts]), (k, sum(p.shape[1] for p in parts)))


def tiled(w: QuantizedTensor) -> np.ndarray | None:
    """The matrix's copy laid out for the native integer codes' lanes (kernels.tile_rows), which `linear`'s
    products of generated rows read instead of `w.data` (the same results in less time: no transposes or
    gathers per block); None where the kernels are not available."""
    return kernels.tile_rows(w.data, w.qtype, w.data.shape[1] // BLOCK_BYTES[w.qtype] * 32)


def quantize(w: np.ndarray, qtype: str) -> QuantizedTensor:
    """Quantize a float [in, out] matrix as its `out` rows of blocks (tests, tools and `quantize_matrices`)."""
    import gguf

    data = gguf.quants.quantize(np.ascontiguousarray(w.T, dtype=np.float32), gguf.GGMLQuantizationType[qtype.upper()])
    return QuantizedTensor(qtype, data, tuple(w.shape))


# the weights `quantize_matrices` quantizes: the model's matrices by their names' last part (norms and
# biases stay float)
MATRICES = ("embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_matrices(weights: dict[str, object], qtype: str) -> dict[str, object]:
    """The model's float matrices (`MATRICES`; an input size that is a multiple of 32) as `qtype` blocks: the
    projections as their output rows, the embedding as its rows (`rows_are_matrix`). Quantized matrices and
    everything else are kept as they are. Deterministic: the same blocks on every load."""
    out: dict[str, object] = {}
    for name, w in weights.items():
        short = name.rsplit(".", 1)[-1]
        if isinstance(w, QuantizedTensor) or short not in MATRICES or np.ndim(w) != 2:
            out[name] = w
            continue
        rows = short == "embed"  # [vocab, hidden]: quantized along hidden, row by row
        if (w.shape[1] if rows else w.shape[0]) % 32:
            out[name] = w
            continue
        a = np.asarray(w, np.float32)
        out[name] = (QuantizedTensor(qtype, quantize(a.T, qtype).data, tuple(a.shape), rows_are_matrix=True) if rows
                     else quantize(a, qtype))
    return out


def _f16(pairs: jax.Array) -> jax.Array:
    """uint8 [..., 2] -> float32 [...] (little-endian float16)."""
    return jax.lax.bitcast_convert_type(pairs, jnp.float16).astype(jnp.float32)


def dequantize(data: jax.Array, qtype: str, k: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """uint8 block rows [N, K/32 * bytes] -> the [N, K] matrix in `dtype` (XLA ops)."""
    n = data.shape[0]
    r = data.reshape(n, k // 32, BLOCK_BYTES[qtype])
    d = _f16(r[..., 0:2])[..., None]
    if qtype == "q8_0":
        w = jax.lax.bitcast_convert_type(r[..., 2:], jnp.int8).astype(jnp.float32) * d
    else:
        qs = r[..., 4:20] if qtype == "q4_1" else r[..., 2:18]
        q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.float32)
        w = q * d + _f16(r[..., 2:4])[..., None] if qtype == "q4_1" else (q - 8.0) * d
    return w.reshape(n, k).astype(dtype)


def dequantize_rows(data: jax.Array, rows: jax.Array, qtype: str, k: int, dtype: jnp.dtype) -> jax.Array:
    """Only the given rows (e.g. the embedding rows of a step's tokens): [len(rows), K]."""
    return dequantize(data[rows], qtype, k, dtype)


def native(rows: int) -> bool:
    """Whether `linear` multiplies `rows` rows with the native CPU kernels."""
    return rows <= KERNEL_MAX_ROWS and kernels.available()


def linear(x: jax.Array, data: jax.Array, qtype: str, dtype: jnp.dtype = jnp.float32,
           fill: jax.Array | None = None, tiled: jax.Array | None = None, swiglu: bool = False) -> jax.Array:
    """x [T, K] times the quantized [K, N] matrix, in x's dtype. `dtype`: what XLA's path multiplies in.
    `fill` ([T], batch.fill_rows: 1 for a prompt token's row, 0 for a generated token's, -1 for padding): where
    `dtype` is bfloat16, the native path multiplies prompt rows in bfloat16 (AMX's bf16 tiles or AVX512-BF16
    where the CPU has them), and generated rows with activations to 15 bits (2 limbs); other dtypes multiply
    every row exactly. The native path skips the trailing padding rows (zeros). `tiled`: the matrix's copy
    for the integer codes (kernels.tile_rows), read by the native products of generated rows. `swiglu`
    (the native path only, `native`): the matrix is a fused gate|up and the result silu(gate) * up
    (kernels.qmatmul)."""
    t, k = x.shape
    if native(t):
        bf16 = jnp.dtype(dtype) == jnp.bfloat16
        if fill is not None and not bf16:
            fill = jnp.minimum(fill, 0)  # exact rows throughout; padding stays marked
        return kernels.qmatmul(x, data, qtype, fill, 2 if bf16 else 3, tiled, swiglu).astype(x.dtype)
    if swiglu:
        raise ValueError("a fused silu(gate) * up runs on the native kernels only")
    w = dequantize(data, qtype, k, dtype)
    y = jax.lax.dot_general(x.astype(dtype), w, (((1,), (1,)), ((), ())), precision=exact(w),
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
