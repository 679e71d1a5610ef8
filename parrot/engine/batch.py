"""ForwardBatch: everything one forward step needs, as a PyTree of arrays, plus bucket padding.

Layout (selective batching, Orca): the `T` scheduled tokens of all sequences are one flat array; the
non-attention ops run on `[T, hidden]`. Attention regroups the flat queries per sequence through
`q_index` (`[B, Q]` indices into the flat array; `T` marks padding) and reads each sequence's keys and
values through its page table (`block_tables`, `[B, P]`).

Shared prefix (cascade) layout: when several decoding sequences were forked from one context, the
pages they share are listed once in `prefix_pages` (`[Pp]`, Pp > 0) and left out of their own
`block_tables`, whose first page then holds position `kv_offset[b]`. Attention reads the prefix once
for all member queries and merges it with each sequence's own suffix (attention.py).
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
    block_tables: jax.Array  # [B, P] int32 own pages of each sequence (padding: scratch page 0)
    kv_offset: jax.Array  # [B] int32 position held by block_tables[b, 0] (shared prefix length or 0)
    kv_lens: jax.Array  # [B] int32 tokens each sequence attends to after this step (padding: 0)
    logits_index: jax.Array  # [B] int32 flat index of the token whose logits are wanted (padding: -1)
    prefix_pages: jax.Array  # [Pp] int32 pages of the shared prefix (Pp = 0: no shared prefix)
    prefix_len: jax.Array  # [] int32 tokens in the shared prefix
    in_prefix: jax.Array  # [B] int32 1 where sequence b reads the shared prefix (int32: no convert in every layer)
    fill_rows: jax.Array  # [T] int32 1 where the token is a prompt's (a fill's), 0 a generated one's, -1 padding

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.shape[0])


def pack(batch: ForwardBatch) -> np.ndarray:
    """The batch's host arrays as one int32 vector, in field order: one host-to-device transfer per step
    instead of one per array (`jax.device_put` of the eleven arrays cost ~0.7 ms of host time here)."""
    return np.concatenate([np.asarray(a, np.int32).reshape(-1) for a in jax.tree.leaves(batch)])


def unpack(packed: jax.Array, like: ForwardBatch) -> ForwardBatch:
    """`pack`'s inverse (jitted, on the device); `like` holds the arrays' shapes and dtypes."""
    leaves, tree = jax.tree.flatten(like)
    out, off = [], 0
    for a in leaves:
        n = int(np.prod(a.shape, dtype=np.int64))
        out.append(packed[off : off + n].reshape(a.shape).astype(a.dtype))
        off += n
    return jax.tree.unflatten(tree, out)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; `buckets` must be sorted. Raises if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class SequenceSlice:
    """One sequence's part of a step: `tokens` appended at `start`, KV in `pages`.

    `shared_pages`: how many leading pages are the batch's shared prefix (cascade layout)."""

    tokens: Sequence[int]
    start: int  # position of tokens[0] (= tokens already in the sequence's KV)
    pages: Sequence[int]
    shared_pages: int = 0
    fill: bool = False  # the tokens are a prompt's (a fill's), not generated ones


def build_batch(
    seqs: Sequence[SequenceSlice],
    page_size: int,
    num_tokens: int,
    batch_size: int,
    q_len: int,
    num_pages: int,
    prefix_pages: int = 0,
) -> ForwardBatch:
    """Pack sequences into a padded ForwardBatch of the given bucket shape (host-side numpy).

    Padding tokens write their KV to slot 0 (page 0 is a scratch page never handed to a context).
    With `prefix_pages` > 0 the sequences with `shared_pages` > 0 must share those leading pages.

    The arrays are built for all sequences at once; only the page tables are copied a sequence at a time
    (a decode step of 64 sequences took ~0.75 ms of host time a sequence at a time, ~0.15 ms so)."""
    B = len(seqs)
    lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, B)
    total = int(lens.sum())
    if total > num_tokens or B > batch_size:
        raise ValueError(f"{B} sequences / {total} tokens exceed bucket {batch_size}/{num_tokens}")
    starts = np.fromiter((s.start for s in seqs), np.int64, B)
    shared = np.fromiter((s.shared_pages for s in seqs), np.int64, B)
    used = -(-(starts + lens) // page_size)  # pages holding each sequence's KV after the step
    own = used - shared
    input_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)
    q_index = np.full((batch_size, q_len), num_tokens, np.int32)
    block_tables = np.zeros((batch_size, num_pages), np.int32)
    kv_offset = np.zeros(batch_size, np.int32)
    kv_lens = np.zeros(batch_size, np.int32)
    logits_index = np.full(batch_size, -1, np.int32)  # padding rows: -1 (their logits are not computed)
    prefix = np.zeros(prefix_pages, np.int32)
    prefix_len = 0
    in_prefix = np.zeros(batch_size, np.int32)
    fill_rows = np.full(num_tokens, -1, np.int32)  # padding rows' products are skipped (quant.linear)
    for b, s in enumerate(seqs):  # the checks, in sequence order (the first failing sequence names the error)
        n = int(lens[b])
        if n > q_len:
            raise ValueError(f"sequence of {n} tokens exceeds query bucket {q_len}")
        if used[b] > len(s.pages):
            raise ValueError(f"sequence needs {used[b]} pages; has {len(s.pages)}")
        k = s.shared_pages
        if k:
            if k > prefix_pages or (prefix_len and k * page_size != prefix_len):
                raise ValueError("sequences in the shared prefix must share the same pages")
            prefix[:k] = s.pages[:k]
            prefix_len = k * page_size
            in_prefix[b] = 1
        if own[b] > num_pages:
            raise ValueError(f"sequence needs {own[b]} own pages; bucket holds {num_pages}")
        block_tables[b, : own[b]] = s.pages[k : used[b]]
    if B == 0:
        return ForwardBatch(input_ids, positions, slot_mapping, q_index, block_tables, kv_offset, kv_lens,
                            logits_index, prefix, np.int32(prefix_len), in_prefix, fill_rows)
    offs = np.cumsum(lens) - lens  # each sequence's first flat row
    if total == B:  # one token a sequence (a decode step)
        seq_of = np.arange(B)
        input_ids[:B] = [s.tokens[0] for s in seqs]
    else:
        seq_of = np.repeat(np.arange(B), lens)
        input_ids[:total] = [t for s in seqs for t in s.tokens]
    rows = np.arange(total)
    pos = starts[seq_of] + rows - offs[seq_of]
    positions[:total] = pos
    slot_mapping[:total] = block_tables[seq_of, pos // page_size - shared[seq_of]] * page_size + pos % page_size
    q_index[seq_of, rows - offs[seq_of]] = rows
    kv_offset[:B] = shared * page_size
    kv_lens[:B] = starts + lens
    logits_index[:B] = offs + lens - 1
    fill_rows[:total] = np.fromiter((bool(s.fill) for s in seqs), np.int32, B)[seq_of]
    return ForwardBatch(input_ids, positions, slot_mapping, q_index, block_tables, kv_offset, kv_lens,
                        logits_index, prefix, np.int32(prefix_len), in_prefix, fill_rows)


def find_shared_prefix(page_lists: Sequence[Sequence[int]], min_members: int = 2) -> tuple[list[int], int]:
    """The group of sequences sharing the most prefix KV: (member indices, shared leading pages).

    Sequences forked from one context hold the very same page ids for its full pages, so page
    identity is KV identity. Picks the group maximising (members - 1) x shared pages (the reads saved).
    Only full pages can be shared, and a sequence's last page is never shared, so the common prefix
    always leaves each member at least its own last page."""
    groups: dict[int, list[int]] = {}
    for i, pages in enumerate(page_lists):
        if pages:
            groups.setdefault(pages[0], []).append(i)
    best: tuple[list[int], int] = ([], 0)
    best_saving = 0
    for members in groups.values():
        if len(members) < min_members:
            continue
        first = page_lists[members[0]]
        n = min(len(page_lists[i]) for i in members) - 1
        for i in members[1:]:
            other = page_lists[i]
            k = 0
            while k < n and other[k] == first[k]:
                k += 1
            n = k
        saving = (len(members) - 1) * n
        if n > 0 and saving > best_saving:
            best, best_saving = (members, n), saving
    return best
