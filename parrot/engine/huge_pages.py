"""Weights in transparent huge pages on the CPU.

A decode step of a few sequences streams every weight matrix from memory once (~100 MB for the default
model's tiled Q4_1 blocks and Q8_0 head), faster than the 4 KiB pages' translations are cached: every 4 KiB
costs a page walk (two-level under a hypervisor), and the hardware prefetchers stop at each page's end.
In 2 MiB pages the same reads run 1.2x faster on a 2-core Zen 4 VM (docs/benchmarks.md).

Linux gives anonymous memory huge pages where it is advised (`madvise(MADV_HUGEPAGE)`, transparent huge
pages in their usual `madvise` mode) before its first touch. XLA's allocator does not advise its buffers,
so `put` copies a large array into an arena of advised segments (each 2 MiB aligned) and hands XLA that
memory as the array's buffer (`jax.device_put` aliases suitably aligned host memory on the CPU: nothing is
copied again). A segment is unmapped once no array in it is left. Where the backend is not the CPU, the
platform has no `MADV_HUGEPAGE`, XLA copies after all, or `PARROT_HUGE_PAGES=0`, `put` is
`jnp.asarray`: the same values, in XLA's memory.
"""

from __future__ import annotations

import mmap
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

HUGE_PAGE = 2 << 20
SEGMENT_BYTES = 64 << 20  # an arena segment (a larger array gets one of its own)
MIN_BYTES = 256 << 10  # smaller arrays stay in XLA's memory (norms, biases): their reads are few
ALIGN = 4096  # each array's start within a segment


class _Segment:
    """One advised anonymous mapping, filled from the start; the arrays in it hold it (their numpy views
    export its buffer), so it is unmapped when the last of them is gone."""

    def __init__(self, size: int):
        # private: shared anonymous memory is shmem, which takes huge pages only where shmem_enabled says
        self.map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(self.map, np.uint8)
        self.start = -base.ctypes.data % HUGE_PAGE  # the first 2 MiB boundary inside the mapping
        del base
        self.size = size
        self.used = 0
        self.map.madvise(mmap.MADV_HUGEPAGE, 0, len(self.map))

    def take(self, nbytes: int) -> int | None:
        at = -(-self.used // ALIGN) * ALIGN
        if at + nbytes > self.size:
            return None
        self.used = at + nbytes
        return self.start + at


class Arena:
    """Huge-page-backed host memory for arrays that live as long as a model (see the module's text)."""

    def __init__(self, segment_bytes: int = SEGMENT_BYTES, min_bytes: int = MIN_BYTES):
        self.segment_bytes = segment_bytes
        self.min_bytes = min_bytes
        self._segment: _Segment | None = None
        self._lock = threading.Lock()

    def _view(self, nbytes: int) -> np.ndarray:
        with self._lock:
            at = self._segment.take(nbytes) if self._segment is not None else None
            if at is None:
                size = -(-max(nbytes, self.segment_bytes) // HUGE_PAGE) * HUGE_PAGE
                segment = _Segment(size)
                if nbytes < self.segment_bytes:  # later arrays fill the rest of a shared segment
                    self._segment = segment
                at = segment.take(nbytes)
            else:
                segment = self._segment
            assert at is not None and segment is not None
            return np.frombuffer(segment.map, np.uint8, count=nbytes, offset=at)

    def put(self, a: np.ndarray) -> jax.Array:
        """`a` as a jax array on the default device: in the arena where that applies, else jnp.asarray."""
        a = np.asarray(a)
        if not enabled() or a.nbytes < self.min_bytes:
            return jnp.asarray(a)
        view = self._view(a.nbytes).view(a.dtype).reshape(a.shape)
        view[...] = a
        view.flags.writeable = False
        return jax.device_put(view)  # aliases `view` (where XLA copies instead, its own memory, as asarray)


def enabled() -> bool:
    """Whether `put` places arrays in huge pages here: the CPU backend, a platform with MADV_HUGEPAGE,
    and PARROT_HUGE_PAGES not 0."""
    return (os.environ.get("PARROT_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
            and jax.default_backend() == "cpu")


_arena = Arena()


def put(a: np.ndarray) -> jax.Array:
    """A model's large constant array (quantized weights and their tiled copies) as a jax array, in huge
    pages where the platform has them."""
    return _arena.put(a)

