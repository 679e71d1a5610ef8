"""Large constant arrays in an arena of huge pages: the same values, XLA reading the arena's memory."""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import huge_pages, quant
from parrot.engine.huge_pages import Arena
from parrot.engine.models import llama

pytestmark = pytest.mark.skipif(not huge_pages.enabled(), reason="no huge pages here (not a CPU backend or Linux)")


def _in(arena: Arena, out: jax.Array) -> bool:
    """Whether `out`'s buffer lies in the arena's current segment."""
    seg = arena._segment
    assert seg is not None
    base = np.frombuffer(seg.map, np.uint8).ctypes.data
    return base <= out.unsafe_buffer_pointer() < base + len(seg.map)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, jnp.bfloat16, np.int32])
def test_arrays_keep_their_values_in_the_arena(dtype: type) -> None:
    arena = Arena(segment_bytes=4 << 20, min_bytes=1024)
    rng = np.random.default_rng(0)
    for shape in [(577, 361), (12345,), (3, 64, 129)]:  # odd sizes: each next start is realigned
        a = (rng.standard_normal(shape) * 100).astype(dtype)
        out = arena.put(a)
        assert out.shape == a.shape and out.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(out), a)
        assert _in(arena, out), "XLA copied the array instead of reading the arena"
        assert out.unsafe_buffer_pointer() % huge_pages.ALIGN == 0


def test_small_arrays_and_the_off_switch_stay_in_xla_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    arena = Arena(segment_bytes=4 << 20, min_bytes=1 << 16)
    big = np.arange(1 << 16, dtype=np.float32)
    assert _in(arena, arena.put(big))
    small = arena.put(np.arange(100, dtype=np.float32))
    assert not _in(arena, small)
    np.testing.assert_array_equal(np.asarray(small), np.arange(100, dtype=np.float32))
    monkeypatch.setenv("PARROT_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    off = arena.put(big)
    assert not _in(arena, off)
    np.testing.assert_array_equal(np.asarray(off), big)


def test_an_array_larger_than_a_segment_gets_its_own() -> None:
    arena = Arena(segment_bytes=2 << 20, min_bytes=1024)
    first = arena.put(np.ones(1 << 12, np.float32))
    shared = arena._segment
    big = arena.put(np.arange(3 << 20, dtype=np.uint8))  # 3 MiB > the 2 MiB segment
    assert arena._segment is shared, "later small arrays go on filling the shared segment"
    np.testing.assert_array_equal(np.asarray(big), np.arange(3 << 20, dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(first), 1.0)


def test_the_arena_is_given_back_when_its_arrays_are_gone() -> None:
    arena = Arena(segment_bytes=8 << 20, min_bytes=1024)
    out = arena.put(np.arange(1 << 20, dtype=np.float32))
    seg = arena._segment
    assert seg is not None
    arena._segment = None  # the arena lets go of its segment; `out` still holds it
    del seg
    np.testing.assert_array_equal(np.asarray(out)[:3], [0, 1, 2])
    del out
    gc.collect()  # nothing reads freed memory (a crash here would be a use after unmap)
    again = arena.put(np.arange(1 << 20, dtype=np.float32))
    assert float(again[12345]) == 12345.0


def _resident_huge_bytes() -> int:
    """Bytes of this process's anonymous memory in huge pages now (/proc/self/smaps_rollup; 0 where unknown)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _thp_setting(name: str) -> str:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/<name> ("never" where unreadable)."""
    try:
        text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


# without compaction at fault (defrag "never"), a fragmented machine may have no free 2 MiB page to give
@pytest.mark.skipif(_thp_setting("enabled") == "never" or _thp_setting("defrag") == "never",
                    reason="transparent huge pages are off, or not compacted for, on this machine")
def test_the_arena_is_in_huge_pages() -> None:
    arena = Arena(segment_bytes=16 << 20, min_bytes=1024)
    before = _resident_huge_bytes()
    out = arena.put(np.ones(12 << 20, np.uint8))
    assert _resident_huge_bytes() - before >= 2 << 20
    assert int(out[-1]) == 1


def test_a_model_s_quantized_matrices_and_their_tiled_copies_are_in_the_arena() -> None:
    """The model's parameters are the arena's memory (XLA reads it in place), with the file's bytes."""
    w = quant.quantize((np.random.default_rng(1).standard_normal((576, 1536)) * 0.05).astype(np.float32), "q4_1")
    param, qtype = llama._matrix(w, jnp.float32)
    assert qtype == "q4_1"
    arrays = [param[...]]
    tiled = llama._tiled(w, True)
    if tiled is not None:  # (a CPU with the VNNI code)
        arrays.append(tiled[...])
    for a in arrays:
        assert a.nbytes >= huge_pages.MIN_BYTES
        assert _in(huge_pages._arena, a)
    np.testing.assert_array_equal(np.asarray(arrays[0]), w.data)
