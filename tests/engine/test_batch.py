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
