"""The native CPU kernels: paged decode attention read in place equals XLA's gather path (with and
without a shared prefix), RoPE and the KV writes are XLA's bits, and a process without the kernels falls
back with one clear reason."""

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
from parrot.engine.attention import paged_attention, to_fp8, write_kv
from parrot.engine.batch import SequenceSlice, build_batch, find_shared_prefix
from parrot.engine.models.llama import qkv_heads, rope_cos_sin

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native CPU kernels unavailable")

PS, HKV, G, D = 16, 3, 3, 64


def _xla_attention(q, kc, vc, batch, scale: float = D**-0.5):  # noqa: ANN001, ANN202
    kernels_on = kernels._state["ok"]
    kernels._state["ok"] = False  # the gather path, as on a machine without the kernels
    try:
        return np.asarray(paged_attention(q, kc, vc, batch, scale))
    finally:
        kernels._state["ok"] = kernels_on


def _cache(rng: np.random.Generator, pages: int, dtype: str = "float32") -> tuple[jax.Array, jax.Array]:
    """float32 caches, or bfloat16 ones held as uint16 bit patterns, or float8 (e4m3fn) ones as uint8 (as the
    engine stores them)."""
    shape = (HKV, pages, PS, D)

    def make(dtype: str) -> jax.Array:
        a = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        if dtype == "float8":
            return jax.lax.bitcast_convert_type(to_fp8(a), jnp.uint8)
        return a if dtype == "float32" else jax.lax.bitcast_convert_type(a.astype(jnp.bfloat16), jnp.uint16)

    if dtype == "bfloat16+float8":  # bfloat16 keys, float8 values (--v-dtype fp8)
        return make("bfloat16"), make("float8")
    return make(dtype), make(dtype)


# the --kv-dtype f32 / bf16 / fp8 caches, and bf16 keys with fp8 values (--v-dtype fp8)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8", "bfloat16+float8"])
def test_decode_in_place_equals_gather_path(dtype: str) -> None:
    rng = np.random.default_rng(0)
    kc, vc = _cache(rng, 64, dtype)
    # lengths inside a page, at a page boundary, one token, and a padding row (batch bucket 8)
    seqs = [SequenceSlice([1], n - 1, list(range(1 + 8 * i, 1 + 8 * i + -(-n // PS))))
            for i, n in enumerate([37, 64, 1, 100, 17])]
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=8, batch_size=8, q_len=1, num_pages=8))
    q = jnp.asarray(rng.standard_normal((8, HKV * G, D)).astype(np.float32))
    native = np.asarray(paged_attention(q, kc, vc, batch, D**-0.5))
    np.testing.assert_allclose(native, _xla_attention(q, kc, vc, batch), rtol=1e-5, atol=1e-6)
    assert np.all(native[len(seqs):] == 0)


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 1, 64), (1, 2, 128), (1, 4, 64), (1, 7, 48),
                                                           (2, 5, 32), (1, 3, 40)])
def test_decode_of_other_head_shapes_equals_gather_path(kv_heads: int, group: int, head_dim: int) -> None:
    """bfloat16 pages with other GQA groups and head sizes (decode_pairs.h takes groups of up to three heads
    and whole groups of 16 dimensions; 40 takes the widening code): the gather path's values, and each
    sequence's bits the same alone (in a batch of one or of eight) as in the batch."""
    rng = np.random.default_rng(11)
    shape = (kv_heads, 64, PS, head_dim)
    kc, vc = (jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), jnp.uint16)
              for _ in range(2))
    lens = [37, 64, 1, 100, 17, 200]
    pages = iter(range(1, 64))
    seqs = [SequenceSlice([1], n - 1, [next(pages) for _ in range(-(-n // PS))]) for n in lens]
    q = jnp.asarray(rng.standard_normal((8, kv_heads * group, head_dim)).astype(np.float32))

    def step(rows: list[int], size: int = 8) -> np.ndarray:
        batch = jax.device_put(build_batch([seqs[i] for i in rows], PS, num_tokens=size, batch_size=size, q_len=1,
                                           num_pages=16))
        return np.asarray(paged_attention(q[jnp.asarray(rows + [0] * (size - len(rows)))], kc, vc, batch,
                                          head_dim**-0.5)), batch

    rows = list(range(len(lens)))
    together, batch = step(rows)
    np.testing.assert_allclose(together, _xla_attention(q, kc, vc, batch, head_dim**-0.5), rtol=1e-5, atol=2e-6)
    for i in (0, 2, 5):  # alone, in a batch of one and in one of eight
        np.testing.assert_array_equal(step([i], 1)[0][0], together[i])
        np.testing.assert_array_equal(step([i])[0][0], together[i])


def test_decode_with_shared_prefix_equals_gather_path() -> None:
    rng = np.random.default_rng(1)
    kc, vc = _cache(rng, 64)
    prefix = [1, 2, 3]  # 48 tokens forked into three sequences, plus one unrelated sequence
    seqs = [SequenceSlice([5], 48 + extra, prefix + own) for extra, own in ((3, [10]), (20, [11, 12]), (0, [13]))]
    seqs.append(SequenceSlice([5], 30, [20, 21]))
    members, shared = find_shared_prefix([s.pages for s in seqs])
    for i in members:
        seqs[i].shared_pages = shared
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=4, batch_size=4, q_len=1, num_pages=2,
                                       prefix_pages=4))
    q = jnp.asarray(rng.standard_normal((4, HKV * G, D)).astype(np.float32))
    native = np.asarray(paged_attention(q, kc, vc, batch, D**-0.5))
    np.testing.assert_allclose(native, _xla_attention(q, kc, vc, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8", "bfloat16+float8"])
def test_shared_prefix_read_once_is_bit_identical_to_own_pages(dtype: str) -> None:
    """Ten forks of a 3-page prefix (more than one group of members reading a prefix page in turn): each
    sequence's output is the same bits as with the prefix pages read as its own."""
    rng = np.random.default_rng(5)
    kc, vc = _cache(rng, 64, dtype)
    prefix = [1, 2, 3]
    own = [[10 + 2 * i, 11 + 2 * i] for i in range(10)]
    lens = [48 + 1 + 3 * i for i in range(10)]  # 1-28 tokens of their own, the last one the step's

    def step(shared: bool) -> np.ndarray:
        seqs = [SequenceSlice([5], n - 1, prefix + o, shared_pages=3 if shared else 0)
                for n, o in zip(lens, own, strict=True)]
        batch = jax.device_put(build_batch(seqs, PS, num_tokens=16, batch_size=16, q_len=1,
                                           num_pages=2 if shared else 8, prefix_pages=4 if shared else 0))
        return np.asarray(paged_attention(q, kc, vc, batch, D**-0.5))

    q = jnp.asarray(rng.standard_normal((16, HKV * G, D)).astype(np.float32))
    cascade, plain = step(True), step(False)
    np.testing.assert_array_equal(cascade[:10], plain[:10])
    assert np.abs(cascade[:10]).max() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_sequences_are_the_same_bits_alone_in_a_batch_and_forked(dtype: str) -> None:
    """Sequences of 321-1,000 tokens (21-63 pages): the gather path's result to float32 rounding, and the same
    bits alone, in a batch and reading a shared prefix of 20 pages (320 tokens) once for all."""
    rng = np.random.default_rng(9)
    kc, vc = _cache(rng, 256, dtype)
    prefix = list(range(1, 21))
    lens = [321, 512, 513, 700, 336, 1000]  # past the prefix: 1-680 tokens of their own
    owned = iter(range(30, 256))
    pages = [prefix + [next(owned) for _ in range(-(-n // PS) - len(prefix))] for n in lens]
    q = jnp.asarray(rng.standard_normal((8, HKV * G, D)).astype(np.float32))

    def step(rows: list[int], shared: bool, size: int = 8) -> np.ndarray:
        seqs = [SequenceSlice([5], lens[i] - 1, pages[i], shared_pages=len(prefix) if shared else 0) for i in rows]
        batch = jax.device_put(build_batch(seqs, PS, num_tokens=size, batch_size=size, q_len=1, num_pages=64,
                                           prefix_pages=32 if shared else 0))
        return np.asarray(paged_attention(q[jnp.asarray(rows + [0] * (size - len(rows)))], kc, vc, batch, D**-0.5))

    rows = list(range(len(lens)))
    together, forked = step(rows, False), step(rows, True)
    np.testing.assert_array_equal(forked[: len(rows)], together[: len(rows)])
    for i in rows:
        np.testing.assert_array_equal(step([i], False)[0], together[i])
    for i in (1, 5):  # in a batch of one, and forked there
        np.testing.assert_array_equal(step([i], False, 1)[0], together[i])
        np.testing.assert_array_equal(step([i], True, 1)[0], together[i])
    seqs = [SequenceSlice([5], n - 1, p) for n, p in zip(lens, pages, strict=True)]
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=8, batch_size=8, q_len=1, num_pages=64))
    np.testing.assert_allclose(together, _xla_attention(q, kc, vc, batch), rtol=1e-5, atol=2e-6)


DECODE_BF16 = kernels.available() and kernels.decode_bf16()


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _values(cache: jax.Array) -> np.ndarray:
    """A cache's values (float32, bfloat16 bits or float8 bits) in float64."""
    if cache.dtype == jnp.uint16:
        cache = jax.lax.bitcast_convert_type(cache, jnp.bfloat16)
    elif cache.dtype == jnp.uint8:
        cache = jax.lax.bitcast_convert_type(cache, jnp.float8_e4m3fn)
    return np.asarray(cache.astype(jnp.float32), np.float64)


def _decode(q: jax.Array, kc: jax.Array, vc: jax.Array, batch: object, bf16: bool) -> np.ndarray:
    return np.asarray(jax.jit(lambda q, k, v, b: paged_attention(q, k, v, b, D**-0.5, bf16=bf16))(q, kc, vc, batch))


@pytest.mark.skipif(not DECODE_BF16, reason="this CPU (or this build) has no AVX512-BF16")
def test_decode_in_bf16_is_the_bf16_rounded_attention() -> None:
    """Decode steps of the bfloat16 mode over a bfloat16 cache: the scaled queries and the probabilities
    rounded to bfloat16, sums in float32 (the reference rounds the same operands). (Over a float8 cache
    they are float32's: test_decode_in_place_equals_gather_path.)"""
    rng = np.random.default_rng(6)
    kc, vc = _cache(rng, 64, "bfloat16")
    lens = [37, 64, 1, 100, 17]  # inside a page, a page boundary, one token, several pages
    seqs = [SequenceSlice([1], n - 1, list(range(1 + 8 * i, 1 + 8 * i + -(-n // PS)))) for i, n in enumerate(lens)]
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=8, batch_size=8, q_len=1, num_pages=8))
    q = rng.standard_normal((8, HKV * G, D)).astype(np.float32)
    got, exact = _decode(jnp.asarray(q), kc, vc, batch, True), _decode(jnp.asarray(q), kc, vc, batch, False)
    k, v = _values(kc), _values(vc)
    want = np.zeros((8, HKV * G, D))
    for i, (s, n) in enumerate(zip(seqs, lens, strict=True)):
        keys, vals = k[:, s.pages].reshape(HKV, -1, D)[:, :n], v[:, s.pages].reshape(HKV, -1, D)[:, :n]
        for h in range(HKV * G):
            e = np.exp((sc := keys[h // G] @ _bf16(q[i, h] * D**-0.5)) - sc.max())
            want[i, h] = _bf16(e) @ vals[h // G] / _bf16(e).sum()
    np.testing.assert_allclose(got, want, atol=2e-3)
    assert np.abs(got - exact).max() > 1e-4  # measurably not the float32 path
    assert np.all(got[len(lens):] == 0)
    try:  # switched off, the same call takes the float32 products
        assert not kernels.use_decode_bf16(False)
        np.testing.assert_array_equal(_decode(jnp.asarray(q), kc, vc, batch, True), exact)
    finally:
        kernels.use_decode_bf16(True)


@pytest.mark.skipif(not kernels.available(), reason="no native CPU kernels")
@pytest.mark.parametrize("cache", ["bfloat16", "float8"])
def test_decode_in_bf16_is_the_same_bits_alone_in_a_batch_and_with_a_shared_prefix(cache: str) -> None:
    """A sequence's bfloat16 decode attention depends only on its own query, keys and values: alone, beside
    others, and with a 3-page prefix read once for ten forks (two groups of members), the same bits."""
    rng = np.random.default_rng(7)
    kc, vc = _cache(rng, 64, cache)
    prefix = [1, 2, 3]
    own = [[10 + 2 * i, 11 + 2 * i] for i in range(10)]
    lens = [48 + 1 + 3 * i for i in range(10)]
    q = jnp.asarray(rng.standard_normal((16, HKV * G, D)).astype(np.float32))

    def step(shared: bool, which: list[int]) -> np.ndarray:
        seqs = [SequenceSlice([5], lens[i] - 1, prefix + own[i], shared_pages=3 if shared else 0) for i in which]
        batch = jax.device_put(build_batch(seqs, PS, num_tokens=16, batch_size=16, q_len=1,
                                           num_pages=2 if shared else 8, prefix_pages=4 if shared else 0))
        return _decode(q[jnp.asarray(which + [0] * (16 - len(which)))], kc, vc, batch, True)[:len(which)]

    plain, cascade = step(False, list(range(10))), step(True, list(range(10)))
    np.testing.assert_array_equal(cascade, plain)
    for i in (0, 4, 9):
        np.testing.assert_array_equal(step(False, [i])[0], plain[i])
    assert np.abs(plain).max() > 0


def _prefill(seqs: list[SequenceSlice], q: jax.Array | np.ndarray, kc: jax.Array, vc: jax.Array, q_len: int,
             batch_size: int, num_pages: int, num_tokens: int, bf16: bool = False) -> tuple[np.ndarray, object]:
    q = jnp.pad(jnp.asarray(q), ((0, num_tokens - q.shape[0]), (0, 0), (0, 0)))  # the step's padding tokens
    batch = jax.device_put(build_batch(seqs, PS, num_tokens=num_tokens, batch_size=batch_size, q_len=q_len,
                                       num_pages=num_pages))
    attend = jax.jit(lambda q, k, v, b: paged_attention(q, k, v, b, D**-0.5, bf16=bf16))
    return np.asarray(attend(q, kc, vc, batch)), batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8", "bfloat16+float8"])
def test_prefill_in_place_equals_gather_path(dtype: str) -> None:
    rng = np.random.default_rng(2)
    kc, vc = _cache(rng, 64, dtype)
    # a chunk after a cached prefix not on a page boundary, a whole prompt, a chunk of one page, and a padding
    # sequence (batch bucket 4, query bucket 64)
    seqs = [SequenceSlice(list(range(50)), 37, list(range(1, 7))),
            SequenceSlice(list(range(61)), 0, list(range(10, 14))),
            SequenceSlice(list(range(16)), 64, list(range(20, 25)))]
    q = jnp.asarray(rng.standard_normal((256, HKV * G, D)).astype(np.float32))
    native, batch = _prefill(seqs, q, kc, vc, q_len=64, batch_size=4, num_pages=8, num_tokens=256)
    np.testing.assert_allclose(native, _xla_attention(q, kc, vc, batch), rtol=1e-5, atol=1e-6)
    assert np.all(native[50 + 61 + 16:] == 0)  # tokens no query names


@pytest.mark.skipif(not kernels.bf16_fills(), reason="neither AMX bf16 tiles nor AVX512-BF16")
@pytest.mark.parametrize("cache", ["bfloat16", "float8", "bfloat16+float8"])
def test_prefill_in_bf16_is_the_bf16_rounded_attention(cache: str) -> None:
    """Prompts of the bfloat16 mode over a bfloat16 (or float8, widened) cache (AMX's bf16 tiles, or
    AVX512-BF16's pair products): the scaled queries and the probabilities rounded to bfloat16, sums in
    float32 (the reference rounds the same operands)."""
    rng = np.random.default_rng(4)
    kc, vc = _cache(rng, 64, cache)
    seqs = [SequenceSlice(list(range(50)), 37, list(range(1, 7))),
            SequenceSlice(list(range(61)), 0, list(range(10, 14)))]
    q = rng.standard_normal((111, HKV * G, D)).astype(np.float32)
    tiles, _ = _prefill(seqs, q, kc, vc, 64, 4, 8, 256, bf16=True)
    exact, _ = _prefill(seqs, q, kc, vc, 64, 4, 8, 256)

    def bf16(a: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    k, v = _values(kc), _values(vc)
    want = np.zeros((111, HKV * G, D))
    for i, (start, pages, off) in enumerate(((37, list(range(1, 7)), 0), (0, list(range(10, 14)), 50))):
        n = len(seqs[i].tokens)
        keys, vals = k[:, pages].reshape(HKV, -1, D), v[:, pages].reshape(HKV, -1, D)
        for j in range(n):
            for h in range(HKV * G):
                s = keys[h // G, : start + j + 1] @ bf16(q[off + j, h] * D**-0.5)
                e = np.exp(s - s.max())
                want[off + j, h] = bf16(e) @ vals[h // G, : start + j + 1] / e.sum()
    np.testing.assert_allclose(tiles[:111], want, atol=2e-3)
    assert np.abs(tiles[:111] - exact[:111]).max() > 1e-5  # measurably not the float32 path
    assert np.all(tiles[111:] == 0)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("cache", ["bfloat16", "float8", "bfloat16+float8"])
def test_prefill_gives_each_token_the_same_bits_in_any_chunk_or_batch(bf16: bool, cache: str) -> None:
    """A token's attention depends only on its query, position and keys: filling a prompt whole, in two
    chunks, or beside another sequence gives the same bits (the fill path is chunking invariant), on the
    float32 path and in bfloat16 (AMX's tiles or AVX512-BF16) alike, over bfloat16 and float8 caches."""
    rng = np.random.default_rng(3)
    kc, vc = _cache(rng, 64, cache)
    pages = list(range(1, 9))
    q = rng.standard_normal((120, HKV * G, D)).astype(np.float32)
    whole, _ = _prefill([SequenceSlice(list(range(120)), 0, pages)], q, kc, vc, 128, 1, 8, 128, bf16)
    head, _ = _prefill([SequenceSlice(list(range(45)), 0, pages[:3])], q[:45], kc, vc, 64, 1, 8, 64, bf16)
    tail, _ = _prefill([SequenceSlice(list(range(75)), 45, pages)], q[45:], kc, vc, 128, 1, 8, 128, bf16)
    other = rng.standard_normal((30, HKV * G, D)).astype(np.float32)
    mixed, _ = _prefill([SequenceSlice(list(range(30)), 10, list(range(30, 33))),
                         SequenceSlice(list(range(75)), 45, pages)],
                        np.concatenate([other, q[45:]]), kc, vc, 128, 2, 8, 256, bf16)
    np.testing.assert_array_equal(head[:45], whole[:45])
    np.testing.assert_array_equal(tail[:75], whole[45:120])
    np.testing.assert_array_equal(mixed[30:105], whole[45:120])


@pytest.mark.skipif(not kernels.bf16_fills(), reason="neither AMX bf16 tiles nor AVX512-BF16")
def test_prefill_in_bf16_over_long_contexts() -> None:
    """Keys that every query of a block sees in full go in runs of several blocks (the outputs kept in
    registers between them): a 420-token prompt, filled whole and in three chunks (so a token's keys fall
    in runs in one fill and block by block in another), gives every token the same bits, and the bf16-rounded
    attention."""
    rng = np.random.default_rng(8)
    kc, vc = _cache(rng, 32, "bfloat16")
    n, pages = 420, list(range(3, 30))
    q = rng.standard_normal((n, HKV * G, D)).astype(np.float32)
    whole, _ = _prefill([SequenceSlice(list(range(n)), 0, pages)], q, kc, vc, 512, 1, 27, 512, True)
    for a, b in ((0, 100), (100, 261), (261, n)):
        part, _ = _prefill([SequenceSlice(list(range(b - a)), a, pages[: -(-b // PS)])], q[a:b], kc, vc, 256, 1,
                           27, 256, True)
        np.testing.assert_array_equal(part[: b - a], whole[a:b])

    def bf16(x: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    k, v = (np.asarray(jax.lax.bitcast_convert_type(c, jnp.bfloat16).astype(jnp.float32), np.float64)[:, pages]
            .reshape(HKV, -1, D) for c in (kc, vc))
    for j in (130, 255, 300, 419):  # tokens whose keys went in runs
        for h in range(HKV * G):
            s = k[h // G, : j + 1] @ bf16(q[j, h] * D**-0.5)
            e = np.exp(s - s.max())
            np.testing.assert_allclose(whole[j, h], bf16(e) @ v[h // G, : j + 1] / e.sum(), atol=2e-3)


@pytest.mark.parametrize("bf16", [False, True])
def test_prefill_bits_do_not_depend_on_the_page_size(bf16: bool) -> None:
    """The same keys in pages of 8 positions instead of 16 (so a block's keys span pages and are gathered, not
    read as one run) give every token the same bits, on the float32 path and in bfloat16 alike."""
    rng = np.random.default_rng(5)
    kc, vc = _cache(rng, 16, "bfloat16")
    q = rng.standard_normal((150, HKV * G, D)).astype(np.float32)
    seqs16 = [SequenceSlice(list(range(70)), 45, list(range(1, 9))),
              SequenceSlice(list(range(80)), 0, list(range(9, 14)))]
    # page p of 16 positions: its first 8 in page p of 8, its last 8 in page 16 + p (not next to it)
    seqs8 = [SequenceSlice(s.tokens, s.start, [p + i for p in s.pages for i in (0, 16)]) for s in seqs16]

    def run(seqs: list[SequenceSlice], ps: int, k: jax.Array, v: jax.Array) -> np.ndarray:
        qq = jnp.pad(jnp.asarray(q), ((0, 256 - 150), (0, 0), (0, 0)))
        batch = jax.device_put(build_batch(seqs, ps, num_tokens=256, batch_size=2, q_len=128,
                                           num_pages=8 * 16 // ps))
        attend = jax.jit(lambda q, k, v, b: paged_attention(q, k, v, b, D**-0.5, bf16=bf16))
        return np.asarray(attend(qq, k, v, batch))[:150]

    halves = [jnp.concatenate([c[:, :, :8], c[:, :, 8:]], axis=1) for c in (kc, vc)]
    np.testing.assert_array_equal(run(seqs8, 8, *halves), run(seqs16, PS, kc, vc))


@pytest.mark.skipif(not kernels.bf16_fills(), reason="neither AMX bf16 tiles nor AVX512-BF16")
@pytest.mark.parametrize("d", [128, 192, 256])
def test_prefill_in_bf16_at_wider_heads(d: int) -> None:
    """Heads of 128 dimensions (Llama-3's, Qwen2's) and wider in the bfloat16 mode: the bf16-rounded
    attention, and a prompt filled whole or in two chunks gives every token the same bits."""
    hkv, g, ps = 2, 2, 16
    rng = np.random.default_rng(6)

    def cache() -> jax.Array:
        a = jnp.asarray(rng.standard_normal((hkv, 12, ps, d)).astype(np.float32))
        return jax.lax.bitcast_convert_type(a.astype(jnp.bfloat16), jnp.uint16)

    kc, vc = cache(), cache()
    pages = list(range(1, 11))
    q = rng.standard_normal((150, hkv * g, d)).astype(np.float32)

    def fill(seq: SequenceSlice, qs: np.ndarray, q_len: int) -> np.ndarray:
        qq = jnp.pad(jnp.asarray(qs), ((0, q_len - len(qs)), (0, 0), (0, 0)))
        batch = jax.device_put(build_batch([seq], ps, num_tokens=q_len, batch_size=1, q_len=q_len, num_pages=10))
        attend = jax.jit(lambda q, k, v, b: paged_attention(q, k, v, b, d**-0.5, bf16=True))
        return np.asarray(attend(qq, kc, vc, batch))[: len(qs)]

    whole = fill(SequenceSlice(list(range(150)), 0, pages), q, 256)
    head = fill(SequenceSlice(list(range(70)), 0, pages[:5]), q[:70], 128)
    tail = fill(SequenceSlice(list(range(80)), 70, pages), q[70:], 128)
    np.testing.assert_array_equal(head, whole[:70])
    np.testing.assert_array_equal(tail, whole[70:])

    def bf16(a: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    k, v = (np.asarray(jax.lax.bitcast_convert_type(c, jnp.bfloat16).astype(jnp.float32), np.float64)[:, pages]
            .reshape(hkv, -1, d) for c in (kc, vc))
    want = np.zeros((150, hkv * g, d))
    for j in range(150):
        for h in range(hkv * g):
            sc = k[h // g, : j + 1] @ bf16(q[j, h] * d**-0.5)
            e = np.exp(sc - sc.max())
            want[j, h] = bf16(e) @ v[h // g, : j + 1] / e.sum()
    np.testing.assert_allclose(whole, want, atol=2e-3)


@pytest.mark.parametrize("d", [80, 128])
def test_prefill_in_float32_at_other_head_sizes(d: int) -> None:
    """float32 over a float32 cache at head sizes other than 64 (128: Llama-3's; 80: rows in the lanes
    with the AVX2 code, tiles of keys with AVX-512's), a 300-token prompt (runs of whole blocks): the exact
    attention, and the same bits filled whole or in two chunks."""
    hkv, g, ps, n = 2, 2, 16, 300
    rng = np.random.default_rng(9)
    kc, vc = (jnp.asarray(rng.standard_normal((hkv, 20, ps, d)).astype(np.float32)) for _ in range(2))
    pages = list(range(1, 20))
    q = rng.standard_normal((n, hkv * g, d)).astype(np.float32)

    def fill(start: int, stop: int, q_len: int) -> np.ndarray:
        qq = jnp.pad(jnp.asarray(q[start:stop]), ((0, q_len - (stop - start)), (0, 0), (0, 0)))
        seq = SequenceSlice(list(range(stop - start)), start, pages[: -(-stop // ps)])
        batch = jax.device_put(build_batch([seq], ps, num_tokens=q_len, batch_size=1, q_len=q_len, num_pages=19))
        attend = jax.jit(lambda q, k, v, b: paged_attention(q, k, v, b, d**-0.5))
        return np.asarray(attend(qq, kc, vc, batch))[: stop - start]

    whole = fill(0, n, 512)
    np.testing.assert_array_equal(fill(0, 130, 256), whole[:130])
    np.testing.assert_array_equal(fill(130, n, 256), whole[130:])
    k, v = (np.asarray(c, np.float64)[:, pages].reshape(hkv, -1, d) for c in (kc, vc))
    for j in (0, 131, 299):
        for h in range(hkv * g):
            sc = k[h // g, : j + 1] @ (q[j, h].astype(np.float64) * d**-0.5)
            e = np.exp(sc - sc.max())
            np.testing.assert_allclose(whole[j, h], e @ v[h // g, : j + 1] / e.sum(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache", ["bfloat16", "float32", "float8", "bfloat16+float8"])
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("d", [64, 40])
def test_rope_kv_is_xlas_rope_and_kv_writes(cache: str, rows: int, d: int) -> None:
    """kernels.rope_kv (RoPE of q and k, k and v stored at their slots) is the same bits as XLA's code of
    qkv_heads and write_kv: heads of 64 and of 40 (a tail past the vectors), float32 and bfloat16 caches
    (rounded to nearest even: ties, NaN, infinities, subnormals), padding rows sharing the scratch slot;
    a slot outside the caches is an error, not a write somewhere else."""
    rng = np.random.default_rng(rows + d)
    h, hkv = 6, 2
    x = (rng.standard_normal((rows, (h + 2 * hkv) * d)) * 3).astype(np.float32)
    x[0, (h + hkv) * d : (h + hkv) * d + 7] = [1.00390625, 1.01171875, -3.0e38, np.inf, 1e-40, np.nan, -0.0]
    qkv = jnp.asarray(x)
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 5000, rows).astype(np.int32)), d, 100000.0)
    slots = rng.permutation(8 * 16)[:rows].astype(np.int32)
    slots[rows // 2 :] = 0 if rows > 2 else slots[rows // 2 :]  # padding rows: the scratch slot
    slots = jnp.asarray(slots)
    kd, _, vd = cache.partition("+")
    dts = {"bfloat16": jnp.uint16, "float32": jnp.float32, "float8": jnp.uint8}
    kc, vc = jnp.zeros((hkv, 8, 16, d), dts[kd]), jnp.ones((hkv, 8, 16, d), dts[vd or kd])

    class Cfg:
        head_dim = d

    def xla(qkv, cos, sin, slots, kc, vc):  # noqa: ANN001, ANN202
        q, k, v = qkv_heads(Cfg, qkv, h, hkv, cos, sin)
        return q, write_kv(kc, k, slots), write_kv(vc, v, slots)

    want = jax.jit(xla)(qkv, cos, sin, slots, kc, vc)
    got = jax.jit(lambda *a: kernels.rope_kv(*a, h))(qkv, cos, sin, slots, kc, vc)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if rows > 2:  # rows sharing the scratch slot: any of them may be the one stored there
            g, w = g.copy(), w.copy()
            if g.ndim == 4:
                g[:, 0, 0], w[:, 0, 0] = 0, 0
        bits = {np.dtype(np.float32): np.uint32, np.dtype(np.uint16): np.uint16, np.dtype(np.uint8): np.uint8}
        assert np.array_equal(g.view(bits[g.dtype]), w.view(bits[w.dtype]))
    with pytest.raises(Exception, match="slot out of range"):
        jax.block_until_ready(kernels.rope_kv(qkv, cos, sin, jnp.full(rows, 8 * 16, jnp.int32), kc, vc, h))


def test_turned_off_gives_the_reason() -> None:
    code = "from parrot.engine import kernels; print(kernels.available(), kernels.unavailable_reason())"
    env = dict(os.environ, PARROT_CPU_KERNELS="0", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False turned off by PARROT_CPU_KERNELS=0"
    assert "native CPU kernels unavailable" in out.stderr  # one warning


def test_build_failure_falls_back(tmp_path) -> None:  # noqa: ANN001
    code = "from parrot.engine import kernels; print(kernels.available())"
    env = dict(os.environ, PARROT_KERNEL_DIR=str(tmp_path), CXX="/nonexistent/c++", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"
    assert "native CPU kernels unavailable" in out.stderr


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_lazy_zeros_read_as_zeros_and_take_memory_only_where_written() -> None:
    shape = (2, 4096, 16, 64)  # 16 MB each of uint16, 128 MB in all
    make = jax.jit(lambda: kernels.lazy_zeros([jax.ShapeDtypeStruct(shape, jnp.uint16)] * 8))
    jax.block_until_ready(make())  # compiled and run once: the compile's memory is not counted below
    before = _rss_mb()
    pool = make()
    jax.block_until_ready(pool)
    assert _rss_mb() - before < 32  # not 128 MB
    write = jax.jit(lambda k: k.at[:, 7].set(jnp.uint16(5)), donate_argnums=0)
    ptr = pool[0].unsafe_buffer_pointer()
    k = write(pool[0])
    assert k.unsafe_buffer_pointer() == ptr  # updated in place, as the engine's steps update the pool
    assert int(k[0, 7, 0, 0]) == 5 and int(jnp.sum(k[:, 7] != 5)) == 0
    assert int(jnp.max(k[:, :7])) == 0 and int(jnp.max(k[:, 8:])) == 0
    assert all(int(jnp.max(p)) == 0 for p in pool[1:])
    odd = jax.jit(lambda: kernels.lazy_zeros([jax.ShapeDtypeStruct((3, 1001), jnp.float32)]))()[0]
    assert float(jnp.max(jnp.abs(odd))) == 0.0  # partial pages at both ends written as zeros


def test_released_pages_give_their_memory_back_and_the_others_keep_theirs() -> None:
    """`release_pages` in place (the caches donated): the marked pages' whole OS pages are given back (the
    process's resident memory falls by about their bytes; they read as zeros), the other pages keep their
    values, and an OS page a marked page shares with an unmarked one keeps its bytes."""
    shape = (2, 4096, 16, 64)  # 2 KV heads of 4,096 pages of 4 KiB (float32): 32 MiB a cache, 64 MiB in all
    pool = jax.jit(lambda: kernels.lazy_zeros([jax.ShapeDtypeStruct(shape, jnp.float32)] * 2))()
    fill = jax.jit(lambda cs: [c + jnp.arange(1, 4097, dtype=jnp.float32)[None, :, None, None] for c in cs],
                   donate_argnums=0)
    release = jax.jit(kernels.release_pages, donate_argnums=1)
    keep = np.zeros(4096, bool)
    keep[[0, 1, 2, 100, 2000, 4095]] = True
    jax.block_until_ready(release(jnp.zeros(4096, jnp.uint8), fill(pool)))  # compiled once, outside the count
    pool = fill(jax.jit(lambda: kernels.lazy_zeros([jax.ShapeDtypeStruct(shape, jnp.float32)] * 2))())
    jax.block_until_ready(pool)
    ptrs = [c.unsafe_buffer_pointer() for c in pool]
    before = _rss_mb()
    pool = release(jnp.asarray(~keep, jnp.uint8), pool)
    jax.block_until_ready(pool)
    assert before - _rss_mb() > 48  # of the 64 MiB written, all but the kept pages' OS pages
    assert [c.unsafe_buffer_pointer() for c in pool] == ptrs  # in place
    want = np.arange(1, 4097, dtype=np.float32)
    for c in pool:
        a = np.asarray(c)
        for p in np.flatnonzero(keep):
            assert (a[:, p] == want[p]).all()  # kept pages keep every value
        inner = a[:, 10:90].reshape(2, -1)[:, 1024:-1024]  # inside a run of released pages: whole OS pages
        assert not inner.any()
        values = set(np.unique(a).tolist())
        assert values <= {0.0, *want[keep].tolist(), *want[~keep].tolist()}  # nothing else was written
    whole = fill(jax.jit(lambda: kernels.lazy_zeros([jax.ShapeDtypeStruct(shape, jnp.float32)]))())
    copied = jax.jit(kernels.release_pages)(jnp.asarray(~keep, jnp.uint8), whole)[0]  # not donated: on XLA's copy
    assert (np.asarray(whole[0])[:, :, 0, 0] == want).all()  # the operand keeps every page
    assert (np.asarray(copied)[:, keep, 0, 0] == want[keep]).all() and not np.asarray(copied)[:, 10:90, 1:].any()


@pytest.mark.parametrize("team", [True, False])
def test_concurrent_calls_share_the_helper_threads_safely(team: bool) -> None:
    """Kernel calls from several threads at once (two engines in one process, XLA running calls side by
    side): one at a time takes the kernels' own helper threads, the others split their work over XLA's
    pool, and every result is what the call gives alone. Also with the team off."""
    import concurrent.futures

    from parrot.engine import quant

    q = quant.quantize((np.random.default_rng(0).standard_normal((576, 200)) * 0.05).astype(np.float32), "q4_1")
    d = jnp.asarray(q.data)
    tiled = quant.tiled(q)
    t = None if tiled is None else jnp.asarray(tiled)
    f = jax.jit(lambda x, d, t: kernels.qmatmul(x, d, "q4_1", None, 2, t))
    xs = [np.random.default_rng(i).standard_normal((1 + i % 16, 576)).astype(np.float32) for i in range(24)]
    before = kernels.team()
    assert kernels.use_team(team) == team
    try:
        alone = [np.asarray(f(x, d, t)) for x in xs]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(5):
                got = list(pool.map(lambda x: np.asarray(f(x, d, t)), xs))
                for a, b in zip(alone, got, strict=True):
                    np.testing.assert_array_equal(a, b)
    finally:
        kernels.use_team(before)


def test_the_helper_threads_are_named() -> None:
    """The kernels' own helper threads show as `parrot-team` (`top -H`, /proc/<pid>/task/*/comm), not as
    `python`, so a thread's CPU time can be told from XLA's and the engine's."""
    from pathlib import Path

    from parrot import procinfo
    from parrot.engine import quant

    if procinfo.usable_cores() < 2:
        pytest.skip("one core: the kernels start no helper threads")
    q = quant.quantize((np.random.default_rng(1).standard_normal((576, 64)) * 0.05).astype(np.float32), "q4_1")
    tiled = quant.tiled(q)
    before = kernels.team()
    assert kernels.use_team(True)
    try:
        x = np.ones((1, 576), np.float32)  # one row: a decode step's call, which the team takes
        jax.block_until_ready(jax.jit(lambda x: kernels.qmatmul(
            x, jnp.asarray(q.data), "q4_1", None, 2, None if tiled is None else jnp.asarray(tiled)))(x))
    finally:
        kernels.use_team(before)
    names = [(t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    assert "parrot-team" in names


def test_units_hold_every_part_once() -> None:
    source = kernels.SOURCE.read_text()
    for cores, units in kernels.UNITS.items():
        parts = [p for unit in units for p in unit]
        assert sorted(parts) == sorted(set(parts)) == ["Q4_0", "Q4_1", "Q8_0", "REST"], cores
        assert all(f"PARROT_PART_{p}" in source for p in parts)


@pytest.mark.parametrize("cores", [2, 4])
def test_the_units_link_into_every_entry_point(tmp_path, monkeypatch, cores: int) -> None:  # noqa: ANN001
    import ctypes

    monkeypatch.setattr(kernels, "CXXFLAGS", tuple("-O0" if f == "-O3" else f for f in kernels.CXXFLAGS))
    lib_path = tmp_path / "cpu_kernels.so"
    kernels._build(lib_path, kernels.UNITS[cores])
    lib = ctypes.CDLL(str(lib_path))
    for symbol in kernels._TARGETS.values():
        assert getattr(lib, symbol) is not None
    lib.parrot_team_enable.argtypes = lib.parrot_tiled_enable.argtypes = [ctypes.c_int]
    assert lib.parrot_tiled_enable(-1) == 1
    assert lib.parrot_tiled_enable(0) == 0 and lib.parrot_tiled_enable(-1) == 0  # one switch, whichever unit
    assert not list(tmp_path.glob(".build-*"))  # the units' objects went with their directory


def test_stale_builds_are_removed(tmp_path) -> None:  # noqa: ANN001
    old, new, old_file = tmp_path / ".build-old", tmp_path / ".build-new", tmp_path / ".build-x.so"
    old.mkdir(), new.mkdir(), old_file.write_bytes(b"")
    (old / "unit0.o").write_bytes(b"")
    hours_ago = kernels.time.time() - 2 * kernels.STALE_BUILD_S
    os.utime(old, (hours_ago, hours_ago)), os.utime(old_file, (hours_ago, hours_ago))
    kernels._remove_stale_builds(tmp_path)
    assert not old.exists() and not old_file.exists() and new.exists()


def test_processes_starting_at_once_build_once(tmp_path) -> None:  # noqa: ANN001
    import threading

    path, built = tmp_path / "cpu_kernels.so", []

    def build(p) -> None:  # noqa: ANN001
        built.append(threading.current_thread().name)
        kernels.time.sleep(0.3)  # the others arrive while this one builds
        p.write_bytes(b"library")

    threads = [threading.Thread(target=kernels._build_once, args=(path, build), name=f"t{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and path.read_bytes() == b"library"
    kernels._build_once(path, build)  # there: nothing to do
    assert len(built) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_compilers_end_with_a_process_killed_while_building(tmp_path) -> None:  # noqa: ANN001
    """A server killed (SIGKILL) mid-build leaves no compiler running."""
    import signal
    import time

    pids = tmp_path / "pids"
    fake = tmp_path / "fake-cxx"  # a "compiler" that records its pid and works for a minute
    fake.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 60\n")
    fake.chmod(0o755)
    code = (f"from pathlib import Path; from parrot.engine import kernels; "
            f"kernels._build(Path({str(tmp_path / 'k.so')!r}), kernels.UNITS[2])")
    env = dict(os.environ, CXX=str(fake), JAX_PLATFORMS="cpu", PARROT_CPU_KERNELS="0")
    builder = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline and builder.poll() is None, "the build did not start its compilers"
        time.sleep(0.05)
    compilers = [int(p) for p in pids.read_text().split()]
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() and "Z" not in _proc_state(p) for p in compilers):
        assert time.monotonic() < deadline, "a compiler outlived the process that started it"
        time.sleep(0.05)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_fp8_writes_round_as_xla_converts() -> None:
    """The native KV writes of a float8 cache give XLA's bits (attention.to_fp8: clipped to +-448, rounded to
    nearest even) for every e4m3 value, every midpoint between two and its neighbours, subnormals, values
    past 448 and at random scales; and the kernels read every e4m3 value back exactly."""
    f8 = jnp.float8_e4m3fn
    every = np.asarray(jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), f8).astype(jnp.float32))
    every = every[np.isfinite(every)]
    srt = np.unique(every)
    mids = ((srt[1:].astype(np.float64) + srt[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(8)
    vals = np.concatenate([every, mids, np.nextafter(mids, np.float32(-1e9)), np.nextafter(mids, np.float32(1e9)),
                           [449.0, -500.0, 1e30, -np.inf, 2.0**-10, -(2.0**-10), 3 * 2.0**-11, 1e-40],
                           *(rng.standard_normal(1024).astype(np.float32) * s for s in (1e-3, 0.05, 1.0, 30.0))])
    d, rows = 64, -(-len(vals) // 64)
    v = np.zeros(rows * d, np.float32)
    v[: len(vals)] = vals
    qkv = np.zeros((rows, 3 * d), np.float32)
    qkv[:, 2 * d :] = v.reshape(rows, d)  # one query head, one KV head: the values are stored as they are
    cos, sin = rope_cos_sin(jnp.zeros(rows, jnp.int32), d, 100000.0)
    slots = jnp.arange(1, rows + 1, dtype=jnp.int32) * 16  # row r: slot 0 of page r + 1
    kc = vc = jnp.zeros((1, rows + 1, 16, d), jnp.uint8)
    _, _, got = kernels.rope_kv(jnp.asarray(qkv), cos, sin, slots, kc, vc, 1)
    want = write_kv(vc, jnp.asarray(v.reshape(rows, 1, d)), slots)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    # read back by the decode kernel: a one-token sequence on page r + 1 gets its value row as its output
    stored = np.asarray(jax.lax.bitcast_convert_type(got[0, 1:, 0], f8).astype(jnp.float32))  # [rows, d]
    seqs = [SequenceSlice([0], 0, [r + 1]) for r in range(rows)]
    bucket = -(-rows // 8) * 8
    batch = jax.device_put(build_batch(seqs, 16, num_tokens=bucket, batch_size=bucket, q_len=1, num_pages=1))
    out = paged_attention(jnp.zeros((bucket, 1, d), jnp.float32), got, got, batch, d**-0.5)
    assert np.array_equal(np.asarray(out)[:rows, 0], stored)
