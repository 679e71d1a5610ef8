"""Scheduler: the order of queued primitives (arrival, `waited_s`), without running a model."""

from __future__ import annotations

import time

from parrot.engine.kv_cache import KVCacheManager
from parrot.engine.scheduler import Scheduler
from parrot.engine.sequence import Job, JobKind
from parrot.protocol import SamplingParams
from tests.conftest import tiny_engine_config


def _scheduler() -> Scheduler:
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64])
    return Scheduler(KVCacheManager(256, cfg.page_size), cfg, max_len=512)


def _fill(ctx: str, n: int, waited: float = 0.0, parent: str | None = None) -> Job:
    return Job(JobKind.FILL, ctx, parent, fill_tokens=[5] * n, arrival=time.monotonic() - waited)


def test_prefill_runs_in_arrival_order() -> None:
    s = _scheduler()
    for job in (_fill("a", 100), _fill("b", 100)):
        s.add(job)
    plan = s.schedule()
    assert [slot.job.context_id for slot in plan.prefill] == ["a"]  # "a" takes the whole token budget


def test_work_that_waited_upstream_goes_first() -> None:
    """A task's later primitive (e.g. its last fill) keeps the task's place instead of queueing behind
    primitives of tasks that arrived after it."""
    s = _scheduler()
    s.add(_fill("late-1", 100))
    s.add(_fill("late-2", 100))
    s.add(_fill("early", 10, waited=5.0))
    assert [j.context_id for j in s.waiting] == ["early", "late-1", "late-2"]
    plan = s.schedule()
    assert [slot.job.context_id for slot in plan.prefill][:1] == ["early"]


def test_waited_work_never_overtakes_work_on_its_contexts() -> None:
    s = _scheduler()
    first = _fill("p", 40)
    s.add(first)
    s.add(_fill("other", 40))
    gen = Job(JobKind.GENERATE, "child", "p", sampling=SamplingParams(max_tokens=4), arrival=time.monotonic() - 60)
    s.add(gen)  # forks "p": must not run before the fill of "p" queued ahead of it
    refill = _fill("p", 8, waited=60.0)
    s.add(refill)  # more tokens for "p": must stay behind the fork of "p" queued before it
    assert [j.context_id for j in s.waiting] == ["p", "child", "p", "other"]
    assert list(s.waiting)[:3] == [first, gen, refill]


def test_prefill_chunks_end_at_attention_buckets() -> None:
    """A chunk is cut where the context reaches an attention-length bucket, so that it attends over the
    shorter padded length (e.g. 481 tokens after a 31-token prefix, not 512 that would need 1024 keys)."""
    s = _scheduler()  # kv buckets 64 128 256 512, token budget 64
    s.tokens["p"] = [5] * 100
    s.kv.create("p")
    s.kv.extend("p", 100)  # 100 tokens already in the KV
    s.add(_fill("p", 50))
    plan = s.schedule()
    assert len(plan.prefill[0].tokens) == 28  # 100 + 28 = 128, the next bucket; the rest in the next step
    assert s._align(0, 64) == 64 and s._align(60, 64) == 64  # whole chunk within a bucket / less than half fits


def test_priority_goes_before_arrival() -> None:
    """Latency-critical work (priority 0) is prefilled before throughput work (1) that arrived earlier."""
    s = _scheduler()
    batch = _fill("batch", 100, waited=10.0)
    batch.priority = 1
    s.add(batch)
    s.add(_fill("chat", 30))
    plan = s.schedule()
    assert [slot.job.context_id for slot in plan.prefill][0] == "chat"
