"""This machine's floors, measured in the same run as the benchmark they bound."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def memory_bandwidth_gbs(size_mb: int = 1024, repeats: int = 7) -> float:
    """Read bandwidth: a jitted sum over a float32 array much larger than the caches."""
    x = jnp.ones(size_mb * 2**20 // 4, jnp.float32)
    f = jax.jit(jnp.sum)
    t = _median_seconds(lambda: f(x).block_until_ready(), repeats)
    return size_mb * 2**20 / t / 1e9


def gemm_gflops(n: int = 2048, repeats: int = 7) -> float:
    """fp32 matrix-multiply peak through XLA (the path the model's prefill takes)."""
    a = jnp.ones((n, n), jnp.float32)
    b = jnp.ones((n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    t = _median_seconds(lambda: f(a, b).block_until_ready(), repeats)
    return 2 * n**3 / t / 1e9


def measure() -> dict[str, float]:
    return {"memory_read_gbs": memory_bandwidth_gbs(), "gemm_fp32_gflops": gemm_gflops()}
