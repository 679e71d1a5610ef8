"""ForwardBatch: everything one forward step needs, as a PyTree of arrays, plus bucket padding.

Layout (selective batching, Orca): the `T` scheduled tokens of all sequences are one flat array; the
non-attention ops run on `[T, hidden]`. Attention regroups the flat queries per sequence through
`q_index` (`[B, Q]` indices into the flat array; `T` marks padding) and reads each sequence's keys and
values through its page table (`block_tables`, `[B, P]`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class ForwardBatch:
    input_ids: jax.Array  # [T] int32 token ids (padding: 0)
    positions: jax.Array  # [T] int32 position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32 KV slot (page * page_size + offset) each token writes
    q_index: jax.Array  # [B, Q] int32 flat index of each sequence's queries (padding: T)
    block_tables: jax.Array  # [B, P] int32 pages of each sequence (padding: scratch page 0)
    kv_lens: jax.Array  # [B] int32 tokens each sequence attends to after this step (padding: 0)
    logits_index: jax.Array  # [B] int32 flat index of the token whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.shape[0])


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; `buckets` must be sorted. Raises if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class SequenceSlice:
    """One sequence's part of a step: `tokens` appended at `start`, KV pages in `pages`."""

    tokens: Sequence[int]
    start: int  # position of tokens[0] (= tokens already in the sequence's KV)
    pages: Sequence[int]


def build_batch(
    seqs: Sequence[SequenceSlice],
    page_size: int,
    num_tokens: int,
    batch_size: int,
    q_len: int,
    num_pages: int,
) -> ForwardBatch:
    """Pack sequences into a padded ForwardBatch of the given bucket shape (host-side numpy).

    Padding tokens write their KV to slot 0 (page 0 is a scratch page never handed to a context)."""
    total = sum(len(s.tokens) for s in seqs)
    if total > num_tokens or len(seqs) > batch_size:
        raise ValueError(f"{len(seqs)} sequences / {total} tokens exceed bucket {batch_size}/{num_tokens}")
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)
    q_index = np.full((batch_size, q_len), num_tokens, np.int32)
    block_tables = np.zeros((batch_size, num_pages), np.int32)
    kv_lens = np.zeros(batch_size, np.int32)
    logits_index = np.zeros(batch_size, np.int32)
    off = 0
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        if n > q_len:
            raise ValueError(f"sequence of {n} tokens exceeds query bucket {q_len}")
        pos = np.arange(s.start, s.start + n, dtype=np.int32)
        used = -(-(s.start + n) // page_size)  # pages holding this sequence's KV after the step
        if used > len(s.pages) or used > num_pages:
            raise ValueError(f"sequence needs {used} pages; has {len(s.pages)}, bucket {num_pages}")
        pages = np.asarray(s.pages[:used], np.int32)
        input_ids[off : off + n] = s.tokens
        positions[off : off + n] = pos
        slot_mapping[off : off + n] = pages[pos // page_size] * page_size + pos % page_size
        q_index[b, :n] = np.arange(off, off + n, dtype=np.int32)
        block_tables[b, :used] = pages
        kv_lens[b] = s.start + n
        logits_index[b] = off + n - 1
        off += n
    return ForwardBatch(input_ids, positions, slot_mapping, q_index, block_tables, kv_lens, logits_index)
