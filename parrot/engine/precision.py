"""Precision of matrix products: float32 mode is float32 on every backend.

GPUs multiply float32 matrices in TF32 (10-bit mantissas) by default, so a float32 engine would not
match float32 references there. Every product whose operands are all float32 asks for HIGHEST precision
(on a CPU that is what it does anyway); bfloat16 products keep the backend's default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def exact(*arrays: jax.Array) -> jax.lax.Precision | None:
    """HIGHEST when every operand is float32, else None (the backend's default)."""
    return jax.lax.Precision.HIGHEST if all(a.dtype == jnp.float32 for a in arrays) else None
