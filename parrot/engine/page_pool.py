"""The free pages of the paged KV pool, handed out so that each context's pages lie one after another.

Decode attention reads a sequence's pages in order. Pages at scattered places cost a CPU a page walk and a
restart of its prefetchers every page (a page of one KV head is 2 KiB for SmolLM2): over pages in runs the
native kernel was 1.25x faster at 1 and 16 sequences and 1.44x at 64 than over pages at random places
(docs/benchmarks.md). A stack of free pages hands them out in the order they were freed, so sequences that
grow a page at a time side by side interleave their pages, and after some requests come and go every
sequence's pages are scattered.

The pool keeps a bitmap of the free pages instead:
- a context that grows takes the page after its last one where that page is free (`take(n, after)`);
- otherwise, and for a new context, its pages start a new run: in the first gap of free pages (in page order)
  with `room` pages to spare on either side, `room` pages after the gap's start (at the start where no page
  precedes it), so that the run before the gap can still grow by `room` pages and runs stay packed at the
  pool's low end. A CPU's pool is resident where it was written (lazily zeroed; free pages are given back
  only after the engine idles, `EngineConfig.kv_release_idle_s`), so the room is what the pool's footprint
  grows by under load: 8 pages (128 tokens) keep the pages ever written within
  ~1.1-1.3x the most in use at once, with 0.93-0.99 of a sequence's page pairs still one after the other
  (64 pages kept them all in order, at 2.6-2.7x the footprint; the stack: 1.0x, in order ~0.05);
- where no gap has that room, in the middle of the largest gap, so that the run before it can still grow
  into its first half; a run that needs more pages than the largest gap holds fills it and goes on in the
  next largest.

Which pages a context gets never changes what is computed: attention reads pages through the context's page
table. `take` and `give` cost O(1) while contexts grow in place; a new run scans the bitmap once (O(pages),
vectorized), however many gaps it fills.

`runs=False` (`PARROT_PAGE_RUNS=0`, for comparisons: `benchmarks/page_runs.py`) hands pages out as a stack
does instead, the most recently freed first, as before runs.
"""

from __future__ import annotations

import numpy as np

ROOM_PAGES = 8  # pages a run may grow by before the next new run (128 tokens of 16-token pages)


class PagePool:
    """Free pages `first .. num_pages - 1` (pages before `first` are never handed out); `runs` is fixed at
    construction."""

    def __init__(self, num_pages: int, first: int = 1, runs: bool = True, room: int = ROOM_PAGES) -> None:
        self.first = first
        self.room = room
        self._padded = np.zeros(max(num_pages, first) + 2, bool)  # a used page on either side: runs end inside
        self._free = self._padded[1:-1]  # (a view) free[p]: page p is free
        self._free[first:] = True
        self._count = max(num_pages - first, 0)
        self.runs = runs
        self._stack: list[int] = [] if runs else list(range(num_pages - 1, first - 1, -1))  # popped from the end
        self._ever = np.zeros(max(num_pages, first), bool)  # pages ever taken

    def __len__(self) -> int:
        return self._count

    def __contains__(self, page: object) -> bool:
        return isinstance(page, int | np.integer) and 0 <= page < len(self._free) and bool(self._free[page])

    @property
    def ever_taken(self) -> int:
        """How many pages were taken and not `released` since (a CPU's pool is resident on them)."""
        return int(self._ever.sum())

    def releasable(self) -> np.ndarray:
        """The free pages taken since the pool began or since they were last `released` (bool, [pages]): those a
        CPU's pool holds memory for while nothing uses them."""
        return self._free & self._ever

    def release_span(self, most: int, align: int = 8) -> np.ndarray:
        """The free pages to give back next (bool, [pages]): every free page from the first releasable one to
        past the `most`-th (each end at a multiple of `align` pages; to the pool's end where no more than `most`
        are releasable). Free pages never written are in it too: they cost nothing to give back, and with them
        the runs of free pages, whose whole OS pages are given back, are as long as they can be; cut only at
        multiples of `align`, a run's OS pages are whole in one span or the next where `align` pages fill whole
        OS pages (8 pages of 16 tokens of a 64-wide bfloat16 head: 16 KiB)."""
        written = np.flatnonzero(self._free & self._ever)
        span = np.zeros_like(self._free)
        if written.size:
            lo = int(written[0]) // align * align
            hi = len(span) if written.size <= most else -(-(int(written[most - 1]) + 1) // align) * align
            span[lo:hi] = self._free[lo:hi]
        return span

    def released(self, pages: np.ndarray) -> None:
        """`pages` (a bool mask, [pages]; free ones) were given back to the OS: they count as never taken."""
        self._ever[pages & self._free] = False

    def pages(self) -> list[int]:
        """The free pages, in order (O(pages))."""
        return np.flatnonzero(self._free).tolist()

    def take(self, n: int, after: int | None = None) -> list[int]:
        """`n` free pages, now in use: the pages after `after` while they are free, then the rest as a new
        run (see the module's text). Raises ValueError where fewer than `n` are free (nothing taken)."""
        if n > self._count:
            raise ValueError(f"{n} pages asked for, {self._count} free")
        out: list[int] = []
        free = self._free
        if not self.runs:
            out = [self._stack.pop() for _ in range(n)]
            free[out] = False
            self._ever[out] = True
            self._count -= n
            return out
        while len(out) < n and after is not None and after + 1 < len(free) and free[after + 1]:
            after += 1
            free[after] = False
            out.append(after)
        need = n - len(out)
        if need:
            starts, lengths = self._gaps()
            roomy = np.flatnonzero(lengths >= need + 2 * self.room)
            if len(roomy):  # the first gap with room on either side
                start = int(starts[roomy[0]])
                at = start if start == self.first else start + self.room
                free[at : at + need] = False
                out.extend(range(at, at + need))
                need = 0
        if need:  # the gaps from the largest down (the first of equal ones first)
            order = np.argsort(-lengths, kind="stable")
            starts, lengths = starts[order], lengths[order]
            whole = int(np.searchsorted(np.cumsum(lengths), need, side="right"))  # gaps taken whole
            if whole:
                ends = np.cumsum(lengths[:whole])
                pages = np.repeat(starts[:whole] - (ends - lengths[:whole]), lengths[:whole]) + np.arange(ends[-1])
                free[pages] = False
                out += pages.tolist()
                need -= int(ends[-1])
            if need:  # the rest: in the middle of the next gap (at its start where no page precedes it)
                start, length = int(starts[whole]), int(lengths[whole])
                at = start if start == self.first else start + (length - need) // 2
                free[at : at + need] = False
                out.extend(range(at, at + need))
        self._count -= n
        self._ever[out] = True
        return out

    def give(self, page: int) -> None:
        """A page back to the pool."""
        if self._free[page] or page < self.first:
            raise ValueError(f"page {page} is free already, or not the pool's")
        self._free[page] = True
        self._count += 1
        if not self.runs:
            self._stack.append(page)

    def _gaps(self) -> tuple[np.ndarray, np.ndarray]:
        """The runs of free pages: their first pages and lengths, in page order."""
        padded = self._padded
        edges = np.flatnonzero(padded[1:] != padded[:-1])  # where a run starts, then where it ends, in turns
        return edges[0::2], edges[1::2] - edges[0::2]
