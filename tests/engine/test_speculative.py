"""Speculative decoding by prompt lookup: the n-gram drafter, the scheduler's verify slots (driven by a fake
model), and the engine on a tiny random model and on the default model: the same tokens as plain decoding, greedy
and seeded samples."""

from __future__ import annotations

import concurrent.futures as cf
import re
from collections.abc import Callable

import numpy as np
import pytest

from parrot.config import EngineConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.kv_cache import KVCacheManager
from parrot.engine.sampling import SamplerExtras
from parrot.engine.scheduler import SPEC_COSTS_ACCELERATOR, SPEC_COSTS_CPU, Scheduler, StepPlan
from parrot.engine.sequence import Job, JobKind, JobOutput
from parrot.engine.speculative import NgramDrafter
from parrot.engine.structured import Grammars, fill_masks, mask_words
from parrot.protocol import FillRequest, GenerateRequest, GenerateResponse, SamplingParams
from tests.conftest import batch_invariant_mode, same_logprobs, tiny_engine_config, tiny_model, tiny_tokenizer

TIMEOUT = 300


# ---- the drafter ---------------------------------------------------------------------------------------
def test_draft_is_what_followed_the_latest_occurrence() -> None:
    d = NgramDrafter(4, ngram=3, min_ngram=1)
    assert d.propose("a", [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2, 3]  # the later of two occurrences
    assert d.propose("b", [5, 6, 7, 8]) == []  # no n-gram of the tail occurred before
    assert d.propose("c", [4, 5, 6, 4, 5], limit=1) == [6]
    assert d.propose("d", [1, 4, 5, 6, 4, 5]) == [6, 4, 5, 6]  # the copy reaches the tail: a period of 3
    assert d.propose("e", [3, 7, 7, 7]) == [7, 7, 7, 7]


def test_longer_ngrams_win() -> None:
    d = NgramDrafter(2, ngram=3, min_ngram=1)
    # the tail's 1-gram (3) last occurred before 8; its 2-gram (2, 3) before 4
    assert d.propose("a", [2, 3, 4, 0, 3, 8, 0, 2, 3]) == [4, 0]


def test_min_ngram_is_respected() -> None:
    assert NgramDrafter(3, ngram=3, min_ngram=2).propose("a", [1, 2, 5, 2]) == []  # only the 1-gram (2) matches
    assert NgramDrafter(3, ngram=3, min_ngram=1).propose("a", [1, 2, 5, 2]) == [5, 2, 5]


def test_index_follows_growing_and_rewritten_contexts() -> None:
    d = NgramDrafter(3, ngram=3, min_ngram=2)
    tokens = [1, 2, 3, 4, 5, 6]
    assert d.propose("a", tokens) == []
    tokens += [1, 2]  # grows: the index is extended, not rebuilt
    assert d.propose("a", tokens) == [3, 4, 5]
    assert d.propose("a", [9, 9, 1, 2, 7, 1, 2]) == [7, 1, 2]  # another context under the same key: rebuilt
    assert d.propose("a", [9, 9, 1]) == []  # cut back: rebuilt
    d.forget("a")
    assert d.propose("a", [1, 2, 3, 1, 2]) == [3, 1, 2]


def test_incremental_index_equals_a_fresh_one() -> None:
    tokens = [(i * 7 + i // 5) % 11 for i in range(300)]
    grown, fresh = NgramDrafter(4, 3, 1), NgramDrafter(4, 3, 1)
    for n in range(2, len(tokens)):
        assert grown.propose("g", tokens[:n]) == fresh.propose(f"f{n}", tokens[:n])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(0)
    with pytest.raises(ValueError):
        NgramDrafter(4, ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        EngineConfig(speculative_tokens=-1)
    with pytest.raises(ValueError):
        EngineConfig(speculative_ngram=1, speculative_min_ngram=2)


# ---- the scheduler, driven by a fake model ----------------------------------------------------------------
def copying_model(tokens: list[int]) -> int:
    """A deterministic 'model' whose greedy next token mostly repeats the sequence 5 tokens back (so drafts are
    mostly confirmed), with a token of its own every 7th position (a rejected draft token)."""
    return 200 + len(tokens) % 50 if len(tokens) % 7 == 0 else tokens[-5]


def _drive(s: Scheduler, jobs: list[Job], model: Callable[[list[int]], int]) -> dict[str, list[int]]:
    """Run the scheduler to the end with `model` as the runner: each slot's sampled token, and each verify
    slot's greedy token after every token it feeds (as the runner's decode rows give them)."""
    for job in jobs:
        s.add(job)
    done: dict[str, list[int]] = {}
    while s.has_work():
        plan = s.schedule()
        sampled = []
        for slot in plan.slots:
            seq = s.tokens[slot.job.context_id][: slot.start]
            if slot.draft is not None:
                assert slot.tokens[1:] == slot.draft and not slot.sample
                slot.verified = [model(seq + slot.tokens[: j + 1]) for j in range(len(slot.tokens))]
            sampled.append(model(seq + slot.tokens))
        outputs: list[JobOutput] = s.update(plan, sampled)
        for out in outputs:
            assert out.error is None, out.error
            if out.result is not None and out.job.kind is JobKind.GENERATE:
                done[out.job.context_id] = out.result.token_ids
        for ctx in s.tokens:  # the KV never holds more than the context's tokens once a step is applied
            assert s.kv.get(ctx).num_tokens <= len(s.tokens[ctx])
    return done


def _scheduler(speculative: int, pages: int = 256) -> Scheduler:
    """A scheduler whose rows cost as little as an accelerator's: drafts are verified at every batch size."""
    cfg = tiny_engine_config(speculative_tokens=speculative)
    s = Scheduler(KVCacheManager(pages, cfg.page_size), cfg, max_len=512)
    s.spec_costs = SPEC_COSTS_ACCELERATOR
    return s


def _jobs(n: int, max_tokens: int, stop: tuple[int, ...] = ()) -> list[Job]:
    jobs: list[Job] = []
    for i in range(n):
        prompt = [(i * 13 + k * 3) % 40 + 1 for k in range(12)]
        jobs.append(Job(JobKind.FILL, f"c{i}", None, fill_tokens=prompt))
        jobs.append(Job(JobKind.GENERATE, f"c{i}", None, sampling=SamplingParams(max_tokens=max_tokens),
                        stop_ids=frozenset(stop)))
    return jobs


@pytest.mark.parametrize("batch", [1, 3])
def test_verify_slots_give_the_plain_tokens(batch: int) -> None:
    plain = _drive(_scheduler(0), _jobs(batch, 60), copying_model)
    spec = _scheduler(4)
    assert _drive(spec, _jobs(batch, 60), copying_model) == plain
    assert spec.spec_steps > 0 and 0 < spec.spec_accepted_tokens < spec.spec_draft_tokens
    assert all(len(v) == 60 for v in plain.values())


def test_max_tokens_and_stop_tokens_inside_a_draft() -> None:
    for max_tokens in (1, 2, 9, 13):  # ends at every offset within a draft
        plain = _drive(_scheduler(0), _jobs(2, max_tokens), copying_model)
        assert _drive(_scheduler(4), _jobs(2, max_tokens), copying_model) == plain
    stop = (copying_model([0] * 14),)  # the model's own token at position 14
    plain = _drive(_scheduler(0), _jobs(2, 40, stop), copying_model)
    spec = _scheduler(4)
    assert _drive(spec, _jobs(2, 40, stop), copying_model) == plain
    assert spec.spec_steps > 0


def test_verify_slots_under_page_pressure() -> None:
    """A pool that cannot hold every job at once: drafts are verified only where pages are free, others
    preempted and recomputed as usual; the tokens stay the plain ones."""
    plain = _drive(_scheduler(0, pages=14), _jobs(4, 40), copying_model)
    spec = _scheduler(4, pages=14)
    assert _drive(spec, _jobs(4, 40), copying_model) == plain
    assert spec.spec_steps > 0


def _verifying(s: Scheduler) -> tuple[StepPlan, Job]:
    """A scheduler's plan holding a verify slot, and its job (a copying context, rows cheap)."""
    jobs = _jobs(1, 40)
    for job in jobs:
        s.add(job)
    gen = jobs[1]
    s.update(s.schedule(), None)  # the prompt
    for token in (1, 4):  # two plain steps sample 1, then 4: a tail that occurred before ((1, 4) began the prompt)
        step = s.schedule()
        assert not any(slot.draft for slot in step.decode)
        s.update(step, [token])
    plan = s.schedule()
    assert plan.decode and plan.decode[0].draft, "no verify slot"
    return plan, gen


def test_abort_or_a_failed_step_while_verifying_leaves_the_kv_as_the_tokens() -> None:
    s = _scheduler(4)
    plan, gen = _verifying(s)
    slot = plan.decode[0]
    s.abort("c0")  # while the verify step is in flight
    slot.verified = [0] * len(slot.tokens)
    assert s.update(plan, None) == [] and s.kv.get("c0").num_tokens <= len(s.tokens["c0"])
    s = _scheduler(4)
    plan, gen = _verifying(s)
    start = plan.decode[0].start
    (out,) = s.fail_step(plan, RuntimeError("the device went away"))
    assert out.error is not None and s.kv.get("c0").num_tokens == start


def test_drafts_pay_for_their_rows() -> None:
    """The cost model (a CPU's figures): a lone stream drafts while its drafts are confirmed, not after a run
    of misses; four streams at the prior's acceptance wait for better odds; an accelerator's rows cost little."""
    s = _scheduler(4)
    s.spec_costs = SPEC_COSTS_CPU
    jobs = _jobs(4, 40)
    for job in jobs:
        s.add(job)
    s.tokens.update({job.context_id: [1, 2, 3, 4, 1, 2, 3] for job in jobs})
    gens = [job for job in jobs if job.kind is JobKind.GENERATE]
    for job in gens:
        job.pending = [3]
    assert s._plan_drafts(gens[:1], ahead=True) == {gens[0].job_id: [4, 1, 2, 3]}
    assert s._plan_drafts(gens, ahead=True) == {}
    s._acceptance[gens[0].context_id] = (0.5, 5.0)  # drafts seldom confirmed lately
    assert s._plan_drafts(gens[:1], ahead=True) == {}
    s.spec_costs = SPEC_COSTS_ACCELERATOR
    drafts = s._plan_drafts(gens, ahead=True)
    assert len(drafts) == 4 and len(drafts[gens[0].job_id]) < 4  # the poor one's draft is short
    assert len(gens) + sum(len(d) for d in drafts.values()) == s.cfg.max_batch_size  # the rows fill the batch


def test_plain_tokens_teach_the_odds() -> None:
    """Tokens decoded without a draft count as a one-token draft's hit or miss where a draft would have been
    proposed: a copying output earns its verify steps at no cost, free text loses them."""
    s = _scheduler(4)
    s.spec_costs = SPEC_COSTS_CPU
    jobs = _jobs(4, 200)
    for job in jobs:
        s.add(job)
    s.update(s.schedule(), None)  # the prompts: [1, 4, 7, ...], [14, 17, ...], ...
    gens = [job for job in jobs if job.kind is JobKind.GENERATE]
    prior = s._acceptance_rate(gens[0])
    plan = s.schedule()  # the first decode step: no tail occurred before, nothing drafted nor learned
    assert not any(slot.draft for slot in plan.decode)
    def copy(job: Job) -> int:  # each output copies its prompt: what the lookup proposes, once it proposes
        guess = s.drafter.propose(job.context_id, s.tokens[job.context_id], 1)
        return guess[0] if guess else s.tokens[job.context_id][len(job.output_ids)]

    s.update(plan, [copy(j) for j in gens])
    for _ in range(12):  # plain steps go on copying: every draft the lookup would propose is confirmed
        plan = s.schedule()
        if any(slot.draft for slot in plan.decode):
            break
        s.update(plan, [copy(j) for j in gens])
    assert s._acceptance_rate(gens[0]) > prior
    assert any(slot.draft for slot in plan.decode), "four copying streams never drafted"
    s2 = _scheduler(4)
    s2.spec_costs = (0.0, 1e9)  # verify steps never pay: every step is plain, and its token teaches
    (fill, gen) = _jobs(1, 200)
    for job in (fill, gen):
        s2.add(job)
    s2.update(s2.schedule(), None)
    for token in (1, 4):  # the tail (1, 4) began the prompt: the lookup now proposes 7
        s2.update(s2.schedule(), [token])
    for token in (99, 98, 97):  # free text: a miss where the lookup proposes
        guess = s2.drafter.propose(gen.context_id, s2.tokens[gen.context_id], 1)
        plan = s2.schedule()
        s2.update(plan, [token])
        assert not guess or guess[0] != token
    assert s2._acceptance_rate(gen) < prior


def test_without_a_draft_decodes_go_straight_to_a_multi_step_call() -> None:
    """After a verify step every plan starts afresh: a decode-only batch with nothing to draft runs a multi-step
    call at once where the runner has one, not a single step first."""
    s = _scheduler(4)
    for job in _jobs(2, 40):
        s.add(job)
    s.update(s.schedule(), None)  # both prompts filled
    for job in s.running:
        s.tokens[job.context_id].append(7)  # a first token that occurred nowhere before: no draft
        job.pending = [7]
    plan = s.schedule(4, lambda jobs, pages, kv_len, steps: True)
    assert plan.steps == 4 and len(plan.decode) == 2 and not plan.prefill and s.decode_bursts == 0
    assert all(slot.draft is None for slot in plan.decode)


def test_every_job_drafts_and_a_grammar_trims_its_draft() -> None:
    """Logprobs and logit_bias read a row's logits alone, penalties and min_tokens the tokens before it (the
    draft's among them), a constraint's mask its grammar's state after them: every sampling drafts. A constrained
    job's draft is the prefix its grammar takes, up to its first stop token (no row is spent past them)."""
    s = _scheduler(4)
    greedy = Job(JobKind.GENERATE, "a", None, sampling=SamplingParams(max_tokens=8))
    assert s.draftable(greedy) and not _scheduler(0).draftable(greedy)
    for sp in (SamplingParams(max_tokens=8, temperature=0.7), SamplingParams(max_tokens=8, logprobs=2),
               SamplingParams(max_tokens=8, logit_bias={3: 1}), SamplingParams(max_tokens=8, min_tokens=4),
               SamplingParams(max_tokens=8, presence_penalty=0.5, repetition_penalty=1.2),
               SamplingParams(max_tokens=8, regex="[a-c]+")):
        assert s.draftable(Job(JobKind.GENERATE, "a", None, sampling=sp, stop_ids=frozenset({7})))
    forced = Job(JobKind.GENERATE, "a", None, sampling=SamplingParams(max_tokens=8))
    forced.forced = True  # tokens its grammar forced, to be fed first
    assert not s.draftable(forced)

    tok = tiny_tokenizer()
    a, b, c, z = (tok.encode(ch)[0] for ch in "abcz")
    eos = tok.eos_token_id
    jobs = _jobs(1, 40)
    for job in jobs:
        s.add(job)
    gen = jobs[1]
    gen.stop_ids = frozenset({eos})
    grammars = Grammars(tok, 260)
    for tokens, draft, trimmed in (([a, b, a, c, z, a, b], [a, c, z, a], [a, c]),  # z leaves the grammar
                                   ([a, b, a, eos, c, a, b], [a, eos, c, a], [a])):  # a stop token ends it
        s.tokens[gen.context_id] = tokens
        gen.constraint = None
        assert s._plan_drafts([gen], ahead=True) == {gen.job_id: draft}
        gen.constraint = grammars.compile(SamplingParams(regex="[a-c]+"))
        assert s._plan_drafts([gen], ahead=True) == {gen.job_id: trimmed}
    gen.constraint = grammars.compile(SamplingParams(regex="z+"))
    assert s._plan_drafts([gen], ahead=True) == {}  # nothing the grammar takes: no verify step


def test_a_verify_rows_mask_is_its_grammars_after_the_draft_before_it() -> None:
    """`SamplerExtras.build` with `before` and a constraint: each verify row's mask is the one its grammar gives
    after the draft's tokens before the row, and the job's own grammar does not move."""
    tok = tiny_tokenizer()
    grammars = Grammars(tok, 260)
    params = SamplingParams(max_tokens=8, regex="(ab|ac)[xy]z")
    a, b, x = (tok.encode(ch)[0] for ch in "abx")
    job = Job(JobKind.GENERATE, "a", None, sampling=params, constraint=grammars.compile(params))
    built = SamplerExtras.build([job, job, job], 4, 260, before=[[], [a], [a, b]])
    assert built is not None
    mask = built[0].mask
    for row, prefix in enumerate(([], [a], [a, b])):
        want = grammars.compile(params)
        for t in prefix:
            want.consume(t)
        expected = np.full((1, mask_words(260)), -1, np.int32)
        fill_masks([(want, 0)], expected)
        assert (mask[row] == expected[0]).all(), row
    assert job.constraint.consumed == [] and x not in job.constraint.forced()


def test_a_verify_rows_penalties_and_min_tokens_count_the_draft_before_it() -> None:
    """`SamplerExtras.build` with `before`: a verify row's counts are its job's output and context plus the
    draft's tokens before it, and min_tokens holds the stop tokens back only while output and those tokens are
    fewer than it."""
    vocab = 64
    job = Job(JobKind.GENERATE, "a", None, sampling=SamplingParams(max_tokens=8, min_tokens=3, frequency_penalty=0.5),
              stop_ids=frozenset({9}))
    job.output_ids, job.context_tokens = [5], [1, 2, 5]
    built = SamplerExtras.build([job, job, job], 4, vocab, before=[[], [6], [6, 9]])
    assert built is not None
    ex, counts = built
    assert counts is not None
    assert counts[0, 5] == 3 and counts[0, 6] == 0 and counts[0, 1] == 1  # generated twice-counted, + in context
    assert counts[1, 6] == 3 and counts[2, 9] == 3 and counts[1, 9] == 0
    allowed = [bool(ex.mask[r, 0] >> 9 & 1) for r in range(3)]  # token 9 (a stop token) in word 0, bit 9
    assert allowed == [False, False, True]  # 1 and 2 tokens before: held back; 3: no longer


# ---- the engine ---------------------------------------------------------------------------------------------
def _generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str, **sampling: object,
              ) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=p)).result(TIMEOUT)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda i: eng.generate_future(GenerateRequest(
            context_id=f"{tag}{i}", sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)))
            .result(TIMEOUT).token_ids, range(len(prompts))))
    for i in range(len(prompts)):
        eng.free_future(f"{tag}{i}").result(TIMEOUT)
    return outs


def test_engine_gives_the_plain_greedy_tokens() -> None:
    """A tiny random model repeats itself, so drafts are confirmed: one and four streams, with
    multi-step decode and overlap as a CPU runs them, give the tokens plain decoding gives, and the pool is
    whole again afterwards."""
    model = tiny_model()
    prompts = [[(i * 37 + k * 11) % 250 + 3 for k in range(20)] for i in range(4)]  # it soon repeats one token
    plain = LLMEngine(model, tiny_engine_config(multi_step=4)).start(precompile=False)
    spec = LLMEngine(model, tiny_engine_config(multi_step=4, speculative_tokens=4)).start(precompile=False)
    spec.scheduler.spec_costs = SPEC_COSTS_ACCELERATOR  # drafts at every batch size, not only where they pay here
    try:
        for batch in (1, 4):
            assert _generate(spec, prompts[:batch], 48, "s") == _generate(plain, prompts[:batch], 48, "p")
        info = spec.ping()
        assert info.spec_steps > 0 and info.spec_accepted_tokens > 0
        assert info.settings["speculative_tokens"] == 4
        assert spec.kv.num_free_pages == spec.kv.total_pages
        # sampled, seeded: each verify row draws with its own step's random number, so the same tokens again
        before = info.spec_accepted_tokens
        for kw in ({"temperature": 0.2, "seed": 11}, {"temperature": 0.4, "top_k": 5, "top_p": 0.9, "seed": 3}):
            assert _generate(spec, prompts, 48, "s", **kw) == _generate(plain, prompts, 48, "p", **kw)
        assert spec.ping().spec_accepted_tokens > before
    finally:
        plain.shutdown()
        spec.shutdown()


def _generate_full(eng: LLMEngine, prompts: list[list[int]], tag: str, **sampling: object) -> list[GenerateResponse]:
    for i, p in enumerate(prompts):
        eng.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=p)).result(TIMEOUT)
    futs = [eng.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=SamplingParams(
        max_tokens=40, ignore_eos=True, **sampling))) for i in range(len(prompts))]
    outs = [f.result(TIMEOUT) for f in futs]
    for i in range(len(prompts)):
        eng.free_future(f"{tag}{i}").result(TIMEOUT)
    return outs


def test_processed_jobs_draft_with_the_plain_results() -> None:
    """Jobs asking for logprobs, with a logit_bias, penalties or min_tokens are drafted: each verified token's
    logprob (and top alternatives) is the one plain decoding reports for it (within float32 rounding: the tiny
    model's float weights go through XLA's products), and the tokens are plain decoding's; greedy and seeded."""
    model = tiny_model()
    prompts = [[(i * 37 + k * 11) % 250 + 3 for k in range(20)] for i in range(3)]
    plain = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    spec = LLMEngine(model, tiny_engine_config(speculative_tokens=4)).start(precompile=False)
    spec.scheduler.spec_costs = SPEC_COSTS_ACCELERATOR
    try:
        for kw in ({"logprobs": 2}, {"logprobs": 0, "temperature": 0.3, "seed": 9},
                   {"logit_bias": {40: 2.0, 41: -100.0}}, {"logprobs": 1, "logit_bias": {100: 1.5}},
                   {"frequency_penalty": 0.05, "presence_penalty": 0.05}, {"repetition_penalty": 1.02, "logprobs": 1},
                   {"min_tokens": 30, "stop_token_ids": [10, 11, 12]}):
            before = spec.ping().spec_accepted_tokens
            got, want = _generate_full(spec, prompts, "s", **kw), _generate_full(plain, prompts, "p", **kw)
            assert [g.token_ids for g in got] == [w.token_ids for w in want], kw
            assert all(same_logprobs(g.logprobs, w.logprobs, float_weights=True) for g, w in zip(got, want,
                                                                                             strict=True)), kw
            if "logprobs" in kw:
                assert all(g.logprobs is not None and len(g.logprobs) == len(g.token_ids) == 40 for g in got)
            assert spec.ping().spec_accepted_tokens > before, kw  # drafts were confirmed for these jobs
        assert spec.kv.num_free_pages == spec.kv.total_pages
    finally:
        plain.shutdown()
        spec.shutdown()


def test_constrained_jobs_draft_with_the_plain_results() -> None:
    """Constrained jobs are drafted: each verify row is masked by its grammar's state after the draft's tokens
    before it (greedy rows checked after sampling where there are several), an accepted draft token after which
    the grammar forces tokens hands them to fast-forward as a sampled one does, and tokens and logprobs are plain
    decoding's; greedy, seeded, with logprobs."""
    model = tiny_model()
    prompts = [[(i * 37 + k * 11) % 250 + 3 for k in range(20)] for i in range(3)]
    plain = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    spec = LLMEngine(model, tiny_engine_config(speculative_tokens=4)).start(precompile=False)
    spec.scheduler.spec_costs = SPEC_COSTS_ACCELERATOR
    forcing = "(ab[a-z]{3}-)+"  # "-ab" forced after every three letters
    forcing_40 = "(ab[a-z]{3}-)*(ab[a-z]{0,3})?"  # its first 40 tokens
    try:
        for kw, pattern in (({"regex": forcing}, forcing_40), ({"regex": forcing, "logprobs": 1}, forcing_40),
                            ({"regex": "([a-m][n-z])+"}, "([a-m][n-z])*[a-m]?"),  # each row its own letters
                            ({"regex": "[a-m]+", "temperature": 0.3, "seed": 4}, "[a-m]+"),
                            ({"regex": "[k-z]+", "logprobs": 0, "logit_bias": {110: 3.0}}, "[k-z]+")):
            before = spec.ping().spec_accepted_tokens
            got, want = _generate_full(spec, prompts, "s", **kw), _generate_full(plain, prompts, "p", **kw)
            assert [g.token_ids for g in got] == [w.token_ids for w in want], kw
            assert all(same_logprobs(g.logprobs, w.logprobs, float_weights=True) for g, w in zip(got, want,
                                                                                             strict=True)), kw
            assert all(re.fullmatch(pattern, g.text) for g in got), [g.text for g in got]
            assert spec.ping().spec_accepted_tokens > before, kw  # drafts were confirmed for these jobs
        assert spec.kv.num_free_pages == spec.kv.total_pages
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.mark.model
def test_default_model_copies_with_the_plain_tokens(smollm) -> None:  # noqa: ANN001
    """SmolLM2 asked to repeat a text: most tokens come from confirmed drafts, and the answer is plain
    decoding's, token for token (the verify rows are the decode rows plain decoding runs)."""
    tok = smollm.tokenizer
    text = ("The quick brown fox jumps over the lazy dog. Parrot serves LLM applications: prompts are templates "
            "bound to semantic variables, the server builds the DAG between requests and shares prompt prefixes.")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat the following text exactly, "
                                                                          f"word for word:\n\n{text}"}]))

    def response(eng: LLMEngine, **sampling: object) -> GenerateResponse:
        eng.fill_future(FillRequest(context_id="c", token_ids=ids)).result(TIMEOUT)
        out = eng.generate_future(GenerateRequest(context_id="c", sampling=SamplingParams(
            max_tokens=64, **sampling))).result(TIMEOUT)
        eng.free_future("c").result(TIMEOUT)
        return out

    def answer(eng: LLMEngine, **sampling: object) -> list[int]:
        return response(eng, **sampling).token_ids

    cfg = dict(compilation_cache_dir=None, kv_memory_mb=256, **batch_invariant_mode())
    plain = LLMEngine(smollm, EngineConfig(**cfg)).start(precompile=False)
    spec = LLMEngine(smollm, EngineConfig(**cfg, speculative_tokens=4)).start(precompile=False)
    try:
        expected = answer(plain)
        assert answer(spec) == expected
        assert "semantic variables" in tok.decode(expected)
        assert spec.ping().spec_accepted_tokens >= len(expected) // 2
        sampled = {"temperature": 0.6, "top_p": 0.95, "seed": 5}  # a seeded sample: the same tokens too
        assert answer(spec, **sampled) == answer(plain, **sampled)
        before = spec.ping().spec_accepted_tokens  # asking for logprobs: drafted, the same logprobs
        with_logprobs = response(spec, logprobs=3)
        plain_logprobs = response(plain, logprobs=3)
        assert with_logprobs.token_ids == plain_logprobs.token_ids == expected
        assert same_logprobs(with_logprobs.logprobs, plain_logprobs.logprobs, tol=1e-4)  # bf16 KV on CPUs
        assert spec.ping().spec_accepted_tokens - before >= len(expected) // 2
        before = spec.ping().spec_accepted_tokens  # constrained to a JSON schema: drafted, the same JSON
        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                  "additionalProperties": False}
        constrained = answer(spec, json_schema=schema)
        assert constrained == answer(plain, json_schema=schema)
        assert tok.decode(constrained).startswith('{"text": "The quick brown fox')
        assert spec.ping().spec_accepted_tokens - before >= len(constrained) // 3
    finally:
        plain.shutdown()
        spec.shutdown()
