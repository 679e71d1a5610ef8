"""Paged attention against a dense reference; shared-prefix (cascade) attention equals ordinary attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine.attention import paged_attention
from parrot.engine.batch import SequenceSlice, build_batch, find_shared_prefix

PS, HKV, G, D = 4, 2, 3, 8
H = HKV * G


def dense_reference(q, keys, values, positions, scale):  # noqa: ANN001, ANN201
    """q: [n, H, D] for tokens at `positions`, keys/values: [L, Hkv, D] of the whole sequence."""
    out = np.zeros_like(q)
    for i, pos in enumerate(positions):
        for h in range(H):
            k = keys[: pos + 1, h // G]
            s = (k @ q[i, h]) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ values[: pos + 1, h // G]
    return out


def make_cache(rng, num_pages):  # noqa: ANN001, ANN202
    k = rng.standard_normal((HKV, num_pages, PS, D)).astype(np.float32)  # the engine's layout
    v = rng.standard_normal((HKV, num_pages, PS, D)).astype(np.float32)
    return k, v


def seq_kv(cache, pages, n):  # noqa: ANN001, ANN202
    return cache[:, np.asarray(pages)].reshape(HKV, -1, D)[:, :n].transpose(1, 0, 2)  # [n, Hkv, D]


@pytest.mark.parametrize("q_len", [1, 5])
def test_paged_attention_matches_dense(q_len: int) -> None:
    rng = np.random.default_rng(q_len)
    kc, vc = make_cache(rng, 40)
    seqs = [SequenceSlice([0] * q_len, start, pages) for start, pages in
            [(3, [5, 9]), (10, [1, 2, 3, 4]), (0, [7, 8])]]
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=16, batch_size=4, q_len=8, num_pages=6))
    q = rng.standard_normal((16, H, D)).astype(np.float32)
    out = np.asarray(paged_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), batch, D**-0.5))
    off = 0
    for s in seqs:
        n = s.start + q_len
        ref = dense_reference(q[off : off + q_len], seq_kv(kc, s.pages, n), seq_kv(vc, s.pages, n),
                              range(s.start, n), D**-0.5)
        np.testing.assert_allclose(out[off : off + q_len], ref, atol=1e-5)
        off += q_len
    assert np.all(out[off:] == 0)  # padding tokens


def test_shared_prefix_attention_equals_ordinary_attention() -> None:
    rng = np.random.default_rng(0)
    kc, vc = make_cache(rng, 64)
    prefix = [10, 11, 12, 13, 14]  # 5 shared full pages = 20 tokens
    own = [[20, 21], [30], [40, 41, 42], [50, 51]]
    lens = [27, 22, 31, 25]  # each beyond the prefix
    page_lists = [prefix + o for o in own] + [[60, 61, 62]]  # the last one is not a fork
    lens.append(9)
    members, shared = find_shared_prefix(page_lists)
    assert members == [0, 1, 2, 3] and shared == 5
    q = rng.standard_normal((8, H, D)).astype(np.float32)

    def run(cascade: bool) -> np.ndarray:
        seqs = [SequenceSlice([0], n - 1, pages, shared_pages=shared if cascade and i in members else 0)
                for i, (pages, n) in enumerate(zip(page_lists, lens, strict=True))]
        num_pages = 4 if cascade else 8
        batch = jax.device_put(build_batch(seqs, PS, num_tokens=8, batch_size=8, q_len=1, num_pages=num_pages,
                                           prefix_pages=8 if cascade else 0))
        return np.asarray(paged_attention(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), batch, D**-0.5))

    plain, cascade = run(False), run(True)
    np.testing.assert_allclose(cascade, plain, atol=1e-5, rtol=1e-5)
    for i, (pages, n) in enumerate(zip(page_lists, lens, strict=True)):
        ref = dense_reference(q[i : i + 1], seq_kv(kc, pages, n), seq_kv(vc, pages, n), [n - 1], D**-0.5)
        np.testing.assert_allclose(cascade[i : i + 1], ref, atol=1e-5)


def test_find_shared_prefix_picks_largest_saving() -> None:
    lists = [[1, 2, 3, 9], [1, 2, 3, 8], [4, 5, 6], [4, 5, 7], [4, 5, 11]]
    # group {0,1}: 1 x 3 pages saved; group {2,3,4}: 2 x 2 pages saved
    assert find_shared_prefix(lists) == ([2, 3, 4], 2)
    assert find_shared_prefix([[1, 2], [3, 4]]) == ([], 0)
    # never the whole list: each member keeps its own last page
    assert find_shared_prefix([[1, 2], [1, 2, 3]]) == ([0, 1], 1)
