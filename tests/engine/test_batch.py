"""ForwardBatch packing: one int32 vector to the device, unpacked there into the same arrays."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from parrot.engine.batch import SequenceSlice, build_batch, pack, unpack


@pytest.mark.parametrize("prefix_pages", [0, 2])
def test_pack_then_unpack_gives_the_batch(prefix_pages: int) -> None:
    if prefix_pages:  # the cascade layout: decoding sequences that share their first pages
        seqs = [SequenceSlice([5], 40, [3, 4, 9], 2), SequenceSlice([8], 35, [3, 4, 1], 2)]
        batch = build_batch(seqs, 16, 4, 4, 1, 2, prefix_pages)
    else:  # a prefill step: several tokens per sequence, padding rows and tokens
        seqs = [SequenceSlice([5, 6, 7], 30, [3, 4, 9]), SequenceSlice([8], 4, [1])]
        batch = build_batch(seqs, 16, 16, 4, 4, 4)
    packed = pack(batch)
    assert packed.dtype == np.int32 and packed.ndim == 1
    got = jax.jit(lambda p: unpack(p, batch))(packed)
    for name in batch.__dataclass_fields__:
        want, have = np.asarray(getattr(batch, name)), np.asarray(getattr(got, name))
        assert have.shape == want.shape and have.dtype == want.dtype, name
        np.testing.assert_array_equal(have, want, err_msg=name)


def test_padding_is_marked_for_the_products_and_the_head_to_skip() -> None:
    seqs = [SequenceSlice([5, 6, 7], 30, [3, 4, 9], fill=True), SequenceSlice([8], 4, [1])]
    batch = build_batch(seqs, 16, 8, 4, 4, 4)
    np.testing.assert_array_equal(batch.fill_rows, [1, 1, 1, 0, -1, -1, -1, -1])  # prompt, generated, padding
    np.testing.assert_array_equal(batch.logits_index, [2, 3, -1, -1])


def _reference(seqs: list[SequenceSlice], page_size: int, num_tokens: int, batch_size: int, q_len: int,
               num_pages: int, prefix_pages: int) -> dict[str, np.ndarray]:
    """What build_batch must give, a sequence and a token at a time."""
    out = {"input_ids": np.zeros(num_tokens), "positions": np.zeros(num_tokens), "slot_mapping": np.zeros(num_tokens),
           "q_index": np.full((batch_size, q_len), num_tokens), "block_tables": np.zeros((batch_size, num_pages)),
           "kv_offset": np.zeros(batch_size), "kv_lens": np.zeros(batch_size), "logits_index": np.full(batch_size, -1),
           "prefix_pages": np.zeros(prefix_pages), "prefix_len": np.zeros(()), "in_prefix": np.zeros(batch_size),
           "fill_rows": np.full(num_tokens, -1)}
    row = 0
    for b, s in enumerate(seqs):
        k = s.shared_pages
        used = -(-(s.start + len(s.tokens)) // page_size)
        own = list(s.pages[k:used])
        out["block_tables"][b, : len(own)] = own
        if k:
            out["prefix_pages"][:k] = s.pages[:k]
            out["prefix_len"] = k * page_size
            out["in_prefix"][b] = 1
        for i, t in enumerate(s.tokens):
            p = s.start + i
            out["input_ids"][row] = t
            out["positions"][row] = p
            out["slot_mapping"][row] = own[p // page_size - k] * page_size + p % page_size
            out["q_index"][b, i] = row
            out["fill_rows"][row] = int(s.fill)
            row += 1
        out["kv_offset"][b] = k * page_size
        out["kv_lens"][b] = s.start + len(s.tokens)
        out["logits_index"][b] = row - 1
    return out


@pytest.mark.parametrize("seed", range(12))
def test_build_batch_matches_a_sequence_at_a_time(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page_size, q_len = 16, int(rng.choice([1, 4, 32]))
    n = int(rng.integers(1, 9))
    shared = int(rng.integers(1, 3)) if q_len == 1 and seed % 3 == 0 else 0  # the cascade layout: decodes only
    prefix = list(rng.choice(np.arange(1, 500), shared, replace=False)) if shared else []
    seqs = []
    for i in range(n):
        count = int(rng.integers(1, q_len + 1))
        start = int(rng.integers(shared * page_size, 300))
        pages = -(-(start + count) // page_size)
        mine = shared and i % 2 == 0 and pages > shared
        own = list(rng.choice(np.arange(500, 2000), pages, replace=False))
        if mine:
            own[:shared] = prefix
        seqs.append(SequenceSlice([int(t) for t in rng.integers(0, 49152, count)], start, own,
                                  shared_pages=shared if mine else 0, fill=bool(rng.integers(0, 2))))
    num_tokens = sum(len(s.tokens) for s in seqs) + int(rng.integers(0, 5))
    num_pages = max(-(-(s.start + len(s.tokens)) // page_size) - s.shared_pages for s in seqs) + int(rng.integers(0, 3))
    batch_size = n + int(rng.integers(0, 3))
    got = build_batch(seqs, page_size, num_tokens, batch_size, q_len, num_pages, shared)
    for name, want in _reference(seqs, page_size, num_tokens, batch_size, q_len, num_pages, shared).items():
        have = np.asarray(getattr(got, name))
        assert have.dtype == np.int32 and have.shape == want.shape, name
        np.testing.assert_array_equal(have, want, err_msg=name)


@pytest.mark.parametrize(("seqs", "bucket", "message"), [
    ([SequenceSlice([1, 2], 0, [1])], (1, 1, 4, 4), "exceed bucket"),
    ([SequenceSlice([1, 2, 3], 0, [1])], (8, 2, 2, 4), "exceeds query bucket"),
    ([SequenceSlice([1], 16, [1])], (8, 2, 1, 4), "needs 2 pages; has 1"),
    ([SequenceSlice([1], 40, [1, 2, 3])], (8, 2, 1, 2), "needs 3 own pages"),
])
def test_build_batch_refuses_what_does_not_fit(seqs: list[SequenceSlice], bucket: tuple[int, int, int, int],
                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_batch(seqs, 16, *bucket)


def test_build_batch_of_no_sequence_is_all_padding() -> None:
    batch = build_batch([], 16, 4, 2, 1, 2)
    np.testing.assert_array_equal(batch.logits_index, [-1, -1])
    np.testing.assert_array_equal(batch.fill_rows, [-1] * 4)
