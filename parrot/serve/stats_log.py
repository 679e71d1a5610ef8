"""A periodic log line of what the server is doing, as vLLM's (`--disable-log-stats` turns it off):

    engines 1: prompt 1,204.5 tok/s, generation 233.1 tok/s, running 16, waiting 2 (queued here 0), KV cache 31.2%,
    prefix cache hit rate 43.0%

Rates are the engines' own counters (`RuntimeInfo.prompt_tokens`, `.generated_tokens`: prompt tokens computed,
recomputed ones too, and tokens generated) over the interval; running and waiting the engines' sequences, queued
the serve core's tasks not placed yet; KV cache the used share of all live engines' pages; the hit rate the
prompt tokens found in cached prefixes since the start. A line is written while there is work, and once more
when it ends; an idle server stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parrot.protocol import RuntimeInfo

if TYPE_CHECKING:
    from parrot.serve.core import ParrotServeCore

log = logging.getLogger("parrot.stats")


@dataclass
class Totals:
    """The live engines' counters and load at one moment."""

    engines: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    running: int = 0
    waiting: int = 0
    used_pages: int = 0
    total_pages: int = 0

    @classmethod
    def of(cls, infos: list[RuntimeInfo]) -> Totals:
        t = cls(engines=len(infos))
        for info in infos:
            t.prompt_tokens += info.prompt_tokens
            t.generated_tokens += info.generated_tokens
            t.running += info.running
            t.waiting += info.waiting
            t.used_pages += info.total_pages - info.free_pages
            t.total_pages += info.total_pages
        return t


class StatsLog:
    """Computes the line from successive snapshots (`line`), and writes it every `interval_s` (`run`)."""

    def __init__(self, core: ParrotServeCore, interval_s: float = 10.0) -> None:
        self.core = core
        self.interval_s = interval_s
        self._last: Totals | None = None
        self._last_t = 0.0
        self._busy = False  # the last line was written for an interval with work

    def snapshot(self) -> tuple[Totals, int, float]:
        """(the live engines' totals, tasks queued in the core, the prefix cache hit rate)."""
        core = self.core
        infos = [info for c in core.engines.live_engines() if (info := core.engines.runtime(c.name)) is not None]
        return Totals.of(infos), len(core.scheduler.queue), core.contexts.hit_rate

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval since the last call, or None where there is nothing to say (idle, and
        idle before; or the first call, which only takes the counters)."""
        now = time.monotonic() if now is None else now
        totals, queued, hit_rate = self.snapshot()
        last, dt = self._last, now - self._last_t
        self._last, self._last_t = totals, now
        if last is None or dt <= 0:
            return None
        # an engine that restarted counts from 0 again: its rate is what it did since
        prompt = max(0, totals.prompt_tokens - last.prompt_tokens) / dt
        generation = max(0, totals.generated_tokens - last.generated_tokens) / dt
        busy = bool(prompt or generation or totals.running or totals.waiting or queued)
        if not busy and not self._busy:
            return None
        self._busy = busy
        kv = 100.0 * totals.used_pages / totals.total_pages if totals.total_pages else 0.0
        return (f"engines {totals.engines}: prompt {prompt:,.1f} tok/s, generation {generation:,.1f} tok/s, "
                f"running {totals.running}, waiting {totals.waiting} (queued here {queued}), KV cache {kv:.1f}%, "
                f"prefix cache hit rate {100.0 * hit_rate:.1f}%")

    async def run(self) -> None:
        self.line()
        while True:
            await asyncio.sleep(self.interval_s)
            said = self.line()
            if said is not None:
                log.info(said)
