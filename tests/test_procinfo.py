"""parrot/procinfo.py: machine facts from /proc."""

from __future__ import annotations

import os

from parrot import procinfo


def test_available_memory_is_within_the_machines_memory() -> None:
    available = procinfo.available_memory_bytes()
    if not os.path.exists("/proc/meminfo"):
        assert available is None
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert available is not None and 0 < available <= total


def test_usable_cores_are_at_least_one_and_at_most_the_machines() -> None:
    assert 1 <= procinfo.usable_cores() <= (os.cpu_count() or 1)
