from __future__ import annotations

import json
import os
from pathlib import Path

from parrot.engine.scheduler import Slot, StepPlan
from parrot.engine.sequence import Job, JobKind
from parrot.engine.step_trace import StepTrace


def test_a_step_is_one_json_line(tmp_path: Path) -> None:
    trace = StepTrace(str(tmp_path / "steps"))
    job = Job(JobKind.FILL, "c", None, fill_tokens=[1, 2, 3])
    plan = StepPlan()
    plan.prefill.append(Slot(job, [1, 2, 3], 16, []))
    plan.decode.append(Slot(job, [4], 40, [], True))
    trace.step(plan, 0.0125, ahead=False)
    trace.close()
    line = json.loads((tmp_path / f"steps.{os.getpid()}").read_text())
    assert line["ms"] == 12.5 and line["decode"] == 1 and line["ahead"] == 0 and line["prefill"] == [[16, 3]]
    assert line["steps"] == 1


def test_off_without_a_prefix(monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    monkeypatch.delenv("PARROT_STEP_TRACE", raising=False)
    trace = StepTrace()
    assert not trace.on
    trace.step(StepPlan(), 0.01, ahead=False)  # nothing to write to, no error
