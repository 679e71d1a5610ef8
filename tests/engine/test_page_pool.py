"""The KV pool's free pages: contexts that grow side by side keep their pages in runs, a new run starts in the
first gap with room to spare (else in the middle of the largest gap), and every page is accounted for."""

from __future__ import annotations

import numpy as np
import pytest

from parrot.engine.page_pool import PagePool


def test_new_runs_are_packed_low_with_room_to_grow() -> None:
    pool = PagePool(1001, room=8)
    a = pool.take(3)  # at the pool's start: no run before it
    b = pool.take(2)  # the first gap with room on either side, 8 pages after its start
    c = pool.take(4)
    assert a == [1, 2, 3] and b == [12, 13] and c == [22, 23, 24, 25]
    a += pool.take(10, a[-1])  # 4..11 in place, then a new run: the first gap with room (after c's)
    assert a[3:11] == list(range(4, 12)) and a[11:] == [34, 35]
    for p in b:
        pool.give(p)  # 4..33 less a's 4..11: the gap 12..21 is too small for room on either side
    assert pool.take(1) == [44]


def test_contexts_growing_side_by_side_keep_their_pages_in_runs() -> None:
    pool = PagePool(65, room=64)
    a = pool.take(2)  # the first run: at the pool's start (no run before it to grow into the gap)
    b = pool.take(2)  # the next: in the middle of the gap after a's run (no gap has 64 pages on either side)
    assert a == [1, 2] and b == [33, 34]
    for _ in range(5):  # a page each, in turns, as decodes do
        a += pool.take(1, a[-1])
        b += pool.take(1, b[-1])
    assert a == list(range(1, 8)) and b == list(range(33, 40))
    assert len(pool) == 64 - 14


def test_a_stack_interleaves_them() -> None:
    """`runs=False`, pages as a stack hands them out (before runs): the two contexts' pages alternate."""
    pool = PagePool(65, runs=False)
    a, b = pool.take(1), pool.take(1)
    for _ in range(3):
        a += pool.take(1, a[-1])
        b += pool.take(1, b[-1])
    assert a == [1, 3, 5, 7] and b == [2, 4, 6, 8]


def test_a_run_blocked_goes_on_in_the_largest_gap() -> None:
    pool = PagePool(21)  # pages 1..20
    a = pool.take(3)  # 1-3
    b = pool.take(2)  # the middle of 4..20: 11, 12
    assert b == [11, 12]
    grown = pool.take(9, a[-1])  # 4..10 in place, then the largest gap (13..20): its middle
    assert grown[:7] == list(range(4, 11))
    assert grown[7:] == [16, 17]


def test_more_pages_than_the_largest_gap_fill_it_then_the_next() -> None:
    pool = PagePool(11)  # pages 1..10
    held = [pool.take(1, None) for _ in range(3)]  # 1, then the middles of the gaps after it
    assert held == [[1], [6], [3]]
    rest = pool.take(7)
    assert sorted(rest) == [2, 4, 5, 7, 8, 9, 10] and len(pool) == 0
    assert rest[:4] == [7, 8, 9, 10]  # the largest gap first, whole
    with pytest.raises(ValueError, match="1 pages asked for, 0 free"):
        pool.take(1)


def test_give_and_errors() -> None:
    pool = PagePool(5)
    pages = pool.take(4)
    for p in pages:
        pool.give(p)
    assert pool.pages() == [1, 2, 3, 4] and len(pool) == 4
    with pytest.raises(ValueError, match="free already"):
        pool.give(1)
    with pytest.raises(ValueError, match="not the pool's"):
        pool.give(0)
    assert 0 not in pool and 1 in pool


def test_release_spans_cover_every_written_free_page_in_aligned_pieces() -> None:
    """Spans given back one after another: each starts at the first written free page and holds about `most` of
    them, cut at multiples of `align`; free pages never written come along, used pages never; in the end no free
    page counts as written and the used ones still do."""
    rng = np.random.default_rng(3)
    pool = PagePool(200)
    taken = pool.take(150)
    for p in rng.choice(taken, 90, replace=False):
        pool.give(int(p))
    used = ~pool._free.copy()
    used[0] = False
    spans = []
    while (written := pool.releasable()).any():
        span = pool.release_span(16, align=8)
        lo, hi = np.flatnonzero(span)[[0, -1]]
        assert lo // 8 * 8 <= np.flatnonzero(written)[0] and not (span & used).any()
        assert 16 <= int((span & written).sum()) <= 16 + 8 or not (written & ~span).any()
        assert (span == (pool._free & (np.arange(span.size) >= lo // 8 * 8)
                         & (np.arange(span.size) <= hi))).all()  # every free page in between
        pool.released(span)
        spans.append(span)
        assert len(spans) < 20
    assert len(spans) >= 5 and pool.ever_taken == int(used.sum()) == 60
    cuts = [int(np.flatnonzero(s)[-1]) + 1 for s in spans[:-1]]
    assert all(c % 8 == 0 or not pool._free[c] for c in cuts)  # a span ends at a multiple of 8, or a used page


@pytest.mark.parametrize("runs", [True, False])
def test_random_takes_and_gives_account_for_every_page(runs: bool) -> None:
    rng = np.random.default_rng(3)
    pool = PagePool(200, runs=runs)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.4 or len(pool) == 0):
            run = held.pop(int(rng.integers(len(held))))
            for p in run:
                pool.give(p)
        else:
            n = int(rng.integers(1, min(12, len(pool)) + 1))
            grow = held and rng.random() < 0.5
            after = held[-1][-1] if grow else None
            got = pool.take(n, after)
            if grow:
                held[-1] += got
            else:
                held.append(got)
        taken = [p for run in held for p in run]
        assert len(taken) == len(set(taken)) and 0 not in taken
        assert sorted(taken + pool.pages()) == list(range(1, 200))
        assert len(pool) == len(pool.pages())


def _serve(pool: PagePool, seqs: int, rounds: int, decoded: int) -> tuple[int, float]:
    """Rounds of a server's life: the missing sequences' prompts (300-500 tokens of 16-token pages) come in,
    all decode `decoded` tokens side by side, half finish. Returns the most pages in use at once and the
    fraction of the sequences' page pairs that lie one after the other."""
    rng = np.random.default_rng(4)
    live: list[list[int]] = []
    lens: list[int] = []
    peak, pairs, adjacent = 0, 0, 0
    for _ in range(rounds):
        while len(live) < seqs:
            n = int(rng.integers(300, 501))
            live.append(pool.take(-(-n // 16)))
            lens.append(n)
        for _ in range(decoded):
            for i, pages in enumerate(live):
                lens[i] += 1
                if lens[i] > 16 * len(pages):
                    pages += pool.take(1, pages[-1])
        peak = max(peak, sum(map(len, live)))
        for pages in live:
            pairs += len(pages) - 1
            adjacent += int(np.sum(np.diff(pages) == 1))
        for i in sorted(rng.choice(len(live), len(live) // 2, replace=False), reverse=True):
            for p in live.pop(i):
                pool.give(p)
            lens.pop(i)
    return peak, adjacent / pairs


@pytest.mark.parametrize("seqs", [16, 64])
def test_a_serving_pools_written_pages_stay_near_the_most_in_use(seqs: int) -> None:
    """A CPU's pool is resident wherever it was ever written: over 24 rounds of requests coming and going, the
    pages ever taken stay within 1.3x the most in use at once (with 64 pages of room: 2.6-2.7x), and the
    sequences' pages stay in runs (the stack: 1.0x, and ~0.08 of the pairs in order)."""
    pool = PagePool(16384)
    peak, in_order = _serve(pool, seqs, 24, 128)
    assert pool.ever_taken <= 1.3 * peak, (pool.ever_taken, peak)
    assert in_order >= 0.95
    stack = PagePool(16384, runs=False)
    peak, in_order = _serve(stack, seqs, 24, 128)
    assert stack.ever_taken == peak and in_order < 0.2
    roomy = PagePool(16384, room=64)
    peak, in_order = _serve(roomy, seqs, 24, 128)
    assert roomy.ever_taken > 2 * peak and in_order > 0.99
