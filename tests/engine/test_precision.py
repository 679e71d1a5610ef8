"""float32 mode asks for float32 products on every backend (GPUs default to TF32); bf16 keeps the default."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parrot.engine.models.llama import matmul
from parrot.engine.precision import exact


def test_float32_products_ask_for_highest_precision() -> None:
    x32, w32 = jnp.ones((2, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)
    assert exact(x32, w32) is jax.lax.Precision.HIGHEST
    assert exact(x32.astype(jnp.bfloat16), w32) is None
    hlo = jax.jit(matmul).lower(x32, w32).as_text()
    assert "HIGHEST" in hlo
    hlo16 = jax.jit(matmul).lower(x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)).as_text()
    assert "HIGHEST" not in hlo16
