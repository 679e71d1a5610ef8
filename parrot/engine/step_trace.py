"""A per-step trace of the engine loop, for profiling: `PARROT_STEP_TRACE=PREFIX` makes every engine
process append one JSON object per step to `PREFIX.<pid>`:

    {"t": unix time at the step's end, "ms": the step's wall time, "decode": decode rows,
     "ahead": 1 if the next step was launched before this one's tokens were read,
     "steps": decode steps the call ran (multi-step decode; 1 otherwise),
     "prefill": [[start, tokens], ...] (one per prefill chunk)}

A step's wall time includes waiting for work launched earlier (a prefill step that samples nothing is not
waited for, so its time shows in the next step's), so sum the times over a phase rather than read one step.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TextIO

from parrot.engine.scheduler import StepPlan


class StepTrace:
    def __init__(self, prefix: str | None = None) -> None:
        prefix = prefix if prefix is not None else os.environ.get("PARROT_STEP_TRACE")
        self._file: TextIO | None = open(f"{prefix}.{os.getpid()}", "a") if prefix else None  # noqa: SIM115
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self._file is not None

    def step(self, plan: StepPlan, wall_s: float, ahead: bool) -> None:
        if self._file is None:
            return
        line = json.dumps({"t": round(time.time(), 4), "ms": round(wall_s * 1e3, 2), "decode": len(plan.decode),
                           "ahead": int(ahead), "steps": plan.steps,
                           "prefill": [[s.start, len(s.tokens)] for s in plan.prefill]})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
