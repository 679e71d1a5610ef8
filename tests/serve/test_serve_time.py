"""ServeTime: a task's first-primitive and between-primitive intervals, cumulative buckets."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import parrot as P
from parrot.serve.serve_time import BOUNDS, Histogram, ServeTime, TaskClock


def test_first_then_gaps_and_no_gap_for_pipelined_primitives() -> None:
    st = ServeTime()
    clock = TaskClock(ready=time.perf_counter() - 0.01)
    st.sending(clock)  # first primitive, 10 ms after ready
    st.sending(clock)  # pipelined behind it: no gap
    st.done(clock)
    st.done(clock)
    time.sleep(0.002)
    st.sending(clock)  # next one after both are done: a gap of >= 2 ms
    st.done(clock)
    assert st.first.count == 1 and 0.01 <= st.first.total < 1.0
    assert st.gap.count == 1 and 0.002 <= st.gap.total < 1.0
    assert clock.sent == 3 and clock.outstanding == 0
    assert abs(clock.serve_s - (st.first.total + st.gap.total)) < 1e-9
    summary = st.summary()
    assert summary["first_count"] == 1 and summary["gap_mean_s"] == st.gap.total


def test_cumulative_buckets_end_with_inf() -> None:
    h = Histogram()
    for v in (0.0, 3e-4, 3e-4, 20.0):
        h.observe(v)
    buckets = dict(h.cumulative())
    assert list(buckets)[-1] == "+Inf" and buckets["+Inf"] == 4 == h.count
    assert buckets[repr(BOUNDS[0])] == 1 and buckets["0.0005"] == 3 and buckets["10.0"] == 3
    assert h.max == 20.0 and h.mean == (6e-4 + 20.0) / 4


@P.semantic_function(template="You summarize stories in one line. Story so far: {{s}}. Next: {{t}}. New: {{n}}")
def step(s: P.Input, t: P.Input, n: P.Output(max_tokens=4, ignore_eos=True, temperature=0.0)): ...


@pytest.fixture(scope="module")
def server():
    from tests.servers import tiny_serving_core

    with tiny_serving_core() as served:
        yield served


def _histogram(url: str, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram in /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)}
    samples = {s.name: s.value for s in families[name].samples if not s.labels or "le" not in s.labels}
    return samples[f"{name}_count"], samples[f"{name}_sum"]


def test_a_dag_and_a_plain_completion_report_their_serve_time(server) -> None:
    """A chain of three dependent semantic calls and one completion on an idle server: every task's serve
    time (ready -> first primitive, between primitives) is in /metrics and in the session's generations,
    and none of it waits for a dispatch tick or a heartbeat."""
    url, core = server
    before = _histogram(url, "parrot:serve_first_primitive_seconds")
    with P.VirtualMachine(url, timeout=60) as vm:
        running = "nothing yet"
        for part in ("a cat", "meets a dog", "they play"):
            running = step(running, part)
        running.get(timeout=60)
        gens = vm.inspect()["generations"]
    httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Count: 1 2 3", "max_tokens": 3,
                                              "ignore_eos": True}, timeout=60).raise_for_status()
    count, total = _histogram(url, "parrot:serve_first_primitive_seconds")
    assert count - before[0] == 4
    assert (total - before[1]) / 4 < 0.1  # milliseconds on an idle server (a 0.2 s tick would show)
    assert _histogram(url, "parrot:serve_between_primitives_seconds")[0] >= 0
    assert len(gens) == 3 and all(0 <= g["serve_s"] < 0.5 for g in gens)
    assert core.serve_time.first.count >= 4
