"""LLMEngine: primitives, batching invariance, forks, preemption, stop conditions, bad input."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from parrot.engine import engine as engine_module
from parrot.engine import kernels
from parrot.engine.engine import EngineDeadError, LLMEngine
from parrot.engine.runner import ModelRunner
from parrot.engine.sampling import COMMON_DRAWS, GREEDY, PLAIN, Stages
from parrot.engine.sequence import Job, JobKind
from parrot.errors import ConflictError, GenerationFailedError, InvalidRequestError, NotFoundError
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams
from tests.conftest import same_logprobs, tiny_engine_config, tiny_model

TIMEOUT = 120


@pytest.fixture(scope="module")
def engine():
    # multi-step decode as a CPU with the native kernels runs it by default: this module's tests go through it
    eng = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4)).start(precompile=True)
    yield eng
    eng.shutdown()


def fill(eng: LLMEngine, ctx: str, tokens: list[int], parent: str | None = None):
    return eng.fill_future(FillRequest(context_id=ctx, parent_context_id=parent, token_ids=tokens)).result(TIMEOUT)


def gen(eng: LLMEngine, ctx: str, parent: str | None = None, **sampling):
    sp = SamplingParams(**({"max_tokens": 8} | sampling))
    req = GenerateRequest(context_id=ctx, parent_context_id=parent, sampling=sp)
    return eng.generate_future(req).result(TIMEOUT)


def prompt(i: int, n: int = 20) -> list[int]:
    return [(i * 37 + k * 11) % 250 + 3 for k in range(n)]


def test_fill_then_generate(engine: LLMEngine) -> None:
    r = fill(engine, "fg", prompt(1))
    assert r.num_tokens == 20
    g = gen(engine, "fg", max_tokens=5, ignore_eos=True)
    assert len(g.token_ids) == 5 and g.finish_reason == "length"
    # the generated tokens are in the context: generating again continues after them
    assert g.num_tokens == 25
    g2 = gen(engine, "fg", max_tokens=3, ignore_eos=True)
    assert g2.num_tokens == 28
    engine.free_future("fg").result(TIMEOUT)


def test_generation_equals_one_shot_prompt(engine: LLMEngine) -> None:
    """Fill in two parts then generate == fill all at once then generate."""
    p = prompt(2, 40)
    fill(engine, "a1", p[:13])
    fill(engine, "a1", p[13:])
    fill(engine, "a2", p)
    a = gen(engine, "a1", max_tokens=10, ignore_eos=True)
    b = gen(engine, "a2", max_tokens=10, ignore_eos=True)
    assert a.token_ids == b.token_ids
    for c in ("a1", "a2"):
        engine.free_future(c).result(TIMEOUT)


def assert_batching_keeps_tokens(engine: LLMEngine, n: int, length: int = 10, grow: int = 3,
                                 max_tokens: int = 12) -> None:
    """n prompts (of length + grow * i tokens) generated one at a time, then all at once: the same tokens."""
    alone = []
    for i in range(n):
        fill(engine, f"alone{i}", prompt(i, length + grow * i))
        alone.append(gen(engine, f"alone{i}", max_tokens=max_tokens, ignore_eos=True).token_ids)

    def run(i: int) -> list[int]:
        fill(engine, f"conc{i}", prompt(i, length + grow * i))
        return gen(engine, f"conc{i}", max_tokens=max_tokens, ignore_eos=True).token_ids

    with cf.ThreadPoolExecutor(n) as ex:
        together = list(ex.map(run, range(n)))
    assert together == alone
    for i in range(n):
        engine.free_future(f"alone{i}").result(TIMEOUT)
        engine.free_future(f"conc{i}").result(TIMEOUT)


def test_batching_does_not_change_results(engine: LLMEngine) -> None:
    assert_batching_keeps_tokens(engine, 12)


def test_forks_equal_unforked(engine: LLMEngine) -> None:
    prefix = prompt(5, 37)  # a partial last page: the fork copies it
    fill(engine, "root", prefix)
    before = engine.ping().free_pages
    outs = []
    for i in range(4):
        fill(engine, f"child{i}", prompt(10 + i, 9), parent="root")
        outs.append(gen(engine, f"child{i}", max_tokens=8, ignore_eos=True).token_ids)
    # the children share the root's full pages: each costs far fewer pages than a copy of the prefix
    assert before - engine.ping().free_pages <= 4 * 2
    for i in range(4):
        fill(engine, f"flat{i}", prefix + prompt(10 + i, 9))
        assert gen(engine, f"flat{i}", max_tokens=8, ignore_eos=True).token_ids == outs[i]
    # generate directly on a fork of the root
    g = gen(engine, "gchild", parent="root", max_tokens=6, ignore_eos=True)
    fill(engine, "gflat", prefix)
    assert gen(engine, "gflat", max_tokens=6, ignore_eos=True).token_ids == g.token_ids
    # freeing the parent keeps the children valid
    engine.free_future("root").result(TIMEOUT)
    assert gen(engine, "child0", max_tokens=2, ignore_eos=True).num_tokens == 37 + 9 + 8 + 2
    for c in [f"child{i}" for i in range(4)] + [f"flat{i}" for i in range(4)] + ["gchild", "gflat"]:
        engine.free_future(c).result(TIMEOUT)
    assert engine.ping().num_contexts == 0


def test_fork_of_a_prefix_equals_those_tokens(engine: LLMEngine) -> None:
    """`parent_num_tokens`: a new context seeded by any prefix of a cached one (page-aligned or not)
    continues exactly like a context filled with those tokens."""
    base = prompt(21, 45)
    fill(engine, "long", base)
    for n in (32, 27):
        req = FillRequest(context_id=f"pre{n}", parent_context_id="long", parent_num_tokens=n,
                          token_ids=prompt(22, 6))
        assert engine.fill_future(req).result(TIMEOUT).num_tokens == n + 6
        forked = gen(engine, f"pre{n}", max_tokens=6, ignore_eos=True).token_ids
        fill(engine, f"flatpre{n}", base[:n] + prompt(22, 6))
        assert gen(engine, f"flatpre{n}", max_tokens=6, ignore_eos=True).token_ids == forked
    g = engine.generate_future(GenerateRequest(context_id="gpre", parent_context_id="long", parent_num_tokens=30,
                                               sampling=SamplingParams(max_tokens=4, ignore_eos=True)))
    fill(engine, "gflatpre", base[:30])
    assert g.result(TIMEOUT).token_ids == gen(engine, "gflatpre", max_tokens=4, ignore_eos=True).token_ids
    with pytest.raises(InvalidRequestError, match="parent_num_tokens 46 exceeds"):
        engine.fill_future(FillRequest(context_id="toolong", parent_context_id="long", parent_num_tokens=46,
                                       token_ids=[5])).result(TIMEOUT)
    for c in ("long", "pre32", "pre27", "flatpre32", "flatpre27", "gpre", "gflatpre"):
        engine.free_future(c).result(TIMEOUT)


def test_stop_conditions(engine: LLMEngine) -> None:
    fill(engine, "s", prompt(7, 12))
    free_run = gen(engine, "s", parent=None, max_tokens=12, ignore_eos=True)
    engine.free_future("s").result(TIMEOUT)
    ids = free_run.token_ids
    # stop token id: the output ends right before its first occurrence
    fill(engine, "s2", prompt(7, 12))
    r = gen(engine, "s2", max_tokens=12, ignore_eos=True, stop_token_ids=[ids[3]])
    assert r.finish_reason == "stop" and r.token_ids == ids[: ids.index(ids[3])]
    engine.free_future("s2").result(TIMEOUT)
    # stop string: text is cut before it
    text = free_run.text
    if len(text) > 4:
        stop = text[2:4]
        fill(engine, "s3", prompt(7, 12))
        r = gen(engine, "s3", max_tokens=12, ignore_eos=True, stop=[stop])
        assert r.finish_reason == "stop" and r.text == text[: text.index(stop)]
        engine.free_future("s3").result(TIMEOUT)


def test_seeded_sampling_is_reproducible(engine: LLMEngine) -> None:
    outs = []
    for i in range(3):
        fill(engine, f"r{i}", prompt(3, 15))
        seed = 7 if i < 2 else 8
        outs.append(gen(engine, f"r{i}", max_tokens=16, ignore_eos=True, temperature=1.0, top_p=0.95,
                        top_k=50, seed=seed).token_ids)
        engine.free_future(f"r{i}").result(TIMEOUT)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_an_engine_seed_decides_the_draws_of_requests_without_one() -> None:
    """EngineConfig.seed (--seed): two engines started with the same seed sample the same outputs for the same
    unseeded requests in the same order; another seed, others."""
    outs = []
    for seed in (11, 11, 12):
        eng = LLMEngine(tiny_model(), tiny_engine_config(seed=seed)).start(precompile=False)
        try:
            fill(eng, "s", prompt(4, 15))
            outs.append([gen(eng, "s", max_tokens=12, ignore_eos=True, temperature=1.0).token_ids for _ in range(2)])
        finally:
            eng.shutdown()
    assert outs[0] == outs[1] and outs[0][0] != outs[0][1]
    assert outs[0] != outs[2]


def test_streaming_matches_result(engine: LLMEngine) -> None:
    chunks = []
    fill(engine, "st", prompt(9, 10))
    req = GenerateRequest(context_id="st", sampling=SamplingParams(max_tokens=10, ignore_eos=True))
    res = engine.generate_future(req, on_chunk=chunks.append).result(TIMEOUT)
    assert "".join(c.text for c in chunks) == res.text
    assert [c.token_id for c in chunks if c.token_id is not None] == res.token_ids
    assert chunks[-1].finish_reason == "length"
    engine.free_future("st").result(TIMEOUT)


def test_bad_input(engine: LLMEngine) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        gen(engine, "nope")
    with pytest.raises(NotFoundError, match="parent context 'ghost'"):
        fill(engine, "x", [1, 2], parent="ghost")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        fill(engine, "x", [1, 99999])
    with pytest.raises(InvalidRequestError, match="maximum length"):
        fill(engine, "x", [5] * 600)
    fill(engine, "short", [5] * 10)
    with pytest.raises(InvalidRequestError, match="maximum length"):
        gen(engine, "short", max_tokens=600)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        gen(engine, "short", stop_token_ids=[10**6])
    with pytest.raises(NotFoundError):
        engine.free_future("never").result(TIMEOUT)
    # freeing a context while a generate runs on it
    fut = engine.generate_future(GenerateRequest(context_id="short",
                                                 sampling=SamplingParams(max_tokens=400, ignore_eos=True)))
    with pytest.raises(ConflictError):
        engine.free_future("short").result(TIMEOUT)
    fut.result(TIMEOUT)
    engine.free_future("short").result(TIMEOUT)
    # the engine keeps serving
    fill(engine, "after", prompt(1))
    assert len(gen(engine, "after", max_tokens=3, ignore_eos=True).token_ids) == 3
    engine.free_future("after").result(TIMEOUT)


def test_ping_counts_prompt_and_generated_tokens(engine: LLMEngine) -> None:
    before = engine.ping()
    fill(engine, "counted", prompt(2, 20))
    assert len(gen(engine, "counted", max_tokens=5, ignore_eos=True).token_ids) == 5
    after = engine.ping()
    engine.free_future("counted").result(TIMEOUT)
    # the fill's 20 tokens in prompt chunks (a generated token is fed as a decode row)
    assert (after.prompt_tokens - before.prompt_tokens, after.generated_tokens - before.generated_tokens) == (20, 5)


def test_no_shape_misses_after_precompile(engine: LLMEngine) -> None:
    """Every forward the tests above ran (prefill chunks, decode batches, forks) was precompiled."""
    info = engine.ping()
    assert info.steps > 100
    assert info.shape_misses == 0


def test_preemption_when_pages_run_out() -> None:
    """A pool far too small for all requests at once: every request still finishes, same outputs."""
    model = tiny_model()
    big = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    try:
        expected = []
        for i in range(6):
            fill(big, f"p{i}", prompt(i, 30))
            expected.append(gen(big, f"p{i}", max_tokens=40, ignore_eos=True).token_ids)
    finally:
        big.shutdown()
    small = LLMEngine(model, tiny_engine_config(kv_pages=1 + 14)).start(precompile=False)
    try:
        def run(i: int) -> list[int]:
            fill(small, f"p{i}", prompt(i, 30))
            return gen(small, f"p{i}", max_tokens=40, ignore_eos=True).token_ids

        with cf.ThreadPoolExecutor(6) as ex:
            got = list(ex.map(run, range(6)))
        assert got == expected
        info = small.ping()
        assert info.preemptions + info.evictions > 0
        # the evicted contexts recompute their KV: generating again continues correctly
        assert gen(small, "p0", max_tokens=5, ignore_eos=True).num_tokens == 30 + 40 + 5
        # a context that needs more than the whole pool fails clearly
        with pytest.raises(InvalidRequestError, match="whole cache"):
            fill(small, "huge", [5] * 300)
        assert small.alive
    finally:
        small.shutdown()


def test_preempting_running_jobs_keeps_results() -> None:
    """Forks of one root decode concurrently in a pool that holds only a few of them at a time."""
    model = tiny_model()
    root = prompt(4, 32)  # two full pages, shared by every fork

    def run_all(eng: LLMEngine) -> list[list[int]]:
        fill(eng, "root", root)
        with cf.ThreadPoolExecutor(6) as ex:
            futs = [ex.submit(gen, eng, f"f{i}", "root", max_tokens=40, ignore_eos=True, temperature=0.7, seed=i)
                    for i in range(6)]
            return [f.result().token_ids for f in futs]

    big = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    try:
        expected = run_all(big)
    finally:
        big.shutdown()
    small = LLMEngine(model, tiny_engine_config(kv_pages=1 + 10)).start(precompile=False)
    try:
        assert run_all(small) == expected
        assert small.ping().preemptions > 0
    finally:
        small.shutdown()


def test_a_client_below_its_share_runs_at_once_beside_a_flooding_client_with_the_same_tokens() -> None:
    """Client "a" sends 4 long generations to an engine of batch 2; client "b"'s request, sent once "a"'s first two
    decode, takes the place of "a"'s newest (its share: 1 of the 2 slots) and ends before "a"'s running ones; every
    output is the tokens it gets alone."""
    eng = LLMEngine(tiny_model(), tiny_engine_config(max_batch_size=2)).start(precompile=False)
    try:
        def send(ctx: str, client: str, n: int, tokens: list[int], on_chunk=None) -> cf.Future:  # noqa: ANN001
            eng.fill_future(FillRequest(context_id=ctx, token_ids=tokens, client=client))
            sp = SamplingParams(max_tokens=n, ignore_eos=True)
            return eng.generate_future(GenerateRequest(context_id=ctx, sampling=sp, client=client), on_chunk=on_chunk)

        alone = [send(f"alone{i}", "a", 120 if i < 4 else 8, prompt(20 + i, 24)).result(TIMEOUT).token_ids
                 for i in range(5)]
        ended: list[str] = []
        started = cf.Future()
        flood = [send(f"a{i}", "a", 120, prompt(20 + i, 24),
                      on_chunk=(lambda c: started.done() or started.set_result(True)) if i == 0 else None)
                 for i in range(4)]
        for i, f in enumerate(flood):
            f.add_done_callback(lambda _, i=i: ended.append(f"a{i}"))
        started.result(TIMEOUT)
        chat = send("b", "b", 8, prompt(24, 24))
        chat.add_done_callback(lambda _: ended.append("b"))
        assert [f.result(TIMEOUT).token_ids for f in (*flood, chat)] == alone
        assert ended.index("b") < ended.index("a0") and eng.ping().fair_preemptions >= 1
    finally:
        eng.shutdown()


def test_shared_prefix_attention_keeps_results() -> None:
    """Concurrent forks of one long root decode through cascade attention: same tokens as without."""
    model = tiny_model()
    root = prompt(8, 70)

    def run_all(eng: LLMEngine) -> list[list[int]]:
        fill(eng, "root", root)
        with cf.ThreadPoolExecutor(5) as ex:
            futs = [ex.submit(gen, eng, f"f{i}", "root", max_tokens=20, ignore_eos=True, temperature=0.8, seed=i)
                    for i in range(5)]
            return [f.result().token_ids for f in futs]

    outs = {}
    for cascade in (False, True):
        eng = LLMEngine(model, tiny_engine_config(shared_prefix_attention=cascade)).start(precompile=False)
        try:
            outs[cascade] = run_all(eng)
            assert (eng.ping().cascade_steps > 0) == cascade
        finally:
            eng.shutdown()
    assert outs[True] == outs[False]


def test_a_cancelled_caller_future_does_not_stop_the_loop(engine: LLMEngine) -> None:
    """A caller that gave up (its future cancelled before the engine resolved it) must not kill the loop."""
    fill(engine, "cancelled-free", prompt(9))
    fut = engine.free_future("cancelled-free")
    fut.cancel()
    gen_fut = engine.generate_future(GenerateRequest(context_id="cf-gen", parent_context_id=None,
                                                     sampling=SamplingParams(max_tokens=2)))
    gen_fut.cancel()
    engine.abort_future("nothing-here").cancel()
    fill(engine, "after-cancel", prompt(10))  # the loop still runs
    assert engine.alive
    engine.free_future("after-cancel").result(TIMEOUT)


def test_overlap_keeps_results(engine: LLMEngine) -> None:
    """The fixture engine plans a stable decode batch's next step while one runs (`overlap`, the default):
    greedy and seeded outputs, stop tokens and stop strings equal those of an engine that waits."""
    waiting = LLMEngine(tiny_model(), tiny_engine_config(overlap=False)).start(precompile=False)
    try:
        results = []
        for eng in (engine, waiting):
            free = gen_many(eng, "ov", [dict(max_tokens=14, ignore_eos=True)] * 4)
            stop_id = free[1].token_ids[5]
            runs = [dict(max_tokens=14, ignore_eos=True), dict(max_tokens=3, ignore_eos=True),
                    dict(max_tokens=14, ignore_eos=True, stop_token_ids=[stop_id]),
                    dict(max_tokens=14, ignore_eos=True, temperature=1.0, top_p=0.9, seed=11)]
            if len(free[0].text) > 6:
                runs.append(dict(max_tokens=14, ignore_eos=True, stop=[free[0].text[4:6]]))
            results.append([(r.token_ids, r.text, r.finish_reason, r.num_tokens) for r in gen_many(eng, "ov", runs)])
        assert results[0] == results[1]
        assert engine.ping().ahead_steps > 0 and waiting.ping().ahead_steps == 0
        assert engine.ping().recent_host_ms > 0
    finally:
        waiting.shutdown()


def test_multi_step_decode_keeps_results() -> None:
    """An engine running up to 4 decode steps per call (`multi_step`): greedy and seeded outputs, a stop token
    met inside a call, stop strings and lengths that are no multiple of 4 equal those of one step a call."""
    multi = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4)).start(precompile=False)
    single = LLMEngine(tiny_model(), tiny_engine_config(multi_step=1)).start(precompile=False)
    try:
        seeded = dict(max_tokens=20, ignore_eos=True, temperature=1.0, top_p=0.9, seed=11)
        runs = [dict(max_tokens=14, ignore_eos=True), dict(max_tokens=3, ignore_eos=True),
                dict(max_tokens=21, ignore_eos=True), seeded, seeded,
                dict(max_tokens=19, ignore_eos=True, temperature=0.7, seed=5), seeded]
        free = gen_many(single, "ms", runs)  # context i's prompt depends on i: the stops come from the same rows
        stop_id = free[3].token_ids[6]
        first = free[3].token_ids.index(stop_id)
        runs[3] = dict(seeded, stop_token_ids=[stop_id])
        runs[6] = dict(seeded, stop=[free[6].text[9:11]])
        results = [[(r.token_ids, r.text, r.finish_reason, r.num_tokens) for r in gen_many(eng, "ms", runs)]
                   for eng in (single, multi)]
        assert results[0] == results[1]
        assert results[1][3][2] == "stop" and len(results[1][3][0]) == first
        assert multi.ping().multi_step_launches > 0 and single.ping().multi_step_launches == 0
        assert multi.kv.num_free_pages == multi.kv.total_pages  # every context freed, no page left behind
    finally:
        multi.shutdown()
        single.shutdown()


def test_host_named_sampler_parts_keep_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerators' samplers and loops (`sampling.host_stages`: the sampler's parts named on the host, loops
    of a fixed step count), forced on this CPU, give what one step a call with branching samplers gives:
    greedy, plain and top-p draws, a stop token inside a loop, logprobs and penalties. Greedy and plain loops
    are precompiled; a top-p batch runs one step a call and its loop compiles once the engine idles."""
    monkeypatch.setenv("PARROT_HOST_STAGES", "1")
    named = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4, bs_buckets=[1, 2, 4], max_batch_size=4))
    step = named.runner.shapes.decode_shape(2, 64)
    named.runner.precompile([s for s in named.runner.shapes.all_shapes() if s.steps > 1] + [step], progress=False)
    named.start(precompile=False)  # the loops and one step precompiled (the other shapes compile when first used)
    monkeypatch.setenv("PARROT_HOST_STAGES", "0")
    single = LLMEngine(tiny_model(), tiny_engine_config(multi_step=1)).start(precompile=False)
    try:
        assert named.settings()["sampler_parts"] == "named" and single.settings()["sampler_parts"] == "device"
        loops = {s.sampler for s in named.runner.compiled if s.steps > 1}
        assert loops == {GREEDY, PLAIN}
        # a step's shape brings its batch size's samplers of the common draws (temperature, top-p, small top-k)
        assert {key[2] for key in named.runner._parts if key[:2] == ("sampler", 2)} == set(COMMON_DRAWS)
        drawn = dict(max_tokens=13, ignore_eos=True, temperature=0.9, seed=3)
        top_p = dict(drawn, top_p=0.8, seed=4)
        groups = [[dict(max_tokens=10, ignore_eos=True), dict(max_tokens=7, ignore_eos=True)],
                  [drawn, dict(drawn, seed=8, max_tokens=6)],
                  [top_p, dict(top_p, temperature=1.2)],
                  [dict(drawn, logprobs=2), dict(max_tokens=9, ignore_eos=True, presence_penalty=1.5)]]
        stop = gen_many(single, "st", groups[0])[0].token_ids[5]
        groups[0].append(dict(max_tokens=10, ignore_eos=True, stop_token_ids=[stop]))
        for i, runs in enumerate(groups):
            launches = named.ping().multi_step_launches
            want, got = (gen_many(eng, "hs", runs) for eng in (single, named))
            assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in want]
            for a, b in zip(got, want, strict=True):  # logprobs: a row's bits may change with the batch its
                # step ran in (XLA's float32 products of this model; timing decides whether two requests'
                # first steps share a batch), never its tokens here
                assert (a.logprobs is None) == (b.logprobs is None)
                for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                    assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
                    assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert i > 1 or named.ping().multi_step_launches > launches  # greedy and plain batches: loops
        wide = Stages(stochastic=True, top_p=True)
        for _ in range(600):  # the top-p loop, queued while serving, compiles once idle
            if any(s.sampler == wide for s in named.runner.compiled):
                break
            time.sleep(0.1)
        assert any(s.sampler == wide and s.steps > 1 for s in named.runner.compiled)
    finally:
        named.shutdown()
        single.shutdown()


@pytest.mark.parametrize("named", [True, False])
def test_loops_with_named_parts_wait_on_nothing(named: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop whose sampler parts the host named compiles to loops of a known trip count and no conditional:
    XLA's GPU runtime reads no predicate of such a loop, where it copies a conditional's or an open loop's to
    the host and waits for the device. The branching loop (CPUs' default) has both."""
    monkeypatch.setenv("PARROT_HOST_STAGES", "1" if named else "0")
    runner = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4)).runner  # not started: compiled here
    for stages in (GREEDY, Stages(stochastic=True, bounded=True, top_p=True)):
        shape = runner.shapes.multi_shape(2, 64, stages)
        assert shape is not None and shape.sampler == (stages if named else None)
        hlo = runner.compiler.get(shape)[0].loop.as_text()
        loops = [line for line in hlo.splitlines() if " while(" in line]  # none where XLA unrolled them
        waits = " conditional(" in hlo or not all("known_trip_count" in line for line in loops)
        assert waits != named


def test_multi_step_only_up_to_its_batch_limit() -> None:
    """`multi_step_max_batch` (accelerators' default: 4): larger decode batches run one step a call, smaller
    ones the loops, with the outputs of one step a call."""
    capped = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4, multi_step_max_batch=2)).start(precompile=False)
    single = LLMEngine(tiny_model(), tiny_engine_config(multi_step=1)).start(precompile=False)
    try:
        runs = [dict(max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 17, 22)]
        results = [[(r.token_ids, r.finish_reason) for r in gen_many(eng, "cap", runs)] for eng in (single, capped)]
        assert results[0] == results[1]
        loops = [s for s in capped.runner.compiled if s.steps > 1]
        assert loops and all(s.batch <= 2 for s in loops) and capped.ping().multi_step_launches > 0
        assert capped.settings()["multi_step_max_batch"] == 2 and single.settings()["multi_step_max_batch"] is None
        assert capped.settings()["prefill_bs_buckets"] == [1, 4]
        assert capped.settings()["decode_attention"] == ("in place" if capped.runner.prefill_in_place else "gathered")
    finally:
        capped.shutdown()
        single.shutdown()


def _chats_beside_a_long_prompt(eng: LLMEngine, tag: str, runs: list[dict], priority: int = 0) -> list:
    """Chats (`runs`: their sampling) decoding when a 300-token prompt (at `priority`) arrives and generates 6
    tokens: every generation's tokens and finish reason; all contexts freed after."""
    import threading

    started = threading.Event()
    futs = []
    for i, sampling in enumerate(runs):
        fill(eng, f"{tag}{i}", prompt(80 + i, 10 + i))
        futs.append(eng.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=SamplingParams(**sampling)),
                                        on_chunk=lambda c: started.set()))
    assert started.wait(TIMEOUT)
    long = eng.fill_future(FillRequest(context_id=f"{tag}L", token_ids=prompt(90, 300), priority=priority))
    futs.append(eng.generate_future(GenerateRequest(context_id=f"{tag}L", priority=priority, sampling=SamplingParams(
        max_tokens=6, ignore_eos=True))))
    long.result(TIMEOUT)
    out = [(r.token_ids, r.finish_reason) for r in (f.result(TIMEOUT) for f in futs)]
    for c in [f"{tag}{i}" for i in range(len(runs))] + [f"{tag}L"]:
        eng.free_future(c).result(TIMEOUT)
    assert eng.kv.num_free_pages == eng.kv.total_pages
    return out


def test_decode_bursts_keep_results() -> None:
    """Decodes that run as multi-step bursts between prompt steps (`decode_bursts`) while a long prompt
    fills give the tokens of mixed steps (a prompt chunk beside every decode step)."""
    runs = [dict(max_tokens=24, ignore_eos=True), dict(max_tokens=17, ignore_eos=True, temperature=0.8, seed=3),
            dict(max_tokens=22, ignore_eos=True)]
    eng = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4, decode_bursts=16)).start(precompile=False)
    try:
        assert eng.ping().settings["decode_bursts"] == 16
        bursting = _chats_beside_a_long_prompt(eng, "db", runs)
        bursts = eng.ping().decode_bursts
        assert bursts > 0
        eng.scheduler.burst_tokens = 0  # the same engine (its compiled shapes) with mixed steps instead
        assert _chats_beside_a_long_prompt(eng, "db", runs) == bursting
        assert eng.ping().decode_bursts == bursts
    finally:
        eng.shutdown()


def test_decode_bursts_are_on_by_default_where_decode_runs_several_steps_a_call() -> None:
    from parrot.engine.device import auto_decode_bursts
    from parrot.engine.scheduler import AUTO_THROUGHPUT_HOLD_MS

    eng = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4))
    bursting = eng.scheduler  # 256 prompt tokens a step on a CPU, the chunk beside decodes on accelerators
    assert bursting.burst_tokens == auto_decode_bursts(eng.cfg) and bursting.hold_s == AUTO_THROUGHPUT_HOLD_MS / 1000
    stepping = LLMEngine(tiny_model(), tiny_engine_config(multi_step=1)).scheduler
    assert stepping.burst_tokens == 0 and stepping.hold_s == 0


def test_throughput_hold_keeps_results() -> None:
    """Latency-critical decodes that hold a throughput prompt back (`throughput_hold_ms`) give the tokens they
    give when the prompt fills between their bursts; the held prompt's own generation too."""
    runs = [dict(max_tokens=20, ignore_eos=True), dict(max_tokens=15, ignore_eos=True, temperature=0.8, seed=5)]
    eng = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4, decode_bursts=16,
                                                     throughput_hold_ms=60_000)).start(precompile=False)
    try:
        assert eng.ping().settings["throughput_hold_ms"] == 60_000
        held = _chats_beside_a_long_prompt(eng, "th", runs, priority=1)
        assert eng.ping().held_steps > 0
        eng.scheduler.hold_s = 0  # the same engine, the prompt filling between the decodes' bursts
        assert _chats_beside_a_long_prompt(eng, "th", runs, priority=1) == held
    finally:
        eng.shutdown()


def test_a_full_batch_yields_to_latency_work_and_keeps_results() -> None:
    """Priority preemption: throughput generates (priority 1) filling a batch of 2 make room for a latency-critical
    prompt and generate (priority 0), which finishes first; the preempted generate is recomputed and every output
    (greedy and seeded) is the one the engine gives with room for all."""
    import threading

    def run(eng: LLMEngine) -> tuple[list, list[str]]:
        started, order = [threading.Event(), threading.Event()], []
        futs = []
        for i, sampling in enumerate([dict(max_tokens=150, ignore_eos=True),
                                      dict(max_tokens=150, ignore_eos=True, temperature=0.8, seed=4)]):
            eng.fill_future(FillRequest(context_id=f"b{i}", token_ids=prompt(60 + i, 14), priority=1)).result(TIMEOUT)
            fut = eng.generate_future(GenerateRequest(context_id=f"b{i}", priority=1, sampling=SamplingParams(
                **sampling)), on_chunk=lambda c, i=i: started[i].set())
            fut.add_done_callback(lambda f, i=i: order.append(f"b{i}"))
            futs.append(fut)
        assert all(e.wait(TIMEOUT) for e in started)  # both decode: the batch of 2 is full
        eng.fill_future(FillRequest(context_id="chat", token_ids=prompt(70, 9)))
        chat = eng.generate_future(GenerateRequest(context_id="chat", sampling=SamplingParams(max_tokens=4,
                                                                                           ignore_eos=True)))
        chat.add_done_callback(lambda f: order.append("chat"))
        out = [(r.token_ids, r.finish_reason) for r in (f.result(TIMEOUT) for f in [*futs, chat])]
        for c in ("b0", "b1", "chat"):
            eng.free_future(c).result(TIMEOUT)
        return out, order

    roomy = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    try:
        expected, _ = run(roomy)
        assert roomy.ping().priority_preemptions == 0
    finally:
        roomy.shutdown()
    full = LLMEngine(tiny_model(), tiny_engine_config(max_batch_size=2, bs_buckets=[1, 2])).start(precompile=False)
    try:
        got, order = run(full)
        assert full.ping().priority_preemptions >= 1
    finally:
        full.shutdown()
    assert got == expected and order[0] == "chat"


def test_multi_step_gives_way_to_cascade_attention_over_a_long_shared_prefix() -> None:
    """Forks whose single (cascade) steps would read a long shared prefix once run step by step; a batch
    sharing nothing, or little, runs several steps a call."""
    eng = LLMEngine(tiny_model(), tiny_engine_config(multi_step=4))  # not started: the runner's choice alone
    r = eng.runner
    jobs = [Job(JobKind.GENERATE, f"c{i}", None, sampling=SamplingParams(max_tokens=8)) for i in range(3)]
    forks = [list(range(1, 9)) + [20 + i] for i in range(3)]  # 8 shared pages, one own page each
    alone = [[30 + 10 * i + j for j in range(9)] for i in range(3)]
    r.cascade_over_multi_bytes = 16 * r.kv_page_bytes  # (3 - 1) x 8 shared pages: exactly what cascade saves
    assert r.multi_fits(jobs, alone, 9 * 16, 4)
    assert not r.multi_fits(jobs, forks, 9 * 16, 4)
    r.cascade_over_multi_bytes = 17 * r.kv_page_bytes
    assert r.multi_fits(jobs, forks, 9 * 16, 4)
    assert not r.multi_fits(jobs, alone, 9 * 16, 5)  # more steps than the shape's


def gen_many(eng: LLMEngine, tag: str, runs: list[dict]) -> list:
    """Generate for several contexts at once (one decode batch), then free them."""
    futs = []
    for i, sampling in enumerate(runs):
        fill(eng, f"{tag}{i}", prompt(i + 40, 12))
        sp = SamplingParams(**sampling)
        futs.append(eng.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=sp)))
    results = [f.result(TIMEOUT) for f in futs]
    for i in range(len(runs)):
        eng.free_future(f"{tag}{i}").result(TIMEOUT)
    return results


def test_mixed_steps_of_a_wide_batch_keep_results(engine: LLMEngine) -> None:
    """Six decodes beside a prompt chunk: a mixed step in a batch bucket beyond the prefill ones (8 rows, the
    longest KV bucket) gives the tokens of two passes. Their decode rows' attention is a decode step's bits
    (test_attention); the tiny model's float weights go through XLA's products, whose sums are ordered by the
    step's shape, so the logprobs agree to float32 rounding (`same_logprobs`): a decode row that lands in a
    mixed step in one run and in a decode step of its own in the other (as timing has it) may differ in the
    last bits."""
    import threading

    if not engine.runner.mixed:
        pytest.skip("mixed steps need prefill attention reading the pages in place (the native CPU kernels)")
    shapes: list = []
    mixed_shape = engine.runner._mixed

    def spy(plan):  # noqa: ANN001, ANN202
        shape = mixed_shape(plan)
        if shape is not None:
            shapes.append(shape)
        return shape

    def run(tag: str) -> list:
        started = threading.Event()
        futs = []
        for i in range(6):
            fill(engine, f"{tag}{i}", prompt(60 + i, 9 + i))
            sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0)  # chosen tokens' logprobs: bit for bit
            futs.append(engine.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=sp),
                                               on_chunk=lambda c: started.set()))
        assert started.wait(TIMEOUT)
        fill(engine, f"{tag}L", prompt(70, 90))
        futs.append(engine.generate_future(GenerateRequest(context_id=f"{tag}L", sampling=SamplingParams(
            max_tokens=6, ignore_eos=True))))
        results = [f.result(TIMEOUT) for f in futs]
        for c in [f"{tag}{i}" for i in range(6)] + [f"{tag}L"]:
            engine.free_future(c).result(TIMEOUT)
        return results

    engine.runner._mixed = spy
    try:
        mixed = run("wm")
        engine.runner.mixed = False
        two_passes = run("wt")
    finally:
        engine.runner.mixed = True
        del engine.runner._mixed
    assert any(s.batch == 8 for s in shapes), shapes
    assert [r.token_ids for r in mixed] == [r.token_ids for r in two_passes]
    assert all(same_logprobs(a.logprobs, b.logprobs, float_weights=True)
               for a, b in zip(mixed, two_passes, strict=True))


def test_a_step_that_cannot_be_launched_fails_its_jobs_and_the_engine_serves_on(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Something other than a ParrotError out of the runner's launch (a value the host could not pack: a top_k
    past int32 once did this) fails that step's jobs with a clear error, their KV rolled back; it used to end
    the engine loop, and with it every request the server held."""
    launch = engine.runner.launch

    def poisoned(plan, *args, **kwargs):
        if any(slot.job.context_id == "poison" and slot.job.kind is JobKind.GENERATE for slot in plan.slots):
            raise OverflowError("Python int too large to convert to C long")
        return launch(plan, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", poisoned)
    fill(engine, "poison", prompt(7))
    with pytest.raises(GenerationFailedError, match="OverflowError"):
        gen(engine, "poison", max_tokens=4)
    assert engine.alive
    fill(engine, "bystander", prompt(8))
    assert len(gen(engine, "bystander", max_tokens=3, ignore_eos=True).token_ids) == 3
    monkeypatch.setattr(engine.runner, "launch", launch)
    assert len(gen(engine, "poison", max_tokens=2, ignore_eos=True).token_ids) == 2  # its context is intact
    for ctx in ("poison", "bystander"):
        engine.free_future(ctx).result(TIMEOUT)


def test_a_crash_applying_a_step_answers_the_jobs_that_finished_in_it() -> None:
    """The loop dies inside `Scheduler.update` after jobs of the step finished there (they left `running`): their
    callers get EngineDeadError instead of waiting forever, and /ping shows nothing left running."""
    eng = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    try:
        fill(eng, "a", prompt(1))
        update = eng.scheduler.update

        def crash_after_finishing(*args: object, **kw: object) -> list:
            outputs = update(*args, **kw)
            if any(o.finished for o in outputs):
                raise RuntimeError("injected: a bug after some jobs of the step finished")
            return outputs

        eng.scheduler.update = crash_after_finishing  # type: ignore[method-assign]
        fut = eng.generate_future(GenerateRequest(context_id="a", sampling=SamplingParams(max_tokens=1)))
        with pytest.raises(EngineDeadError, match="injected"):
            fut.result(TIMEOUT)
        assert not eng.alive and (eng.ping().running, eng.ping().waiting) == (0, 0)
        with pytest.raises(EngineDeadError):
            eng.fill_future(FillRequest(context_id="b", token_ids=prompt(2)))
    finally:
        eng.shutdown()


def test_work_submitted_as_the_loop_dies_is_refused_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A submit that passed the engine's liveness check just before the loop ended is refused when it queues (the
    loop's last drain is behind it): an explicit error, never a future that no one will settle."""
    import parrot.engine.engine as engine_module

    eng = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    fill(eng, "a", prompt(1))
    real_check = engine_module.check_sampling

    def loop_ends_meanwhile(*args: object) -> None:
        real_check(*args)
        eng._stop = True
        eng._wake.set()
        eng._thread.join(TIMEOUT)  # the loop has ended, its last drain done

    monkeypatch.setattr(engine_module, "check_sampling", loop_ends_meanwhile)
    try:
        with pytest.raises(EngineDeadError):
            eng.generate_future(GenerateRequest(context_id="a", sampling=SamplingParams(max_tokens=2)))
    finally:
        eng.shutdown()


@pytest.mark.skipif(not kernels.available(), reason="the pool is lazily resident only with the native CPU kernels")
def test_precompile_compiles_the_page_release_so_its_first_use_compiles_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """Without precompile the first release compiles (the check sees compiles); precompile compiles it on a thread
    of its own, and the first release then compiles nothing and gives the pages back in place."""
    caplog.set_level(logging.WARNING)

    def release(runner: ModelRunner) -> list[str]:
        mask = np.zeros(runner.num_pages, bool)
        mask[8:24] = True
        caplog.clear()
        before = runner.kv[0][0].unsafe_buffer_pointer()
        with jax.log_compiles(True):
            runner.release_pages(mask)
        assert runner.kv[0][0].unsafe_buffer_pointer() == before
        return [r.getMessage() for r in caplog.records if "_release_pages" in r.getMessage()]

    model = tiny_model()
    assert release(ModelRunner(model.config, model.weights, tiny_engine_config(kv_pages=40)))  # compiled here
    runner = ModelRunner(model.config, model.weights, tiny_engine_config(kv_pages=48))  # a shape not compiled yet
    runner.precompile(shapes=[], progress=False)
    assert runner.lazy_pool and release(runner) == []


def test_a_shapes_batch_unpacking_compiles_on_its_first_step_and_keeps_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`precompile` leaves the packed batch's unpacking out; a shape's first step compiles it on a thread of its
    own (once for the shapes whose arrays are the same) while its steps send the arrays one by one, and later
    steps send one packed vector. The tokens equal those of an engine that never packs."""
    from parrot.engine import runner as runner_module

    def unpacks(eng: LLMEngine) -> dict:
        return {k: f for k, f in eng.runner._parts.items() if k[0] == "unpack"}

    runs = [dict(max_tokens=10, ignore_eos=True), dict(max_tokens=6, ignore_eos=True, temperature=0.9, seed=3)]
    plain = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    try:
        monkeypatch.setattr(plain.runner, "_compile_unpack", lambda key, batch: None)  # array by array always
        want = [r.token_ids for r in gen_many(plain, "u", runs)]
    finally:
        plain.shutdown()
    eng = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    try:
        shape = eng.runner.shapes.all_shapes()[0]
        eng.runner.precompile(shapes=[shape], progress=False)
        assert unpacks(eng) == {}  # not precompiled
        assert [r.token_ids for r in gen_many(eng, "u", runs)] == want  # the first steps: compiles start
        started = unpacks(eng)
        assert started and len(started) <= len(eng.runner.compiled)
        for fut in started.values():
            assert fut.result(TIMEOUT) is not None
        packed = []
        real_pack = runner_module.pack
        monkeypatch.setattr(runner_module, "pack", lambda batch: packed.append(1) or real_pack(batch))
        assert [r.token_ids for r in gen_many(eng, "u", runs)] == want  # the same shapes, packed now
        assert packed and unpacks(eng).keys() == started.keys()
    finally:
        eng.shutdown()


def test_a_script_ending_after_its_first_step_ends_cleanly() -> None:
    """A process whose last call is a shape's first step ends while that shape's unpacking compiles: it waits for
    it (a daemon thread inside XLA's compiler at exit aborted the process)."""
    script = ("from parrot.engine.runner import ModelRunner\n"
              "from tests.conftest import tiny_engine_config, tiny_model\n"
              "m = tiny_model()\n"
              "r = ModelRunner(m.config, m.weights, tiny_engine_config())\n"
              "print(r.prefill_logits(list(range(3, 40)), 0, [1, 2, 3]).shape)\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not kernels.available(), reason="the pool is lazily resident only with the native CPU kernels")
def test_an_idle_engine_gives_free_pages_back_and_computes_the_same(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """After `kv_release_idle_s` of idling, the free pages written before go back to the OS (they no longer count
    as written), a few calls' worth at a time; a context that stayed keeps its KV, and work on the given-back
    pages gives the same tokens."""
    monkeypatch.setattr(engine_module, "RELEASE_CHUNK_PAGES", 16)  # several calls
    caplog.set_level(logging.INFO, logger="parrot.engine.engine")
    eng = LLMEngine(tiny_model(), tiny_engine_config(kv_release_idle_s=0.2)).start(precompile=False)
    try:
        p = prompt(7, 60)
        for i in range(4):  # the kept context's pages lie between those given back
            fill(eng, f"gone{i}", prompt(i, 90))
            gen(eng, f"gone{i}", max_tokens=8, ignore_eos=True)
            if i == 1:
                fill(eng, "keep", p)
                first = gen(eng, "keep", max_tokens=8, ignore_eos=True, logprobs=3)
        pages = eng.kv.get("keep").pages
        assert min(eng.kv.get("gone0").pages) < min(pages) and max(pages) < max(eng.kv.get("gone3").pages)
        spans = []
        release = eng.runner.release_pages
        monkeypatch.setattr(eng.runner, "release_pages", lambda span: (spans.append(span.copy()), release(span)))
        written = eng.ping().written_pages
        # freed at once: one idle period gives them back (freed one by one, a busy machine could idle between frees)
        for fut in [eng.free_future(f"gone{i}") for i in range(4)]:
            fut.result(TIMEOUT)
        deadline = time.monotonic() + 30
        while eng.ping().written_pages > eng.kv.num_used_pages and time.monotonic() < deadline:
            time.sleep(0.05)
        info = eng.ping()
        assert info.released_pages >= 4 * 90 // eng.kv.page_size
        assert info.written_pages == eng.kv.num_used_pages < written
        assert info.settings["kv_release_idle_s"] == 0.2
        calls = [int(m.group(1)) for r in caplog.records if (m := re.search(r"in (\d+) call", r.getMessage()))]
        assert calls == [len(spans)] and len(spans) >= 2
        kept = [s for s in spans if np.flatnonzero(s)[0] < min(pages) and max(pages) < np.flatnonzero(s)[-1]]
        assert kept and not any(s[pages].any() for s in kept)  # a span around the kept context, which it skips
        more = gen(eng, "keep", max_tokens=8, ignore_eos=True, logprobs=3)  # its pages were kept
        fill(eng, "again", p + first.token_ids)  # on pages given back
        again = gen(eng, "again", max_tokens=8, ignore_eos=True, logprobs=3)
        assert again.token_ids == more.token_ids and same_logprobs(again.logprobs, more.logprobs, float_weights=True)
        fill(eng, "ref", p)
        ref = gen(eng, "ref", max_tokens=8, ignore_eos=True, logprobs=3)
        assert ref.token_ids == first.token_ids and same_logprobs(ref.logprobs, first.logprobs, float_weights=True)
    finally:
        eng.shutdown()
