"""Scheduler without a model: the order of queued primitives (arrival, `waited_s`), and whole steps
(schedule -> fake sampled tokens -> update) through preemption, eviction, forks under pressure and aborts."""

from __future__ import annotations

import time

import pytest

from parrot.engine import scheduler
from parrot.engine.kv_cache import KVCacheManager, OutOfPages
from parrot.engine.scheduler import Scheduler, _end_run, _run_span
from parrot.engine.sequence import Job, JobKind, JobOutput, JobStatus
from parrot.engine.structured import ConstraintError, Grammars
from parrot.errors import AbortedError, InvalidRequestError, KVCacheFullError, code_of
from parrot.protocol import SamplingParams
from tests.conftest import tiny_engine_config, tiny_tokenizer


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


# ---- the step structure driven without a model: schedule -> (fake) execute -> update --------------
TOKEN = 7  # what the fake runner "samples" for every slot


def _small(pages: int) -> Scheduler:
    """A scheduler over a pool of `pages` allocatable pages of 16 tokens (page 0 is the scratch page)."""
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64])
    return Scheduler(KVCacheManager(1 + pages, cfg.page_size), cfg, max_len=512)


def _gen(ctx: str, max_tokens: int, parent: str | None = None, stop: frozenset[int] = frozenset()) -> Job:
    job = Job(JobKind.GENERATE, ctx, parent, sampling=SamplingParams(max_tokens=max_tokens))
    job.stop_ids = stop
    return job


def _drive(s: Scheduler, max_steps: int = 500) -> list[JobOutput]:
    """Run steps until no work is left, sampling TOKEN for every slot; returns every output."""
    outputs: list[JobOutput] = []
    for _ in range(max_steps):
        if not s.has_work():
            return outputs
        plan = s.schedule()
        for slot in plan.slots:  # what the runner relies on: the KV pages cover the fed positions
            assert len(slot.pages) * s.kv.page_size >= slot.start + len(slot.tokens)
        outputs += s.update(plan, [TOKEN] * len(plan.slots))
    raise AssertionError("the scheduler did not finish its work")


def _results(outputs: list[JobOutput]) -> dict[str, object]:
    return {o.job.context_id: o.result if o.error is None else o.error for o in outputs if o.finished}


def test_update_applies_tokens_and_finishes_jobs() -> None:
    s = _small(32)
    s.add(_fill("a", 40))
    s.add(_gen("a", 3))
    outputs = _drive(s)
    fill_out, *gen_outs = outputs
    assert fill_out.result.num_tokens == 40
    tokens = [c.token_id for o in gen_outs for c in o.chunks if c.token_id is not None]
    assert tokens == [TOKEN] * 3
    final = gen_outs[-1]
    assert final.result.token_ids == [TOKEN] * 3 and final.result.finish_reason == "length"
    assert final.chunks[-1].finish_reason == "length" and final.chunks[-1].token_id is None
    assert final.result.num_tokens == 43 and s.tokens["a"] == [5] * 40 + [TOKEN] * 3
    assert s.kv.get("a").num_tokens == 42  # the last sampled token is fed by the next primitive
    assert not s.running and not s.busy


def test_stop_token_ends_a_generate() -> None:
    s = _small(32)
    s.add(_fill("a", 10))
    s.add(_gen("a", 50, stop=frozenset({TOKEN})))
    result = _results(_drive(s))["a"]
    assert result.finish_reason == "stop" and result.token_ids == [] and result.stop_reason is None  # as EOS
    s.add(_fill("b", 10))
    job = Job(JobKind.GENERATE, "b", None, sampling=SamplingParams(max_tokens=50, stop_token_ids=[TOKEN]))
    job.stop_ids = job.named_stop_ids = frozenset({TOKEN})
    s.add(job)
    result = _results(_drive(s))["b"]
    assert result.finish_reason == "stop" and result.stop_reason == TOKEN  # one the request named


def test_preemption_when_pages_run_out_finishes_every_job() -> None:
    """Two generates that cannot both fit: the newer one is preempted (its KV dropped), recomputed
    later, and both finish with their full output; no page leaks."""
    s = _small(6)  # 96 token slots
    for name in ("old", "new"):
        s.add(_fill(name, 30))
        s.add(_gen(name, 30))  # 60 tokens each: 120 > 96
    results = _results(_drive(s))
    assert s.preemptions > 0
    assert all(len(results[n].token_ids) == 30 for n in ("old", "new"))
    for name in ("old", "new"):
        s.free_context(name)
    assert s.kv.num_free_pages == 6



def test_a_full_batch_of_throughput_work_makes_room_for_latency_work() -> None:
    """Priority preemption: with the batch full of throughput generates (priority 1), a latency-critical prompt and
    generate (priority 0) take the newest one's place at once (it is preempted and recomputed later) instead of
    waiting for a whole generation to end; every job still finishes with its full output. Work of the same
    priority waits for room."""
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], max_batch_size=2)
    s = Scheduler(KVCacheManager(64, cfg.page_size), cfg, max_len=512)
    batch = {}
    for name in ("b1", "b2"):
        for job in (_fill(name, 20), _gen(name, 40)):
            job.priority = 1
            s.add(job)
        batch[name] = job
    outputs: list[JobOutput] = []
    while not all(job.output_ids for job in batch.values()):  # both decode: the batch is full
        plan = s.schedule()
        outputs += s.update(plan, [TOKEN] * len(plan.slots))
    other = _fill("b3", 20)
    other.priority = 1
    s.add(other)
    plan = s.schedule()
    outputs += s.update(plan, [TOKEN] * len(plan.slots))
    assert other.status is JobStatus.WAITING and s.priority_preemptions == 0  # no more urgent than the batch
    chat = _gen("chat", 3)
    s.add(_fill("chat", 10))
    s.add(chat)
    plan = s.schedule()
    assert [slot.job.context_id for slot in plan.prefill] == ["chat"]  # at once
    assert batch["b2"].status is JobStatus.WAITING and s.priority_preemptions == 1  # the newest yielded
    outputs += s.update(plan, [TOKEN] * len(plan.slots))
    outputs += _drive(s)
    done = [o.job for o in outputs if o.finished and o.error is None]
    assert done.index(chat) < done.index(batch["b1"]) < done.index(batch["b2"])
    assert all(len(job.output_ids) == 40 for job in batch.values()) and len(chat.output_ids) == 3
    assert s.kv.get("b2").num_tokens == 59  # recomputed: its prompt and 39 of its tokens fed again


def _full_of_throughput_work(handoff_ms: int = 50, batch: int = 2) -> tuple[Scheduler, dict[str, Job], list[JobOutput]]:
    """A scheduler whose batch is full of decoding throughput generates (priority 1), b1, b2, ..."""
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], max_batch_size=batch,
                             priority_handoff_ms=handoff_ms)
    s = Scheduler(KVCacheManager(64, cfg.page_size), cfg, max_len=512)
    gens = {}
    for i in range(batch):
        for job in (_fill(f"b{i + 1}", 20), _gen(f"b{i + 1}", 40)):
            job.priority = 1
            s.add(job)
        gens[job.context_id] = job
    outputs: list[JobOutput] = []
    while not all(job.output_ids for job in gens.values()):
        plan = s.schedule()
        outputs += s.update(plan, [TOKEN] * len(plan.slots))
    return s, gens, outputs


def _one_step(s: Scheduler, outputs: list[JobOutput]) -> None:
    plan = s.schedule()
    outputs += s.update(plan, [TOKEN] * len(plan.slots))


def test_an_urgent_prompt_keeps_its_slot_for_the_generate_sent_after_it() -> None:
    """A core reaching the engine over HTTP sends a latency-critical call's generate only once its fill has
    answered. The fill preempted a throughput job; that job is not let back in meanwhile (to be preempted again,
    its KV recomputed twice): the slot waits for the generate, which forks the filled context."""
    s, gens, outputs = _full_of_throughput_work()
    chat = _fill("chat", 10)
    s.add(chat)
    while chat.status is not JobStatus.FINISHED:
        _one_step(s, outputs)
    assert s.priority_preemptions == 1 and gens["b2"].status is JobStatus.WAITING
    assert list(s.kept) == ["chat"]
    for _ in range(3):  # the generate is on its way: b2 stays out, b1 decodes on
        _one_step(s, outputs)
    assert gens["b2"].status is JobStatus.WAITING and gens["b1"].status is JobStatus.RUNNING
    reply = _gen("chat-reply", 3, parent="chat")
    s.add(reply)
    _one_step(s, outputs)
    assert reply.status is JobStatus.RUNNING and not s.kept and s.kept_slots == 1
    outputs += _drive(s)
    assert s.priority_preemptions == 1  # once, not twice
    done = [o.job for o in outputs if o.finished and o.error is None]
    assert done.index(reply) < done.index(gens["b2"])
    assert len(reply.output_ids) == 3 and all(len(job.output_ids) == 40 for job in gens.values())


def test_a_kept_slot_is_let_go_when_nothing_follows() -> None:
    """A fill nothing follows (e.g. a prefix kept for later) holds its slot `priority_handoff_ms` at most; an
    engine with nothing else to run waits that long, not longer, and 0 keeps nothing."""
    s, gens, outputs = _full_of_throughput_work(handoff_ms=30, batch=1)
    s.add(_fill("prefix", 10))
    while "prefix" not in s.kept:
        _one_step(s, outputs)
    assert not s.running and gens["b1"].status is JobStatus.WAITING
    assert not s.has_work() and 0 < s.wake_in() <= 0.03  # the engine loop sleeps until then
    time.sleep(0.04)
    assert s.has_work()
    _one_step(s, outputs)
    assert gens["b1"].status is JobStatus.RUNNING and not s.kept and s.kept_slots == 0
    s2, _, outputs2 = _full_of_throughput_work(handoff_ms=0, batch=1)
    s2.add(_fill("prefix", 10))
    outputs2 += _drive(s2)
    assert not s2.kept and all(o.error is None for o in outputs2)


def test_no_slot_is_kept_when_the_generate_came_with_the_fill() -> None:
    """A core in the engine's process hands over the fill and the generate at once: nothing is kept, and freeing
    a context lets go a slot kept for it."""
    s, _, outputs = _full_of_throughput_work()
    s.add(_fill("chat", 10))
    s.add(_gen("chat", 3))
    outputs += _drive(s)
    assert s.kept_slots == 0 and not s.kept and s.priority_preemptions == 1
    s, _, outputs = _full_of_throughput_work()
    s.add(_fill("gone", 10))
    while "gone" not in s.kept:
        _one_step(s, outputs)
    s.free_context("gone")
    assert not s.kept


@pytest.mark.parametrize("how", ["waited", "priority"])
def test_work_taken_while_a_job_runs_on_its_context_stays_behind_it_when_that_job_is_preempted(how: str) -> None:
    """A fill sent for a context while a generate runs there, marked as having waited upstream (or more urgent than
    the generate), must not overtake it when the generate is preempted and queued again: it ran between the
    generate's tokens, and the resumed generate found the fill's tokens in its pending ones (the engine loop
    died on an assertion)."""
    s = _small(6)  # 96 token slots; two generates of 60 tokens each
    for name in ("old", "new"):
        s.add(_fill(name, 30))
    gens = {name: _gen(name, 30) for name in ("old", "new")}
    gens["new"].priority = 1 if how == "priority" else 0
    for job in gens.values():
        s.add(job)
    outputs: list[JobOutput] = []
    while not all(job.status == JobStatus.RUNNING and job.output_ids for job in gens.values()):
        plan = s.schedule()
        outputs += s.update(plan, [TOKEN] * len(plan.slots))
    refill = _fill("new", 5, waited=100.0 if how == "waited" else 0.0)
    s.add(refill)
    outputs += _drive(s)
    assert s.preemptions > 0
    done = [o.job for o in outputs if o.finished and o.error is None]
    assert done.index(gens["new"]) < done.index(refill)
    assert s.tokens["new"] == [5] * 30 + [TOKEN] * 30 + [5] * 5  # the generate's tokens, then the fill's
    assert all(len(o.result.token_ids) == 30 for o in outputs if o.finished and o.job in gens.values())


def test_idle_contexts_are_evicted_and_recomputed() -> None:
    s = _small(6)
    s.add(_fill("idle", 60))  # 4 pages, then idle
    _drive(s)
    s.add(_fill("busy", 60))  # needs 4 of the 6 pages: "idle" loses its KV, keeps its tokens
    _drive(s)
    assert s.evictions >= 1 and s.kv.get("idle").num_tokens < 60 and len(s.tokens["idle"]) == 60
    s.free_context("busy")
    s.add(_gen("idle", 2))  # recomputes the evicted prompt, then decodes
    result = _results(_drive(s))["idle"]
    assert result.num_tokens == 62 and s.kv.get("idle").num_tokens == 61


def test_fork_waits_for_a_page_instead_of_failing() -> None:
    """A fork of 20 of a parent's 32 tokens needs one free page (for the parent's second page's first 4 tokens);
    while a running job holds the rest of the pool it waits (then evicts the finished job's KV and runs) rather
    than failing."""
    s = _small(4)
    s.add(_fill("parent", 32))  # 2 full pages
    s.add(_fill("hog", 30))  # the other 2 pages
    _drive(s)
    s.add(_gen("hog", 2))  # runs, holding its pages
    child = _gen("child", 2, parent="parent")
    child.parent_num_tokens = 20
    s.add(child)
    plan = s.schedule()
    assert [slot.job.context_id for slot in plan.slots] == ["hog"] and not plan.outputs
    s.update(plan, [TOKEN] * len(plan.slots))
    results = _results(_drive(s))
    assert not isinstance(results["child"], Exception), results["child"]
    assert results["child"].num_tokens == 22 and results["hog"].num_tokens == 32


def test_fork_evicts_idle_contexts_for_its_page() -> None:
    s = _small(3)
    s.add(_fill("parent", 20))
    s.add(_fill("idle", 16))
    _drive(s)
    assert s.kv.num_free_pages == 0
    s.add(_fill("child", 4, parent="parent"))
    results = _results(_drive(s))
    assert results["child"].num_tokens == 24 and s.evictions == 1
    assert s.kv.get("parent").num_tokens == 20  # the parent itself keeps its KV


def test_idle_contexts_sharing_their_pages_are_evicted_together() -> None:
    """A prefix and a fork of it preempted back to the pages they share (any idle contexts holding only pages
    they share): neither owns a page alone, yet dropping both frees them. A job that needs the room gets it (it
    failed before: "the rest of the pool is held by other contexts"), and the fork, run again, recomputes its
    prompt and gives what it would have."""
    s = _small(8)  # 128 token slots
    s.add(_fill("p", 32))  # 2 full pages
    _drive(s)
    fork = _fill("c", 80, parent="p")
    s.add(fork)
    _steps(s, 1)  # its first 64 tokens
    s._preempt(fork)  # back to the 32 tokens it shares with "p"
    assert s.kv.get("c").pages == s.kv.get("p").pages and s.kv.num_free_pages == 6
    s.waiting.clear()  # (held back while the other job needs the pool)
    s.add(_fill("x", 128))  # every page
    results = _results(_drive(s))
    assert results["x"].num_tokens == 128 and s.evictions == 2
    assert s.kv.get("p").num_tokens == 0 == s.kv.get("c").num_tokens and len(s.tokens["p"]) == 32
    s.free_context("x")
    fork.status = JobStatus.WAITING
    s.waiting.append(fork)
    s.add(_gen("c", 2))
    assert _results(_drive(s))["c"].num_tokens == 114 and s.row_fed["c"] == bytes(111) + b"\x01" * 2


def test_a_fork_too_big_for_the_pool_is_refused_as_such_before_forking() -> None:
    """A prompt holding the whole pool and a generate forking it that could never fit: the answer is the clear
    refusal ("needs N tokens of KV"), not a full cache (which a serve core retries in vain, and which depends on
    what else is cached); nothing is made of the fork. A fork that would generate from nothing is refused too."""
    s = _small(4)  # 64 token slots
    s.add(_fill("p", 60))
    _drive(s)
    s.add(_gen("c", 10, parent="p"))
    empty = _gen("e", 2, parent="p")
    empty.parent_num_tokens = 0
    s.add(empty)
    errors = {o.job.context_id: str(o.error) for o in _drive(s)}
    assert errors == {"c": "context 'c' needs 70 tokens of KV; the whole cache holds 64",
                      "e": "context 'e' is empty: fill it before generating"}
    assert "c" not in s.kv and "e" not in s.kv and s.kv.get("p").num_tokens == 60


def test_a_fork_of_a_prompt_filling_the_pool_recomputes_its_tail_page() -> None:
    """A prompt ending on a partial page that fills the pool, and a generate forking it that fits the pool too:
    there is no page to copy the parent's partial page into, so the parent's tail page is dropped (its tokens
    stay) and the fork recomputes those tokens into it, fed as the prompt was, instead of failing."""
    s = _small(4)  # 64 token slots
    s.add(_fill("p", 60))  # 4 pages, the last holding 12 tokens
    _drive(s)
    assert s.kv.num_free_pages == 0
    s.add(_gen("c", 3, parent="p"))
    results = _results(_drive(s))
    assert results["c"].num_tokens == 63 and results["c"].token_ids == [TOKEN] * 3
    assert s.row_fed["c"] == bytes(59) + b"\x01" * 3  # recomputed as "p" was fed; its last token for the logits
    assert s.kv.get("p").num_tokens == 48 and len(s.tokens["p"]) == 60


def test_abort_running_and_queued_jobs() -> None:
    s = _small(32)
    s.add(_fill("a", 20))
    s.add(_gen("a", 100))
    s.add(_fill("a", 5))  # queued behind the generate
    plan = s.schedule()
    s.update(plan, [TOKEN] * len(plan.slots))  # the fill ran; the generate is now running
    plan = s.schedule()
    s.update(plan, [TOKEN] * len(plan.slots))
    outputs = s.abort("a")
    assert [type(o.error) for o in outputs] == [AbortedError, AbortedError]
    assert not s.has_work() and s.aborts == 2 and not s.referenced("a")
    assert len(s.tokens["a"]) == 21  # the prompt and the one generated token stay; the queued fill never ran
    assert s.abort("a") == []


def test_a_failed_step_rolls_back_its_fills() -> None:
    s = _small(32)
    s.add(_fill("a", 20))
    _drive(s)
    s.add(_fill("a", 10))
    plan = s.schedule()
    outputs = s.fail_step(plan, InvalidRequestError("boom"))
    assert [str(o.error) for o in outputs] == ["boom"]
    assert len(s.tokens["a"]) == 20 and s.kv.get("a").num_tokens == 20
    assert not s.running and not s.busy


def test_the_work_counting_on_a_failed_fill_fails_with_it() -> None:
    """A fill, then primitives sent behind it that fork its context (and fork those), as the serve core
    pipelines a prompt's prefixes and its generate: the fill fails, the context it forked is freed (its
    client never had it; a fill on an existing context only loses its tokens), and everything counting on it
    fails with an error of the fill's kind (a full KV cache: retry) instead of forking the emptied context and
    filling or generating from the wrong prompt."""
    s = _small(32)
    s.add(_fill("base", 20))
    _drive(s)
    s.add(_fill("a", 40, parent="base"))
    s.add(_fill("b", 10, parent="a"))
    s.add(_gen("c", 3, parent="b"))
    s.add(_fill("d", 5, parent="b"))
    s.add(_gen("e", 3, parent="d"))
    plan = s.schedule()
    assert [slot.job.context_id for slot in plan.slots] == ["a"]
    outputs = s.fail_step(plan, OutOfPages(1, 0, "continue context 'a'"))
    errors = {o.job.context_id: o.error for o in outputs}
    assert list(errors) == ["a", "b", "c", "d", "e"]
    assert all(code_of(err) == "kv_cache_full" for err in errors.values())
    assert all(isinstance(errors[c], KVCacheFullError) for c in "bcde")  # an EngineOverloadedError: retried
    assert "the fill of context 'a' failed" in str(errors["e"]) and "KV cache is full" in str(errors["e"])
    assert not any(c in s.tokens or c in s.kv for c in "abcde") and not s.has_work()  # the fork "a" made: gone
    assert s.kv.num_free_pages == s.kv.total_pages - 2  # "base"'s two pages alone are held


def test_work_not_counting_on_a_failed_fill_goes_on() -> None:
    """Only what was sent after the fill on its context, or forking it, fails with it: work on the context the
    fill forked, and on other contexts, goes on (here the fill fails as it is set up: too long for the pool)."""
    s = _small(4)  # 64 token slots
    s.add(_fill("base", 20))
    _drive(s)
    s.add(_fill("a", 60, parent="base"))  # 80 tokens: more than the whole pool
    s.add(_gen("b", 2, parent="a"))
    s.add(_fill("x", 10))
    s.add(_gen("base", 2))
    s.add(_gen("y", 2, parent="base"))
    outputs = _drive(s)
    errors = {o.job.context_id: o.error for o in outputs if o.error is not None}
    assert list(errors) == ["a", "b"] and all(isinstance(e, InvalidRequestError) for e in errors.values())
    results = _results(outputs)
    assert results["x"].num_tokens == 10 and results["base"].token_ids == [TOKEN] * 2
    assert results["y"].num_tokens == 24  # base's 20, base's 2 generated (sent before it), its own 2


def test_an_aborted_fill_takes_its_forks_with_it() -> None:
    s = _small(32)
    s.add(_fill("a", 100))  # two chunks
    s.add(_gen("c", 3, parent="a"))
    plan = s.schedule()
    s.update(plan, [TOKEN] * len(plan.slots))
    outputs = s.abort("a")
    assert [(o.job.context_id, type(o.error)) for o in outputs] == [("a", AbortedError), ("c", AbortedError)]
    assert "forks a context counting on it" in str(outputs[1].error)
    assert not s.has_work() and "a" not in s.kv and s.kv.num_free_pages == s.kv.total_pages


# ---- constraints: the matcher advances with each applied token --------------------------------------
def _constrained(ctx: str, grammars: Grammars, **sampling) -> Job:
    sp = SamplingParams(**({"max_tokens": 20} | sampling))
    return Job(JobKind.GENERATE, ctx, None, sampling=sp, constraint=grammars.compile(sp))


def _step(s: Scheduler, sampled: dict[str, int]) -> list[JobOutput]:
    plan = s.schedule()
    return s.update(plan, [sampled.get(slot.job.context_id, TOKEN) for slot in plan.slots])


def test_a_token_the_grammar_rejects_fails_only_its_job() -> None:
    tok = tiny_tokenizer()
    grammars = Grammars(tok, 260)
    s = _small(32)
    for ctx in ("a", "b"):
        s.add(_fill(ctx, 10))
    _step(s, {})
    s.add(_constrained("a", grammars, regex="[ab]+"))
    s.add(_gen("b", 3))
    outputs = _step(s, {"a": tok.encode("z")[0]})  # what a runner without the mask would sample
    failed = [o for o in outputs if o.error is not None]
    assert [o.job.context_id for o in failed] == ["a"] and isinstance(failed[0].error, ConstraintError)
    assert "b" in s.busy and "a" not in s.busy
    assert _results(_drive(s))["b"].token_ids == [TOKEN] * 3


def test_forced_tokens_are_fed_as_the_rows_of_one_step() -> None:
    """After a sampled "b" the grammar forces "cdef": they join the output at once and the next step feeds all
    five tokens as decode rows of their own (a rows slot), then samples after the last: a generated token is
    always a decode row's, whatever else runs."""
    tok = tiny_tokenizer()
    s = _small(32)
    s.add(_fill("a", 10))
    _step(s, {})
    s.add(_constrained("a", Grammars(tok, 260), regex="[ab]cdef[gh]"))
    outputs = _step(s, {"a": tok.encode("b")[0]})
    assert [tok.decode([c.token_id]) for c in outputs[0].chunks] == list("bcdef")
    plan = s.schedule()
    assert not plan.prefill
    assert [(len(slot.tokens), slot.rows, slot.sample) for slot in plan.decode] == [(5, True, True)]
    assert s.fast_forward_tokens == 4  # decode steps saved
    outputs = s.update(plan, [tok.encode("h")[0]])
    result = outputs[0].result
    assert tok.decode(result.token_ids) == "bcdefh" and result.finish_reason == "stop"  # the grammar is complete
    assert s.row_fed["a"] == bytes(9) + b"\x01" * 6  # the prompt's chunk, the re-fed last token and the rows


def test_forced_tokens_go_beside_the_decodes_and_the_prompts_as_rows() -> None:
    """A job's forced tokens are a rows slot in the decode batch beside the others' decodes, whether or not a
    prompt chunk runs in the step too (never a prompt chunk: a generated token's bits are a decode row's)."""
    tok = tiny_tokenizer()
    s = _small(64)
    s.max_prefill_batch = 1
    for ctx in ("a", "x"):
        s.add(_fill(ctx, 10))
    _step(s, {})
    s.add(_constrained("a", Grammars(tok, 260), regex="[ab]cd[gh]"))
    s.add(_gen("x", 10))
    _step(s, {"a": tok.encode("a")[0]})  # both sampled a first token; "a" has "cd" forced
    s.add(_fill("big", 60, waited=10.0))
    plan = s.schedule()
    assert [(slot.job.context_id, len(slot.tokens), slot.sample, slot.rows) for slot in plan.decode] == [
        ("x", 1, True, False), ("a", 3, True, True)]
    assert [(slot.job.context_id, len(slot.tokens), slot.prompt) for slot in plan.prefill] == [("big", 60, True)]
    assert s.fast_forward_tokens == 2
    result = s.update(plan, [TOKEN, tok.encode("g")[0], TOKEN])[1].result
    assert tok.decode(result.token_ids) == "acdg" and result.finish_reason == "stop"


def test_rows_beyond_the_batch_go_in_later_steps() -> None:
    """A rows slot takes the rows the batch has left (`max_batch_size`); the rest of the job's forced tokens go
    in the next step, and only the step that feeds the last of them samples."""
    tok = tiny_tokenizer()
    s = _small(64)
    s.cfg.max_batch_size = 4
    for ctx in ("a", "x", "y"):
        s.add(_fill(ctx, 10))
    _step(s, {})
    s.add(_constrained("a", Grammars(tok, 260), regex="[ab]cdef[gh]"))
    s.add(_gen("x", 10))
    s.add(_gen("y", 10))
    _step(s, {"a": tok.encode("b")[0]})  # "b" sampled, "cdef" forced: five tokens to feed
    plan = s.schedule()
    assert [(slot.job.context_id, len(slot.tokens), slot.sample) for slot in plan.decode] == [
        ("x", 1, True), ("y", 1, True), ("a", 2, False)]
    s.update(plan, [TOKEN] * len(plan.slots))
    plan = s.schedule()
    assert [(slot.job.context_id, len(slot.tokens), slot.sample) for slot in plan.decode] == [
        ("x", 1, True), ("y", 1, True), ("a", 2, False)]
    s.update(plan, [TOKEN] * len(plan.slots))
    plan = s.schedule()
    assert ("a", 1, True) in [(slot.job.context_id, len(slot.tokens), slot.sample) for slot in plan.decode]


def _feeds(plan) -> list[tuple[str, int, bool]]:  # noqa: ANN001
    """Each slot of a plan: its context, its tokens, and whether they go as decode rows."""
    return [(slot.job.context_id, len(slot.tokens), slot in plan.decode) for slot in plan.slots]


def test_a_preempted_job_is_recomputed_as_it_was_fed() -> None:
    """A preempted generate's KV is recomputed the way each token was fed: its prompt in a prompt chunk, its
    generated tokens as decode rows (a rows slot), so it gets the same bits as if it had kept its KV."""
    s = _small(6)  # 96 token slots
    for name in ("old", "new"):
        s.add(_fill(name, 30))
        s.add(_gen(name, 30))  # 60 tokens each: 120 > 96
    new: list[tuple[int, bool, bool, bool]] = []  # each slot of "new": tokens, as rows, a rows slot, sampling
    outputs: list[JobOutput] = []
    while s.has_work():
        plan = s.schedule()
        new += [(len(slot.tokens), slot in plan.decode, slot.rows, slot.sample) for slot in plan.slots
                if slot.job.context_id == "new"]
        outputs += s.update(plan, [TOKEN] * len(plan.slots))
    assert s.preemptions > 0
    # once resumed for the last time: the prompt but its last token in a chunk, that token and the 18 generated
    # ones fed before the preemption as rows (16 a step: the batch), the last sampling, then plain decodes
    last = max(i for i, feed in enumerate(new) if feed == (29, False, False, False))
    assert new[last + 1 : last + 4] == [(16, True, True, False), (3, True, True, True), (1, True, False, True)]
    assert all(len(_results(outputs)[n].token_ids) == 30 for n in ("old", "new"))
    assert s.row_fed["new"] == bytes(29) + b"\x01" * 30  # the last sampled token was never fed
    for name in ("old", "new"):
        s.free_context(name)
    assert s.kv.num_free_pages == 6


def test_an_evicted_context_is_recomputed_as_it_was_fed() -> None:
    """A conversation's context (a prompt, a reply, a follow-up) evicted while idle is recomputed the way each
    token was fed: prompt chunks for the prompts, decode rows for the reply and for each prompt's last token,
    which a generate fed again as a decode row for its logits."""
    s = _small(6)
    s.add(_fill("chat", 20))
    s.add(_gen("chat", 5))
    s.add(_fill("chat", 8))
    _drive(s)
    assert s.row_fed["chat"] == bytes(19) + b"\x01" * 5 + bytes(9)  # the reply's last token fed in the chunk
    s.add(_fill("hog", 90))  # the whole pool: "chat" loses its KV, keeps its tokens and how they were fed
    _drive(s)
    assert s.evictions >= 1 and s.kv.get("chat").num_tokens == 0
    s.free_context("hog")
    s.add(_gen("chat", 2))
    plan = s.schedule()
    assert _feeds(plan) == [("chat", 19, False)]
    s.update(plan, [TOKEN])
    plan = s.schedule()
    assert _feeds(plan) == [("chat", 5, True)] and plan.decode[0].rows and not plan.decode[0].sample
    s.update(plan, [TOKEN])
    plan = s.schedule()
    assert _feeds(plan) == [("chat", 8, False)]  # the reply's last token and the follow-up but its last token
    s.update(plan, [TOKEN])
    plan = s.schedule()
    assert _feeds(plan) == [("chat", 1, True)] and plan.decode[0].sample


def test_a_fork_waits_for_its_parents_fill_even_queued_again_behind_it() -> None:
    """A fill and the generate forking its context sent together (one arrival, as the serve core sends them):
    the fill preempted mid-way is queued again before the fork (submission order among equal arrivals), and
    the fork is not set up until the fill is done: it copies no token whose KV no step computed, and its
    prompt is recomputed in prompt chunks, as the context was fed."""
    s = _small(32)
    arrival = time.monotonic()
    fill = Job(JobKind.FILL, "p", None, fill_tokens=[5] * 100, arrival=arrival)  # two chunks of 64 tokens
    gen = Job(JobKind.GENERATE, "c", "p", sampling=SamplingParams(max_tokens=2), arrival=arrival)
    s.add(fill)
    s.add(gen)
    plan = s.schedule()
    assert _feeds(plan) == [("p", 64, False)]
    s.update(plan, [TOKEN] * len(plan.slots))
    s._preempt(fill)  # as pressure elsewhere would: its KV dropped, queued again
    assert list(s.waiting) == [fill, gen]
    s.waiting.rotate()  # even where it stands behind the fork (a fork that claims to have waited longer)
    fed: list[tuple[str, int, bool]] = []
    outputs: list[JobOutput] = []
    while s.has_work():
        plan = s.schedule()
        fed += _feeds(plan)
        outputs += s.update(plan, [TOKEN] * len(plan.slots))
    assert fed[:2] == [("p", 64, False), ("p", 36, False)]  # the fill first, whole, before the fork runs
    assert s.row_fed["c"] == bytes(99) + b"\x01" * 2  # the prompt as prompt rows; its last token and the reply
    assert _results(outputs)["c"].token_ids == [TOKEN] * 2


def test_the_newest_of_jobs_that_arrived_together_is_preempted_each_time() -> None:
    """Jobs of one arrival (a request's n choices): the one preempted for room is the last submitted, whatever
    the order they run in; not the first found, which after each requeue is another one: each in turn then
    loses its recomputed KV, and none may finish."""
    for order in ((2, 0, 1), (1, 2, 0), (0, 1, 2)):
        s = _small(6)  # 96 token slots
        arrival = time.monotonic()
        s.add(Job(JobKind.FILL, "p", None, fill_tokens=[5] * 20, arrival=arrival))
        jobs = [Job(JobKind.GENERATE, f"c{i}", "p", sampling=SamplingParams(max_tokens=40), arrival=arrival)
                for i in range(3)]
        for job in jobs:
            s.add(job)
        while s.kv.num_free_pages or len(s.running) < 3:
            _steps(s, 1)
        s.running = [jobs[i] for i in order]
        before = [j.preemptions for j in jobs]
        assert s._make_room(jobs[0], 16, set(), scheduler.StepPlan())
        assert [j.status for j in jobs] == [JobStatus.RUNNING, JobStatus.RUNNING, JobStatus.WAITING], order
        assert [j.preemptions - b for j, b in zip(jobs, before, strict=True)] == [0, 0, 1]


# ---- greedy constrained jobs in multi-step calls, checked as applied (lazy_constraints: CPUs) ---------------
UNMASKED = "abzba"  # the fake model's argmax at each position, without a mask
FALLBACK = "abcdefz"  # a single step's masked argmax where the grammar refuses the unmasked one: the first it takes


def _constrained_run(lazy: bool) -> tuple[Scheduler, dict, list]:
    """Two greedy jobs under grammars that refuse some of the fake model's tokens and force others, and one
    unconstrained job, driven to the end with up to 4 decode steps a call. A single step's token is the masked
    argmax (what the runner gives), a multi-step call's the unmasked one (what the device loop samples)."""
    tok = tiny_tokenizer()
    ids = {ch: tok.encode(ch)[0] for ch in set(UNMASKED + FALLBACK)}
    grammars = Grammars(tok, 260)
    s = _small(64)
    s.lazy_constraints = lazy
    for ctx in ("g1", "g2", "free"):
        s.add(_fill(ctx, 10 + len(ctx)))
    s.add(_constrained("g1", grammars, regex="[ab]{3}cdef[ab]+z", max_tokens=30))
    s.add(_constrained("g2", grammars, regex="(ab|ba)+z", max_tokens=30))
    s.add(_gen("free", 25))

    def unmasked(pos: int) -> int:
        return ids[UNMASKED[pos % len(UNMASKED)]]

    def single(slot) -> int:  # noqa: ANN001
        t = unmasked(slot.start + len(slot.tokens))
        c = slot.job.constraint
        return t if c is None or c.accepts(t) else next(ids[ch] for ch in FALLBACK if c.accepts(ids[ch]))

    outputs: list[JobOutput] = []
    plans: list = []
    inflight = None
    fits = lambda jobs, pages, kv_len, k: True  # noqa: E731
    while s.has_work() or inflight is not None:
        plan, inflight = (inflight, None) if inflight is not None else (s.schedule(4, fits), None)
        plans.append([(slot.job.context_id, plan.steps) for slot in plan.decode])
        if plan.steps > 1:
            sampled = [[unmasked(slot.start + 1 + j) for slot in plan.slots] for j in range(plan.steps)]
        else:
            sampled = [single(slot) for slot in plan.slots]
        inflight = s.schedule_ahead(plan, 4, fits)
        assert inflight is None or not any(slot.job.constraint for slot in plan.decode)  # never constrained jobs
        outputs += s.update(plan, sampled, inflight)
        for ctx in s.tokens if inflight is None else ():  # (an ahead plan holds KV for its steps)
            assert s.kv.get(ctx).num_tokens <= len(s.tokens[ctx])  # no KV of a dropped token stays
    results = {o.job.context_id: (tok.decode(o.result.token_ids), o.result.finish_reason)
               for o in outputs if o.finished and o.job.kind is JobKind.GENERATE}
    assert all(o.error is None for o in outputs)
    for ctx in results:
        s.free_context(ctx)
    assert s.kv.num_free_pages == s.kv.total_pages
    return s, results, plans


def test_constrained_jobs_run_multi_step_calls_checked_as_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-step call's tokens of a constrained job stand while its grammar takes them (each then the masked
    argmax too); from the first it refuses, or after one its grammar forces tokens after, the rest are dropped
    and the KV cut; the refused place is sampled by a single step. The outputs are those of single steps. (By
    default only a job decoding alone runs such calls: here batches of three do, to see them side by side.)"""
    _, default, plans = _constrained_run(lazy=True)
    assert not any(steps > 1 for plan in plans for ctx, steps in plan if len(plan) > 1 and ctx.startswith("g"))
    monkeypatch.setattr(scheduler, "RUN_MAX_BATCH", 3)
    single, eager, _ = _constrained_run(lazy=False)
    assert default == eager
    lazy, results, plans = _constrained_run(lazy=True)
    assert results == eager
    assert results["g1"][0].startswith("abacdef") and results["g1"][0].endswith("z")
    assert results["g2"][1] == "stop" and results["free"][1] == "length"
    assert single.unchecked_tokens == single.unchecked_refusals == 0
    assert lazy.unchecked_tokens > 0 and lazy.unchecked_refusals > 0
    assert any(steps > 1 for plan in plans for ctx, steps in plan if ctx.startswith("g"))


def test_a_constrained_jobs_calls_are_as_long_as_its_free_runs_tend_to_be() -> None:
    """`_run_span`: a step a call at the start of a run (no evidence) and for short runs; longer calls as a run
    grows past the ones before it, or where recent runs tend to go on."""
    job = Job(JobKind.GENERATE, "a", None, sampling=SamplingParams(max_tokens=100))
    assert _run_span(job, 4) == 1  # nothing known
    job.run_tokens = 3
    assert _run_span(job, 4) == 1  # 3 / 5 < RUN_KEEP
    job.run_tokens = 12
    assert _run_span(job, 4) == 4  # a long string: 12 / 15 >= RUN_KEEP
    job.runs = [1, 2, 1, 1, 3]  # short fields: a step a call
    job.run_tokens = 0
    assert _run_span(job, 4) == 1
    job.runs = [2, 3, 2, 3, 2]  # every run has a second token, 2 of 5 a third
    assert _run_span(job, 4) == 2
    job.runs = [30, 25, 40, 2]  # long strings: 3 of 4 runs reach the call's 4th token
    assert _run_span(job, 4) == 4
    job.run_tokens = 28  # past most of them: two runs reached 28, too few to tell: 28 / 30 ... 28 / 32
    assert _run_span(job, 4) == 4
    job.runs = [30, 29, 40, 29, 2]  # four did, two of which went past 29 (< RUN_KEEP)
    assert _run_span(job, 4) == 1
    _end_run(job)
    assert job.runs[-1] == 28 and job.run_tokens == 0


# ---- overlap: the next decode step planned before the step in flight is applied ----------------------
def _token_at(ctx: str, pos: int) -> int:
    """A fake model: the token sampled at each position of a context depends on the context alone."""
    return 3 + (sum(map(ord, ctx)) * 31 + pos * 17) % 11


def _sampled(plan) -> list[int]:  # noqa: ANN001
    return [_token_at(slot.job.context_id, slot.start + len(slot.tokens)) for slot in plan.slots]


def _sampled_steps(plan) -> list[list[int]]:  # noqa: ANN001
    """The fake device of a multi-step plan: step j samples each slot's token at position start + 1 + j."""
    return [[_token_at(slot.job.context_id, slot.start + 1 + j) for slot in plan.slots] for j in range(plan.steps)]


def _drive_overlapped(s: Scheduler, overlap: bool, max_steps: int = 500, steps: int = 1,
                      fits=lambda jobs, pages, kv_len, k: True,  # noqa: ANN001
                      plans: list | None = None) -> tuple[list[JobOutput], int]:
    """The engine's loop with a fake runner: a step in flight is applied after the next one is planned
    (`schedule_ahead`, with up to `steps` decode steps a plan; `schedule` gets them too, for decode bursts).
    Returns the outputs and the number of ahead steps; `plans` collects every plan run."""
    outputs: list[JobOutput] = []
    inflight = None
    ahead_steps = 0
    for _ in range(max_steps):
        if inflight is None:
            if not s.has_work():
                return outputs, ahead_steps
            plan = s.schedule(steps, fits)
        else:
            plan, inflight = inflight, None
        if plans is not None:
            plans.append(plan)
        for slot in plan.slots:
            assert len(slot.pages) * s.kv.page_size >= slot.start + len(slot.tokens) + slot.steps - 1
            assert slot.steps <= plan.steps
        # the fake device computes before the host applies anything
        sampled = _sampled_steps(plan) if plan.steps > 1 else _sampled(plan)
        ahead = s.schedule_ahead(plan, steps, fits) if overlap else None
        if ahead is not None:
            ahead_steps += 1
            inflight = ahead
        outputs += s.update(plan, sampled, ahead)
    raise AssertionError("the scheduler did not finish its work")


def _overlap_workload(s: Scheduler) -> None:
    for i, (n, stop) in enumerate([(9, frozenset()), (30, frozenset({5})), (4, frozenset()), (20, frozenset({9}))]):
        s.add(_fill(f"c{i}", 20 + i))
        s.add(_gen(f"c{i}", n, stop=stop))


def test_overlap_gives_the_same_results_as_waiting() -> None:
    results, contexts = [], []
    for overlap in (False, True):
        s = _small(64)
        _overlap_workload(s)
        outputs, ahead = _drive_overlapped(s, overlap)
        assert (ahead > 0) == overlap
        gens = {o.job.context_id: o.result for o in outputs if o.finished and o.job.kind is JobKind.GENERATE}
        results.append({c: (r.token_ids, r.finish_reason, r.num_tokens) for c, r in gens.items()})
        # the KV never holds more tokens than the context (an unused ahead slot is dropped)
        contexts.append({c: (list(s.tokens[c]), s.kv.get(c).num_tokens) for c in gens})
        for c in gens:
            s.free_context(c)
        assert s.kv.num_free_pages == s.kv.total_pages  # every page back
    assert results[0] == results[1]
    assert {r[1] for r in results[0].values()} == {"stop", "length"}
    for c, (tokens, kv) in contexts[1].items():
        assert kv <= len(tokens) and contexts[0][c][0] == tokens


def test_multi_step_plans_give_the_same_results_as_single_steps() -> None:
    """Plans of up to k decode steps (the device feeding its own tokens) apply token by token as single
    steps would: the same outputs, stop tokens and lengths cut mid-plan, no KV beyond a context's tokens,
    every page back."""
    results, plans = [], []
    for k in (1, 3, 4):
        s = _small(64)
        _overlap_workload(s)
        seen: list[int] = []
        outputs, _ = _drive_overlapped(s, True, steps=k,
                                       fits=lambda jobs, pages, n, k, seen=seen: seen.append(k) or True)
        plans.append(max(seen, default=1))
        gens = {o.job.context_id: o.result for o in outputs if o.finished and o.job.kind is JobKind.GENERATE}
        results.append({c: (r.token_ids, r.finish_reason, r.num_tokens) for c, r in gens.items()})
        for c in gens:
            assert s.kv.get(c).num_tokens <= len(s.tokens[c])
            s.free_context(c)
        assert s.kv.num_free_pages == s.kv.total_pages
    assert results[0] == results[1] == results[2]
    assert plans == [1, 3, 4]
    assert {r[1] for r in results[0].values()} == {"stop", "length"}


def test_decode_bursts_alternate_with_prompt_steps_and_keep_results() -> None:
    """With decode bursts, while decodes and prompts both wait the steps alternate: prompt chunks alone (up
    to `decode_bursts` tokens) and decode-only plans of several steps. The outputs equal mixed steps'."""
    results, kinds = [], []
    for bursts in (None, 32):
        cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], decode_bursts=bursts)
        s = Scheduler(KVCacheManager(65, cfg.page_size), cfg, max_len=512)
        for i in range(2):  # two chats decoding ...
            s.add(_fill(f"chat{i}", 10 + i))
            s.add(_gen(f"chat{i}", 30, stop=frozenset({5}) if i else frozenset()))
        outputs, plans = [], []
        for _ in range(3):
            plan = s.schedule(4, lambda jobs, pages, n, k: True)
            outputs += s.update(plan, _sampled_steps(plan) if plan.steps > 1 else _sampled(plan))
        for i in range(2):  # ... when long prompts arrive
            s.add(_fill(f"doc{i}", 150))
            s.add(_gen(f"doc{i}", 6))
        more, _ = _drive_overlapped(s, True, steps=4, plans=plans)
        outputs += more
        gens = {o.job.context_id: o.result for o in outputs if o.finished and o.job.kind is JobKind.GENERATE}
        results.append({c: (r.token_ids, r.finish_reason) for c, r in gens.items()})
        for c in gens:
            assert s.kv.get(c).num_tokens <= len(s.tokens[c])
            s.free_context(c)
        assert s.kv.num_free_pages == s.kv.total_pages
        kinds.append([("d" if p.decode else "") + ("p" if p.prefill else "") + (f"x{p.steps}" if p.steps > 1 else "")
                      for p in plans])
        if bursts:
            assert s.decode_bursts > 0
            for plan in plans:
                assert not (plan.decode and plan.prefill)  # never a prompt chunk beside decodes
                assert sum(len(slot.tokens) for slot in plan.prefill) <= 32 or not any(
                    j.status is JobStatus.RUNNING and len(j.pending) == 1 for j in s.running)
    assert results[0] == results[1] and len(results[0]) == 4
    assert "dp" in kinds[0] and "dp" not in kinds[1]
    burst_at = kinds[1].index("dx4")
    assert kinds[1][burst_at - 1] == "p" and kinds[1][burst_at + 1] == "p"  # a burst between two prompt steps


def test_no_decode_burst_for_a_short_prompt_or_a_batch_that_cannot_run_several_steps() -> None:
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], decode_bursts=32)

    def decoding() -> Scheduler:
        s = Scheduler(KVCacheManager(256, cfg.page_size), cfg, max_len=512)
        s.add(_fill("chat", 10))
        s.add(_gen("chat", 30))
        for _ in range(2):
            plan = s.schedule(4, lambda jobs, pages, n, k: True)
            s.update(plan, _sampled_steps(plan) if plan.steps > 1 else _sampled(plan))
        return s

    s = decoding()
    s.add(_fill("doc", 150))
    plan = s.schedule(4, lambda jobs, pages, n, k: False)  # no multi-step shape: prompt beside the decode
    assert plan.decode and plan.prefill and plan.steps == 1 and s.decode_bursts == 0
    s = decoding()
    s.add(_fill("question", 40))  # fits in one step beside the decode: filled there at once
    plan = s.schedule(4, lambda jobs, pages, n, k: True)
    assert plan.decode and len(plan.prefill[0].tokens) == 40 and s.decode_bursts == 0


def _chat_beside_batch_job(hold_ms: int) -> tuple[Scheduler, list[JobOutput]]:
    """A chat (latency-critical) decoding 24 tokens when a batch job's 150-token prompt (throughput) arrives,
    with decode bursts of 32 prompt tokens and a throughput hold of `hold_ms`."""
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], decode_bursts=32,
                             throughput_hold_ms=hold_ms)
    s = Scheduler(KVCacheManager(65, cfg.page_size), cfg, max_len=512)
    s.add(_fill("chat", 10))
    s.add(_gen("chat", 24))
    outputs: list[JobOutput] = []
    for _ in range(2):
        plan = s.schedule(4, lambda jobs, pages, n, k: True)
        outputs += s.update(plan, _sampled_steps(plan) if plan.steps > 1 else _sampled(plan))
    for job in (_fill("doc", 150), _gen("doc", 6)):
        job.priority = 1
        s.add(job)
    return s, outputs


def test_throughput_prompts_wait_while_latency_critical_work_decodes() -> None:
    """With a throughput hold, a batch job's prompt fills only once the chat beside it is done: the chat's
    tokens come in decode bursts back to back, the prompt then in whole chunks. Without it, prompt steps and
    bursts alternate. The results are the same."""
    results, chat_done, doc_chunks = [], [], []
    for hold_ms in (0, 60_000):
        s, outputs = _chat_beside_batch_job(hold_ms)
        plans: list = []
        more, _ = _drive_overlapped(s, True, steps=4, plans=plans)
        outputs += more
        gens = {o.job.context_id: o.result for o in outputs if o.finished and o.job.kind is JobKind.GENERATE}
        results.append({c: (r.token_ids, r.finish_reason) for c, r in gens.items()})
        done = max(i for i, p in enumerate(plans) if any(sl.job.context_id == "chat" for sl in p.decode))
        first_doc = next(i for i, p in enumerate(plans) if any(sl.job.context_id == "doc" for sl in p.prefill))
        chat_done.append(done)
        doc_chunks.append([len(sl.tokens) for p in plans for sl in p.prefill if sl.job.context_id == "doc"])
        if hold_ms:
            assert first_doc > done and s.held_steps == done + 1  # every plan until the chat's last was held
            assert all(p.steps == 4 for p in plans[:done])  # bursts back to back
        else:
            assert first_doc < done and s.held_steps == 0
    assert results[0] == results[1] and len(results[0]) == 2
    assert chat_done[1] < chat_done[0]  # fewer plans until the chat's last token
    assert doc_chunks[1][:2] == [64, 64] and max(doc_chunks[0]) == 32  # whole chunks against burst-sized ones


def test_throughput_hold_is_bounded_and_lets_latency_critical_prompts_in() -> None:
    """After `throughput_hold_ms` of holding, one step fills the throughput prompt, then the hold starts
    again. A latency-critical prompt is never held; plain calls (all priority 0) hold nothing."""
    s, _ = _chat_beside_batch_job(50)
    fits = lambda jobs, pages, n, k: True  # noqa: E731
    plan = s.schedule(4, fits)
    assert plan.steps == 4 and not plan.prefill and s.held_steps == 1
    s.update(plan, _sampled_steps(plan))
    s._held_since -= 1.0  # the bound has passed
    plan = s.schedule(4, fits)
    assert not plan.decode and [(sl.job.context_id, len(sl.tokens)) for sl in plan.prefill] == [("doc", 32)]
    s.update(plan, _sampled(plan))
    plan = s.schedule(4, fits)  # the chat's burst, and a new hold
    assert plan.steps == 4 and not plan.prefill and s._held_since is not None
    s.update(plan, _sampled_steps(plan))
    s.add(_fill("chat2", 20))  # a latency-critical prompt: filled beside the chat's decode, the doc still waits
    plan = s.schedule(4, fits)
    assert [sl.job.context_id for sl in plan.prefill] == ["chat2"] and plan.decode
    s, _ = _chat_beside_batch_job(60_000)
    for job in list(s.running) + list(s.waiting):
        job.priority = 0
    plan = s.schedule(4, fits)
    assert plan.prefill and s.held_steps == 0


def test_throughput_decodes_wait_with_their_prompts_during_a_hold() -> None:
    """A batch job's decodes wait too while its other prompts are held (they decode later, in the larger batch
    they would have had); once no throughput prompt waits, every decode runs together again."""
    s, _ = _chat_beside_batch_job(60_000)
    fits = lambda jobs, pages, n, k: True  # noqa: E731
    s.hold_s = 0
    for _ in range(40):  # the batch job's prompt fills and it decodes beside the chat
        plan = s.schedule(4, fits)
        s.update(plan, _sampled_steps(plan) if plan.steps > 1 else _sampled(plan))
        if {j.context_id for j in s.running if len(j.pending) == 1} == {"chat", "doc"}:
            break
    assert {(j.context_id, j.kind) for j in s.running if len(j.pending) == 1} == {
        ("chat", JobKind.GENERATE), ("doc", JobKind.GENERATE)}
    more = _fill("doc2", 150)
    more.priority = 1
    s.add(more)
    s.hold_s = 60.0
    plan = s.schedule(4, fits)
    assert [sl.job.context_id for sl in plan.decode] == ["chat"] and not plan.prefill and plan.steps == 4
    s.hold_s = 0
    plan = s.schedule(4, fits)
    assert "doc" in {sl.job.context_id for sl in plan.decode} or plan.prefill


def _steps(s: Scheduler, n: int) -> None:
    """`n` steps of one call each, applied before the next is planned."""
    for _ in range(n):
        plan = s.schedule()
        s.update(plan, _sampled(plan))


def test_multi_step_spans_stop_at_max_tokens_and_fall_back() -> None:
    s = _small(64)
    s.add(_fill("a", 20))
    s.add(_gen("a", 6))
    _steps(s, 3)  # the fill, then the generate's first two tokens
    plan = s.schedule()
    ahead = s.schedule_ahead(plan, 8, lambda jobs, pages, n, k: True)
    assert ahead is not None and ahead.steps == 3  # 2 tokens sampled, this step's 3rd, 3 more allowed
    assert [slot.steps for slot in ahead.decode] == [3]
    assert s.kv.get("a").num_tokens == plan.decode[0].start + 1 + 3  # KV for the ahead plan's three steps
    s.update(plan, _sampled(plan), ahead)
    outputs = s.update(ahead, _sampled_steps(ahead))
    assert _results(outputs)["a"].finish_reason == "length" and len(_results(outputs)["a"].token_ids) == 6
    # a runner without the shape: one step at a time
    s.add(_gen("a", 6))
    _steps(s, 2)
    plan = s.schedule()
    ahead = s.schedule_ahead(plan, 8, lambda jobs, pages, n, k: False)
    assert ahead is not None and ahead.steps == 1


def test_abort_while_a_multi_step_plan_is_in_flight() -> None:
    s = _small(64)
    for ctx in ("a", "b"):
        s.add(_fill(ctx, 20))
        s.add(_gen(ctx, 50))
    _steps(s, 6)
    plan = s.schedule()
    ahead = s.schedule_ahead(plan, 4, lambda jobs, pages, n, k: True)
    assert ahead is not None and ahead.steps == 4
    s.update(plan, _sampled(plan), ahead)
    assert isinstance(s.abort("a")[0].error, AbortedError)
    s.update(ahead, _sampled_steps(ahead))  # skips the aborted job and cuts its KV back
    assert s.kv.get("a").num_tokens <= len(s.tokens["a"])
    rest, _ = _drive_overlapped(s, True, steps=4)
    assert _results(rest)["b"].finish_reason == "length" and len(_results(rest)["b"].token_ids) == 50


def test_ahead_only_for_a_stable_batch() -> None:
    s = _small(64)
    s.add(_fill("a", 20))
    s.add(_gen("a", 10))
    plan = s.schedule()  # the fill's prefill
    assert s.schedule_ahead(plan) is None
    s.update(plan, _sampled(plan))
    plan = s.schedule()  # the generate's first token: the last prefill token is re-fed
    s.update(plan, _sampled(plan))
    plan = s.schedule()
    assert [slot.tokens for slot in plan.decode] and s.schedule_ahead(plan) is not None
    s.update(plan, _sampled(plan), None)
    s.add(_fill("b", 5))  # work waiting: the full scheduler admits it first
    plan = s.schedule()
    assert s.schedule_ahead(plan) is None


def test_abort_while_a_step_is_in_flight() -> None:
    s = _small(64)
    s.add(_fill("a", 20))
    s.add(_gen("a", 50))
    s.add(_fill("b", 20))
    s.add(_gen("b", 50))
    outputs: list[JobOutput] = []
    for _ in range(6):
        plan = s.schedule()
        outputs += s.update(plan, _sampled(plan))
    plan = s.schedule()
    ahead = s.schedule_ahead(plan)
    assert ahead is not None
    outputs += s.update(plan, _sampled(plan), ahead)
    aborted = s.abort("a")  # between two steps, while `ahead` runs
    assert isinstance(aborted[0].error, AbortedError)
    outputs += s.update(ahead, _sampled(ahead))  # skips the aborted job
    assert s.kv.get("a").num_tokens <= len(s.tokens["a"])
    rest, _ = _drive_overlapped(s, True)
    assert _results(rest)["b"].finish_reason == "length"


def test_a_full_batch_keeps_running_ahead_while_work_waits() -> None:
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], max_batch_size=2)
    s = Scheduler(KVCacheManager(256, cfg.page_size), cfg, max_len=512)
    for ctx in ("a", "b"):
        s.add(_fill(ctx, 10))
        s.add(_gen(ctx, 20))
    for _ in range(6):  # fills, then both generates decoding
        plan = s.schedule()
        s.update(plan, _sampled(plan))
    s.add(_fill("c", 10))  # cannot join: the batch is full
    plan = s.schedule()
    assert len(plan.decode) == 2 and s.waiting
    assert s.schedule_ahead(plan) is not None


def test_prefill_beside_decodes_is_kept_short() -> None:
    """A step that decodes takes at most `prefill_tokens_beside_decodes` prefill tokens (every decoding
    sequence waits for them); a step with no decodes takes the whole budget."""
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], prefill_tokens_beside_decodes=16)
    s = Scheduler(KVCacheManager(256, cfg.page_size), cfg, max_len=512)
    s.add(_fill("a", 100))
    assert len(s.schedule().prefill[0].tokens) == 64  # nothing decodes: the whole budget
    s = Scheduler(KVCacheManager(256, cfg.page_size), cfg, max_len=512)
    s.add(_fill("a", 10))
    s.add(_gen("a", 20))
    for _ in range(3):
        plan = s.schedule()
        s.update(plan, _sampled(plan))
    s.add(_fill("b", 100))
    plan = s.schedule()
    assert plan.decode and sum(len(slot.tokens) for slot in plan.prefill) <= 16


def test_throughput_prefill_beside_latency_critical_decodes_is_shorter() -> None:
    """Beside a latency-critical decode (priority 0), throughput work's prompt (priority 1) fills at most
    `prefill_tokens_beside_latency` tokens a step, and latency-critical prompts the usual chunk; beside
    throughput decodes only, both take the usual chunk."""
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], prefill_tokens_beside_decodes=48,
                             prefill_tokens_beside_latency=16)

    def with_decoding(priority: int) -> Scheduler:
        s = Scheduler(KVCacheManager(256, cfg.page_size), cfg, max_len=512)
        gen = _gen("chat", 20)
        s.add(_fill("chat", 10))
        gen.priority = priority
        s.add(gen)
        for _ in range(3):
            plan = s.schedule()
            s.update(plan, _sampled(plan))
        return s

    for decoding, filling, chunk in ((0, 1, 16), (0, 0, 48), (1, 1, 48), (1, 0, 48)):
        s = with_decoding(decoding)
        job = _fill("batch", 100)
        job.priority = filling
        s.add(job)
        plan = s.schedule()
        assert plan.decode and [len(slot.tokens) for slot in plan.prefill] == [chunk], (decoding, filling)


def _clients_full(batch: int = 4, each: int = 6) -> tuple[Scheduler, list[Job], list[JobOutput]]:
    """A scheduler whose batch of `batch` is full of client "a"'s decoding generates, `each` of them sent (the rest
    waiting), a0, a1, ..."""
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], max_batch_size=batch)
    s = Scheduler(KVCacheManager(128, cfg.page_size), cfg, max_len=512)
    gens = []
    for i in range(each):
        for job in (_fill(f"a{i}", 20), _gen(f"a{i}", 30)):
            job.client = "a"
            s.add(job)
        gens.append(job)
    outputs: list[JobOutput] = []
    while not all(job.output_ids for job in gens[:batch]):
        _one_step(s, outputs)
    return s, gens, outputs


def test_a_client_below_its_share_of_a_full_batch_takes_the_place_of_a_flooding_clients_newest_job() -> None:
    """Client "a" fills the batch of 4 and has 2 more waiting; client "b" sends a chat: its share is 2 of the 4
    slots, so its prompt runs at once in place of "a"'s newest running job (preempted: recomputed later, the same
    length of output), and its generate takes the slot the prompt kept. "b" finishes before "a"'s waiting work."""
    s, gens, outputs = _clients_full()
    chat, reply = _fill("b", 10), _gen("b", 3)
    chat.client = reply.client = "b"
    s.add(chat)
    plan = s.schedule()
    assert [slot.job.context_id for slot in plan.prefill] == ["b"]  # at once
    assert gens[3].status is JobStatus.WAITING and s.fair_preemptions == s.preemptions == 1  # "a"'s newest
    outputs += s.update(plan, [TOKEN] * len(plan.slots))
    assert chat.status is JobStatus.FINISHED and list(s.kept) == ["b"]  # its slot waits for the generate
    s.add(reply)
    outputs += _drive(s)
    assert s.fair_preemptions == 1  # once: "a" runs its share, 3 of 4, while "b" is at 1 of its 2
    done = [o.job for o in outputs if o.finished and o.error is None]
    assert done.index(reply) < done.index(gens[3]) and done.index(reply) < done.index(gens[4])
    assert len(reply.output_ids) == 3 and all(len(job.output_ids) == 30 for job in gens)


def test_clients_within_their_share_or_more_urgent_work_are_not_preempted_for_another_client() -> None:
    s, gens, outputs = _clients_full(batch=4, each=4)
    for job in gens[2:]:  # "a" runs 2 urgent jobs and 2 throughput ones
        job.priority = 1
    late = _fill("c", 10)
    late.client, late.priority = "c", 1
    two = [_fill("b0", 10), _fill("b1", 10)]
    for job in two:
        job.client, job.priority = "b", 1
        s.add(job)
    s.add(late)
    plan = s.schedule()  # 3 clients: a share of 1 slot each; "a" gives up its 2 throughput jobs, never its urgent ones
    assert s.fair_preemptions == 2 and all(job.status is JobStatus.RUNNING for job in gens[:2])
    assert sorted(slot.job.context_id for slot in plan.prefill) == ["b0", "c"]  # "b"'s second waits: b has its share
    outputs += s.update(plan, [TOKEN] * len(plan.slots))
    outputs += _drive(s)
    assert s.fair_preemptions == 2
    assert all(len(job.output_ids) == 30 for job in gens) and all(j.status is JobStatus.FINISHED for j in (*two, late))


def test_waiting_clients_take_turns_as_slots_free() -> None:
    """With a full batch of "a"'s and both "a" and "b" waiting, freed slots go to the clients in turns: "b"'s jobs,
    sent after all of "a"'s, do not wait behind them."""
    s, gens, outputs = _clients_full(batch=2, each=5)
    bs = []
    for i in range(2):
        for job in (_fill(f"b{i}", 20), _gen(f"b{i}", 30)):
            job.client = "b"
            s.add(job)
        bs.append(job)
    outputs += _drive(s)
    done = [o.job.context_id for o in outputs if o.finished and o.error is None and o.job.kind is JobKind.GENERATE]
    assert done.index("b0") < done.index("a3") and done.index("b1") < done.index("a4")


def test_a_stable_batch_does_not_run_ahead_past_a_client_below_its_share() -> None:
    s, gens, outputs = _clients_full()
    plan = s.schedule()
    outputs += s.update(plan, [TOKEN] * len(plan.slots))
    plan = s.schedule()
    assert s.schedule_ahead(plan) is not None  # one client: the batch runs ahead
    chat = _fill("b", 10)
    chat.client = "b"
    s.add(chat)
    assert s.schedule_ahead(plan) is None  # the full scheduler gives "b" its share first


def test_a_clients_request_of_several_primitives_is_one_turn() -> None:
    """A request reaches the engine as a chain of primitives (a prompt's pieces filled one after another on contexts
    forking each other, then a generate forking the last): the chain is one turn of its client. Client "b"'s two
    requests both start at once in a full batch (its share: 2 of 4), each preempting once."""
    s, gens, outputs = _clients_full()
    for i in range(2):
        chain = [_fill(f"b{i}", 10), _fill(f"b{i}-more", 10, parent=f"b{i}"),
                 _gen(f"b{i}-reply", 3, parent=f"b{i}-more")]
        for job in chain:
            job.client = "b"
            s.add(job)
    plan = s.schedule()
    assert sorted(slot.job.context_id for slot in plan.prefill) == ["b0", "b1"] and s.fair_preemptions == 2
    outputs += s.update(plan, [TOKEN] * len(plan.slots))
    outputs += _drive(s)
    assert s.fair_preemptions == 2
    done = {o.job.context_id for o in outputs if o.finished and o.error is None}
    assert {"b0-reply", "b1-reply"} <= done and all(len(job.output_ids) == 30 for job in gens)


@pytest.mark.parametrize("seed", range(4))
def test_clients_coming_and_going_all_finish_without_preempting_back_and_forth(seed: int) -> None:
    """Five clients send requests (a prompt, sometimes in two pieces, then a generate) to a batch of 4, one flooding it
    at once, the others at random steps: every request finishes with all its tokens, shares are taken, and the share
    preemptions stay fewer than the requests (no job preempted back and forth)."""
    import random

    rng = random.Random(seed)
    cfg = tiny_engine_config(max_num_batched_tokens=64, token_buckets=[16, 32, 64], max_batch_size=4)
    s = Scheduler(KVCacheManager(256, cfg.page_size), cfg, max_len=512)
    arrivals = sorted([(0, "c0", i) for i in range(12)]  # one client floods, four come and go
                      + [(rng.randrange(3, 80), f"c{rng.randrange(1, 5)}", i) for i in range(12, 30)])
    gens: list[Job] = []
    outputs: list[JobOutput] = []
    for step in range(2000):
        while arrivals and arrivals[0][0] <= step:
            _, client, i = arrivals.pop(0)
            chain = [_fill(f"r{i}", rng.randrange(5, 40))]
            if rng.random() < 0.5:
                chain.append(_fill(f"r{i}-more", rng.randrange(5, 20), parent=f"r{i}"))
            chain.append(_gen(f"r{i}-reply", rng.randrange(10, 60), parent=chain[-1].context_id))
            for job in chain:
                job.client = client
                s.add(job)
            gens.append(chain[-1])
        if not arrivals and not s.has_work():
            break
        if s.has_work():
            _one_step(s, outputs)
    assert not arrivals and not s.has_work()
    assert all(job.status is JobStatus.FINISHED and len(job.output_ids) == job.sampling.max_tokens for job in gens)
    assert 0 < s.fair_preemptions < len(gens)  # shares were taken, and not back and forth
