"""The GPU decode kernel's wrapper (run in Pallas' interpreter here) against XLA's paged attention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import gpu_attention
from parrot.engine.attention import paged_attention
from parrot.engine.batch import SequenceSlice, build_batch

PS, HKV, G, D = 16, 2, 4, 64
H = HKV * G


@pytest.mark.parametrize("pages", [1, 2, 8, 24, 32, 40, 256])
def test_block_sizes_divide_the_block_table(pages: int) -> None:
    splits, per_block = gpu_attention.block_sizes(pages)
    assert pages % splits == 0 and (pages // splits) % per_block == 0
    assert splits & (splits - 1) == 0 and per_block & (per_block - 1) == 0  # powers of two
    assert splits <= gpu_attention.MAX_SPLITS and per_block <= gpu_attention.MAX_PAGES_PER_BLOCK


@pytest.mark.parametrize("group", [1, 4])
def test_kernel_equals_xla_decode_attention(monkeypatch: pytest.MonkeyPatch, group: int) -> None:
    """A decode batch with sequences of different lengths (one of them shorter than a page) and padding
    rows: the kernel's output equals XLA's lowering to bfloat16 rounding, and padding rows are zeros."""
    monkeypatch.setattr(gpu_attention, "paged_decode", functools.partial(gpu_attention.paged_decode, interpret=True))
    heads = HKV * group
    rng = np.random.default_rng(group)
    k = jnp.asarray(rng.standard_normal((HKV, 60, PS, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((HKV, 60, PS, D)), jnp.bfloat16)
    seqs = [SequenceSlice([1], start, pages) for start, pages in
            [(100, list(range(1, 8))), (3, [9]), (40, [20, 31, 12])]]
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=4, batch_size=4, q_len=1, num_pages=8))
    q = jnp.asarray(rng.standard_normal((4, heads, D)), jnp.bfloat16)
    want = np.asarray(paged_attention(q, k, v, batch, D**-0.5), np.float32)
    got = np.asarray(paged_attention(q, k, v, batch, D**-0.5, gpu_kernel=True), np.float32)
    np.testing.assert_allclose(got[:3], want[:3], atol=3e-2, rtol=3e-2)
    assert np.all(got[3] == 0)


def test_unavailable_off_gpus() -> None:
    if jax.default_backend() == "gpu":
        pytest.skip("this backend is a GPU")
    assert gpu_attention.available() is False
