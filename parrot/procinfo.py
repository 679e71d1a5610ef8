"""Process and machine facts read from /proc (Linux; None where unavailable): resident memory, age,
the CPU's name; and giving freed heap memory back, or the heap's objects to the collector's permanent
generation."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from pathlib import Path


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set size of a process (this one by default) now."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory_bytes() -> int | None:
    """Memory the machine can give new work now without swapping (the kernel's MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS says; else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_name() -> str:
    """The CPU's model name, for benchmark reports (machines of one kind differ)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def uptime_s() -> float | None:
    """Seconds since this process started."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot_uptime = float(Path("/proc/uptime").read_text().split()[0])
        return boot_uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def release_free_memory() -> None:
    """Give the C heap's free memory back to the system (glibc `malloc_trim`): compiling on several
    threads leaves hundreds of MB free but held in per-thread arenas. No-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def freeze_heap() -> int:
    """Collect the garbage, then move every object left into the garbage collector's permanent generation
    (`gc.freeze`): later collections skip them. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def keep_large_blocks() -> None:
    """Serve large allocations from the reusable heap instead of a fresh `mmap` each time (glibc
    `mallopt`): a step run as one call per layer frees and reallocates its tens-of-MB temporaries on
    every call, and fresh mappings cost page faults and kernel zeroing each time (a batch-64 decode
    step took 1.8x as long). Freed memory stays for reuse until `release_free_memory`. No-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
