"""The serve layer's own time per task: what the core spends between a task's engine primitives.

Two intervals are measured for every completion task (semantic call or plain completion):
* `first`: from the task becoming ready (its inputs set and its output needed, or a plain completion
  arriving) to its first engine primitive being handed to the engine client (tokenizing, scheduling,
  placement, the prefix-cache look-up and event-loop hops);
* `gap`: from one primitive of the task being done to the next one being handed to the client (the core
  deciding and sending its next fill or its generate). Primitives sent before the previous one is done
  (pipelined) have no gap.
Waiting for a prefix another task is filling counts as a primitive of the waiting task (engine time),
not as serve time.

Both are kept as cumulative histograms (Prometheus style: fixed bucket bounds, counts, sums), so a
client can take the difference of two scrapes of `/metrics` and get the figures of what ran in between.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

# seconds: 10 us .. 10 s
BOUNDS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
          2.5, 5.0, 10.0)


@dataclass
class Histogram:
    """Counts per bucket (`counts[i]`: observations <= BOUNDS[i]; the last entry: above every bound)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    total: float = 0.0
    count: int = 0
    max: float = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.counts[bisect.bisect_left(BOUNDS, seconds)] += 1
        self.total += seconds
        self.count += 1
        self.max = max(self.max, seconds)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations <= it), ending with +Inf."""
        out, running = [], 0
        for bound, n in zip((*(repr(b) for b in BOUNDS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass(eq=False)
class TaskClock:
    """One task's marks: when it became ready, whether a primitive was sent, when the last one ended."""

    ready: float = field(default_factory=time.perf_counter)
    sent: int = 0  # primitives handed to the engine client so far
    outstanding: int = 0  # sent and not done yet
    last_done: float | None = None
    serve_s: float = 0.0  # this task's serve time so far: first + gaps


class ServeTime:
    def __init__(self) -> None:
        self.first = Histogram()
        self.gap = Histogram()

    def sending(self, clock: TaskClock) -> None:
        """A primitive of the task is about to be handed to its engine client."""
        now = time.perf_counter()
        if clock.sent == 0:
            self.first.observe(now - clock.ready)
            clock.serve_s += now - clock.ready
        elif clock.outstanding == 0 and clock.last_done is not None:
            self.gap.observe(now - clock.last_done)
            clock.serve_s += now - clock.last_done
        clock.sent += 1
        clock.outstanding += 1

    def done(self, clock: TaskClock) -> None:
        """A primitive of the task returned (or failed)."""
        clock.outstanding = max(0, clock.outstanding - 1)
        clock.last_done = time.perf_counter()

    def summary(self) -> dict[str, float | int | None]:
        return {"first_count": self.first.count, "first_mean_s": self.first.mean, "first_max_s": self.first.max,
                "gap_count": self.gap.count, "gap_mean_s": self.gap.mean, "gap_max_s": self.gap.max}
