"""Paged attention against a dense reference; shared-prefix (cascade) attention equals ordinary attention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import kernels
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


def test_fused_decode_attention_matches_dense() -> None:
    """`fused` decode steps (scores and outputs as reductions over KV rows read through the block table, no
    gathered copy; a bfloat16 cache, which no CPU kernel reads in place) against the dense reference of
    the same bfloat16 keys and values; padding rows stay zero."""
    rng = np.random.default_rng(7)
    kc, vc = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in make_cache(rng, 40))
    seqs = [SequenceSlice([0], start, pages) for start, pages in
            [(6, [5, 9]), (13, [1, 2, 3, 4]), (0, [7]), (2, [8])]]
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=6, batch_size=6, q_len=1, num_pages=6))
    q = rng.standard_normal((6, H, D)).astype(np.float32)
    k16, v16 = jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16)
    out = np.asarray(paged_attention(jnp.asarray(q), k16, v16, batch, D**-0.5, fused=True))
    for i, s in enumerate(seqs):
        n = s.start + 1
        ref = dense_reference(q[i : i + 1], seq_kv(kc, s.pages, n), seq_kv(vc, s.pages, n), [s.start], D**-0.5)
        np.testing.assert_allclose(out[i : i + 1], ref, atol=1e-5)
    assert np.all(out[len(seqs):] == 0)  # padding rows
    gathered = np.asarray(paged_attention(jnp.asarray(q), k16, v16, batch, D**-0.5))
    np.testing.assert_allclose(out, gathered, atol=2e-2)  # XLA's gathered lowering, bfloat16 products


FUSED_ENGINE = """
from parrot.engine.engine import LLMEngine
from parrot.protocol import SamplingParams
from tests.conftest import tiny_engine_config, tiny_model
from tests.engine.test_engine import gen_many

runs = [dict(max_tokens=n, ignore_eos=True) for n in (5, 9, 14)]
out = []
for mode in ("xla", "fused"):
    eng = LLMEngine(tiny_model(), tiny_engine_config(decode_attention=mode, kv_dtype="f32")).start(precompile=False)
    assert eng.runner.decode_fused == (mode == "fused") and not eng.runner.prefill_in_place
    out.append([r.token_ids for r in gen_many(eng, mode, runs)])
    eng.shutdown()
assert out[0] == out[1], out
print("same tokens", sum(map(len, out[1])))
"""


def test_an_engine_decoding_with_fused_attention_gives_the_same_tokens() -> None:
    """`decode_attention="fused"` through the engine (a CPU without the native kernels, so attention is XLA's
    there as on a GPU): greedy tokens of a batch equal XLA's gathered lowering's, in float32."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PARROT_CPU_KERNELS="0", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", FUSED_ENGINE], capture_output=True, text=True, env=env, timeout=600,
                       cwd=root)
    assert r.returncode == 0 and "same tokens 28" in r.stdout, r.stderr[-3000:]


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


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are not available")
@pytest.mark.parametrize("bf16", [False, True])
def test_a_mixed_step_gives_decode_rows_a_decode_steps_bits(bf16: bool) -> None:
    """Decode rows beside prompt chunks in one step (one generated token each) get exactly what a decode step
    gives them, and the prompt chunks exactly what a prefill step gives them: batching never changes results."""
    d = 64  # the bfloat16 kernels' head sizes
    rng = np.random.default_rng(3)
    shape = (HKV, 48, PS, d)
    kc, vc = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    if bf16:  # the engine's bfloat16 cache: uint16 bit patterns
        kc, vc = (jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.bfloat16), jnp.uint16) for a in (kc, vc))
    kc, vc = jnp.asarray(kc), jnp.asarray(vc)
    decode = [SequenceSlice([0], 13, [1, 2, 3, 4]), SequenceSlice([0], 6, [5, 6]),
              SequenceSlice([0], 21, [7, 8, 9, 10, 11, 12])]
    prompts = [SequenceSlice([0] * 7, 9, [20, 21, 22, 23], fill=True), SequenceSlice([0] * 3, 0, [30], fill=True)]
    q = rng.standard_normal((32, H, d)).astype(np.float32)

    def run(seqs: list[SequenceSlice], rows: list[int], tokens: int, batch_size: int, q_len: int) -> np.ndarray:
        batch = jax.device_put(build_batch(seqs, PS, tokens, batch_size, q_len, 8))
        qq = np.zeros((tokens, H, d), np.float32)
        qq[: len(rows)] = q[rows]
        return np.asarray(paged_attention(jnp.asarray(qq), kc, vc, batch, d**-0.5, bf16=bf16))[: len(rows)]

    alone = run(decode, [0, 1, 2], 4, 4, 1)  # a decode step
    filled = run(prompts, list(range(3, 13)), 16, 4, 16)  # a prefill step
    mixed = run(decode + prompts, list(range(13)), 16, 8, 16)  # both kinds in one step
    np.testing.assert_array_equal(mixed[:3], alone)
    np.testing.assert_array_equal(mixed[3:], filled)
