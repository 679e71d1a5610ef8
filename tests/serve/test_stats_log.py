"""The periodic stats line (parrot/serve/stats_log.py) from the engines' counters."""

from __future__ import annotations

from types import SimpleNamespace

from parrot.protocol import RuntimeInfo
from parrot.serve.stats_log import StatsLog


def _info(prompt: int, generated: int, running: int = 0, free: int = 100) -> RuntimeInfo:
    return RuntimeInfo(model="m", max_context_len=512, page_size=16, total_pages=100, free_pages=free,
                       num_contexts=0, num_cached_tokens=0, running=running, waiting=0, recent_step_ms=0.0, steps=0,
                       shape_misses=0, preemptions=0, evictions=0, cascade_steps=0, prompt_tokens=prompt,
                       generated_tokens=generated)


class FakeCore:
    def __init__(self) -> None:
        self.infos: dict[str, RuntimeInfo] = {}
        self.queued: list[object] = []
        self.engines = SimpleNamespace(live_engines=lambda: [SimpleNamespace(name=n) for n in self.infos],
                                       runtime=lambda name: self.infos.get(name))
        self.scheduler = SimpleNamespace(queue=self.queued)
        self.contexts = SimpleNamespace(hit_rate=0.25)


def test_rates_over_the_interval_while_there_is_work_then_one_line_more() -> None:
    core = FakeCore()
    stats = StatsLog(core)
    core.infos = {"a": _info(0, 0), "b": _info(0, 0)}
    assert stats.line(now=0.0) is None  # the first call takes the counters
    assert stats.line(now=10.0) is None  # idle: quiet
    core.infos = {"a": _info(1000, 200, running=3, free=60), "b": _info(500, 100, running=1, free=80)}
    line = stats.line(now=20.0)
    assert line == ("engines 2: prompt 150.0 tok/s, generation 30.0 tok/s, running 4, waiting 0 (queued here 0), "
                    "KV cache 30.0%, prefix cache hit rate 25.0%")
    core.infos = {"a": _info(1000, 200), "b": _info(500, 100)}
    assert "prompt 0.0 tok/s, generation 0.0 tok/s, running 0" in (stats.line(now=30.0) or "")  # the work ended
    assert stats.line(now=40.0) is None
    core.queued.append(object())  # work waiting in the core alone is work
    assert "(queued here 1)" in (stats.line(now=50.0) or "")


def test_an_engine_that_restarted_counts_from_zero() -> None:
    core = FakeCore()
    stats = StatsLog(core)
    core.infos = {"a": _info(5000, 900)}
    stats.line(now=0.0)
    core.infos = {"a": _info(40, 10, running=1)}  # a new process: its counters began again
    assert "prompt 0.0 tok/s, generation 0.0 tok/s, running 1" in (stats.line(now=1.0) or "")
