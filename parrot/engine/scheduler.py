"""Iteration-level scheduler (Orca): every step picks the batch anew from the running jobs.

One step is `plan = schedule()`, the runner executing the plan (`ModelRunner.execute`), then
`update(plan, sampled)`, which applies the sampled tokens and returns the jobs' outputs. The scheduler
owns every job and context token list; nothing else edits them, so it can be driven without a model.

A step is one decode batch (jobs with exactly one token to feed: their last sampled token) plus one
prefill batch (chunks of jobs with more tokens to feed, within `max_num_batched_tokens`). Jobs join
and leave at any step. KV pages are allocated on demand; when they run out, the newest running job is
preempted (its private pages freed, its tokens recomputed later), so the cache never overflows and the
oldest job always makes progress. Before that, idle contexts (no job on them) lose their KV, least
recently used first; their tokens are kept, so the next primitive on them recomputes it. A job that
cannot fit even then fails with an explicit error. Priority (0 latency-critical, then 1, ...) orders the
queue, and with the batch full a waiting job preempts a running one of a larger priority number (the
newest of the least urgent): a chat does not wait for a batch job's whole generation. Jobs name their client
(`Job.client`, e.g. an API key): with several clients' work running or waiting, waiting jobs of a priority are
admitted in turns between the clients (`_in_turns`), and in a full batch a client running fewer jobs than its
share (the batch size over the clients) takes the place of the newest job, no more urgent, of the client furthest
above its share (`_yield_to_fair_share`): one client flooding the engine does not keep another's work waiting for
its whole first wave.

Overlap (`schedule_ahead`): while a decode-only step runs on the device, the next step of the same
batch is planned and launched before the first's tokens reach the host. Its slots feed a placeholder
(`PENDING`) that the runner replaces on the device with the token the previous step sampled (`Slot.source`);
`update(plan, sampled, ahead)` then applies the first step and hands each token to the ahead slot that
feeds it. A job that finished in the first step leaves its ahead slot unused: its KV beyond its tokens is
dropped. Only a stable batch runs ahead: no waiting job that could join it, no prefill, no job whose next
token needs host work (constraints, logprobs, penalties) and pages free for every job, so a step in flight
is never preempted.

Multi-step decode (`schedule_ahead(plan, steps=k)`): an ahead step of a stable batch may run `k` decode
steps in one dispatch (`StepPlan.steps`): each slot's KV grows by up to `k` tokens (`Slot.steps`: fewer
where the job's max_tokens or the model's length ends it sooner), the device samples and feeds the tokens
itself and stops a row at its stop tokens; `update` then applies each slot's tokens in order, and a job
that finished before its last one drops the KV beyond its tokens, as an unused ahead slot does.

Constrained jobs in multi-step calls (`lazy_constraints`, CPUs): a greedy constrained job decoding alone runs
multi-step plans too, the device sampling its argmax without a mask; `update` checks each token with its grammar
(a token it takes is the masked argmax) and drops the call's tokens from the first it refuses, or after one that
makes it force tokens, cutting their KV. A call is as long as the job's free runs tend to be (`_run_span`); a
plan with a constrained job is never run ahead, since its grammar must see each token before the next plan.

How a token is fed (`row_fed`): a prompt's tokens go in prompt chunks (prompt rows), a generated token as a decode
row (a plain decode slot, or a rows slot: tokens a grammar forces, each a decode row of its own in one step), and the
two compute different bits. Each context records how each of its tokens was fed, and a context whose KV is
recomputed (its job preempted, or its KV evicted while idle) feeds every token again the same way: a preempted or
evicted context gives the same bits, and the same outputs, as one that kept its KV.

Decode bursts (`burst_tokens`): while more prompt tokens wait than one step beside the decodes takes,
`schedule(steps, fits)` alternates a step that fills prompts alone (up to `burst_tokens`) with a
decode-only multi-step plan of the whole decode batch, instead of a short chunk beside every decode step.

Speculative decoding (`EngineConfig.speculative_tokens`, engine/speculative.py): a generate whose context's
tail occurred earlier in it feeds its last token and the tokens that followed that occurrence (a draft) in one
step, a verify slot in the decode batch whose tokens the runner runs as decode rows, each sampled as a decode
step at its position samples (the same logits, the same random number); `update` keeps the draft's prefix the
sampled tokens confirm, adds the sampled token after it, and cuts the KV of the rest. For a draft of fixed
tokens that is exactly speculative sampling's rejection rule (accept a draft token with its probability, else
sample from the rest), so outputs are plain decoding's: greedy and seeded ones token for token. A batch
with drafts worth verifying from the tokens known so far (`_plan_drafts`: acceptance and a cost model) is not run
ahead: a draft needs the last token.

Throughput hold (`hold_s`): while latency-critical jobs (priority 0) decode and throughput work (priority
> 0) has prompts to fill, the throughput work waits, its decodes too, and the latency-critical decodes run
back to back (as bursts where they can), so a chat's tokens do not wait for a batch job's prompt steps.
The batch job then fills its prompts in whole chunks and decodes in the large batches it would have had.
The wait is bounded: after `hold_s` of holding, one step runs as without the hold, and the hold starts
again.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from parrot.config import EngineConfig
from parrot.engine.batch import pick_bucket
from parrot.engine.kv_cache import KVCacheManager, OutOfPages, PageCopy
from parrot.engine.logprobs import SampledLogprob
from parrot.engine.sampling import needs_processing
from parrot.engine.sequence import Job, JobKind, JobOutput, JobStatus
from parrot.engine.speculative import NgramDrafter
from parrot.engine.structured import ConstraintError
from parrot.errors import AbortedError, InvalidRequestError, NotFoundError, ParrotError, code_of, error_for_code
from parrot.protocol import FillResponse, GenerateResponse, StreamChunk, TokenLogprob, logprobs_within


@dataclass
class Slot:
    """One job's share of a step: `tokens` fed at positions `start..`, KV in `pages`; `sample`: the
    logits of its last token are sampled (a generate feeding all its pending tokens)."""

    job: Job
    tokens: list[int]
    start: int
    pages: list[int]
    sample: bool = False
    logprob: SampledLogprob | None = None  # set by the runner when the job asked for logprobs
    source: int = -1  # a PENDING token: the index of the previous step's slot whose sampled token it is
    # a fill asking for its tokens' logprobs: per fed token the context token it predicts (-1: none of the
    # fill's), and what the runner computed for each (None where the target is -1)
    targets: list[int] | None = None
    scores: list[SampledLogprob | None] | None = None
    steps: int = 1  # a multi-step plan's decode steps for this slot (its KV grows by that many tokens)
    # speculative decoding: a verify slot feeds the job's last token then `draft` (prompt lookup); the runner
    # sets `verified`, the token sampled after each fed token (len(draft) + 1 of them)
    draft: list[int] | None = None
    verified: list[int] | None = None
    verified_logprobs: list[SampledLogprob | None] | None = None  # each verified token's, for a job asking them
    # a verify slot's row (runner): the draft's tokens before the one it samples; their number is its place after
    # the job's last token, its sampler step's too
    before: tuple[int, ...] = ()
    rows: bool = False  # its tokens run as decode rows of their own (a verify slot, or a rows slot: `row_fed`)
    prompt: bool = False  # a prompt chunk: its tokens are multiplied as prompt rows


PENDING = -1  # a token sampled by the step in flight: the runner takes it from the device

# the runner's answer to "can these jobs (holding these pages, the longest KV this long) run k steps in one
# call now?" (ModelRunner.multi_fits)
Fits = Callable[[list[Job], list[list[int]], int, int], bool]


@dataclass
class StepPlan:
    decode: list[Slot] = field(default_factory=list)
    prefill: list[Slot] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)  # page copies to run before the forward
    outputs: list[JobOutput] = field(default_factory=list)  # jobs that failed while scheduling
    steps: int = 1  # > 1: a multi-step decode plan (`Scheduler.schedule_ahead`); `sampled` is [steps, slots]

    @property
    def slots(self) -> list[Slot]:
        """Decode slots then prefill slots: the order of `sampled` in `Scheduler.update`."""
        return [*self.decode, *self.prefill]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


# prompt tokens per step between decode bursts where the engine runs multi-step decode and
# `EngineConfig.decode_bursts` is not set. Measured on a 2-core EPYC Zen 4 with SmolLM2 (docs/benchmarks.md,
# benchmarks/mixed_steps.py): 8 chats decoding beside two 1,000-token prompts got 66 against 128 ms per token
# and the prompts 903 against 769 tok/s, against a 128-token chunk beside every decode step; the longest gaps
# between two tokens grow (p99 328 against 185 ms)
AUTO_DECODE_BURSTS = 256
# the throughput hold's bound where decode bursts run and `EngineConfig.throughput_hold_ms` is not set. Measured
# there (docs/benchmarks.md): chats beside a map-reduce ~3x faster at p99, the map-reduce level
AUTO_THROUGHPUT_HOLD_MS = 1000


# speculative decoding's cost model (`Scheduler._plan_drafts`), in rows' worth: a plain decode step of B rows (run
# ahead, or B steps in one multi-step call) costs about (step + B) rows, a verify step (waited for: its next draft
# needs its tokens) about (sync + its rows: B and its draft tokens). On a 2-core Xeon with AMX and SmolLM2-135M,
# decode rows over ~300-token contexts, waited for: 1 / 2 / 4 / 8 / 12 / 20 rows took 8.1 / 10.7 / 12.2-14.9 /
# 22.6 / 26.4 / 49.2 ms (~2 ms a row beside ~6 ms); multi-step loops ~4.3 ms a token at 1 row and ~10 ms a step
# at 4. In rows of 2 ms: step 1.15, sync 3. On an accelerator a few more rows cost next to nothing beside a step
# (an estimate: not measured there)
SPEC_COSTS_CPU = (1.15, 3.0)  # (step, sync)
SPEC_COSTS_ACCELERATOR = (60.0, 80.0)
SPEC_PRIOR = (4.5, 5.0)  # a new context's acceptance, as (confirmed, tried) draft tokens: 0.9, worth 5 tried
SPEC_DECAY = 0.8  # the weight of a context's earlier evidence after each verify step
SPEC_SHADOW_DECAY = 0.9  # ... after each token decoded without a draft (a 1-token draft's hit or miss)

# greedy constrained jobs in multi-step calls (`lazy_constraints`): a call's tokens past the place where the grammar
# forces tokens or refuses the argmax are dropped, so a job's call takes another step while that step's token is
# likely to stand (`_run_span`): the share of its recent free runs (`Job.runs`, the last RUN_HISTORY) as long as the
# current one so far that went on that far, or where fewer than RUN_EVIDENCE went as far, t / (t + j + 1) for the
# (j + 1)-th token after t (a run that lasted t tokens tends to last as long again: long strings show themselves),
# at least RUN_KEEP: a loop step's cost over a single step's (on a 2-core Xeon with AMX and SmolLM2-135M ~4.3 ms a
# token in a 4-step loop, ~6 ms a single step with its mask)
RUN_HISTORY = 16
RUN_EVIDENCE = 3
RUN_KEEP = 0.7
# ... and only for a job decoding alone: with two or more such rows a single step checks them after sampling
# instead of computing masks first (`runner.LAZY_MIN_ROWS`), and a batch's call is cut short at every refusal or
# forced run of any of its jobs: measured there (benchmarks/constrained.py, medians of 5), long JSON strings took
# 1.18x the tokens per second of single steps alone, 1.06x two at once, 0.95x four, 0.94x sixteen
RUN_MAX_BATCH = 1


def beside_decodes(cfg: EngineConfig) -> int:
    """Prompt tokens a step that decodes takes. Prompts that fit in one such step go beside the decodes at
    once (their decode rows nearly free in a mixed step); longer ones take turns with decode bursts."""
    budget = cfg.max_num_batched_tokens
    return min(budget, cfg.prefill_tokens_beside_decodes or budget)


def _within_grammar(job: Job, draft: list[int]) -> list[int]:
    """The longest prefix of a constrained job's draft that its grammar takes, up to its first stop token (a verify
    row's mask is its grammar's state after the draft's tokens before it: `SamplerExtras.build`)."""
    assert job.constraint is not None
    draft = draft[: job.constraint.takes(draft)]
    return next((draft[:i] for i, t in enumerate(draft) if t in job.stop_ids), draft)


def _end_run(job: Job) -> None:
    """A constrained job's free run ends (its grammar forced tokens, or refused a multi-step call's)."""
    job.runs = [*job.runs[1 - RUN_HISTORY:], job.run_tokens]
    job.run_tokens = 0


def _run_span(job: Job, steps: int) -> int:
    """How many of up to `steps` decode steps a constrained job's multi-step call should take: while the next
    step's token is likely enough to stand (see RUN_KEEP); 1 where even the second's is not (a step a call)."""
    t = job.run_tokens
    reached = [n for n in job.runs if n >= t]
    span = 1
    for j in range(1, steps):  # the call's (j + 1)-th token stands if the run reaches t + j + 1 tokens
        p = (sum(n > t + j for n in reached) / len(reached) if len(reached) >= RUN_EVIDENCE
             else t / (t + j + 1))
        if p < RUN_KEEP:
            break
        span = j + 1
    return span


class Scheduler:
    def __init__(self, kv: KVCacheManager, cfg: EngineConfig, max_len: int, attention_in_place: bool = False,
                 decode_bursts: int | None = None, throughput_hold_ms: int | None = None,
                 spec_costs: tuple[float, float] = SPEC_COSTS_CPU, lazy_constraints: bool = False) -> None:
        """`decode_bursts`: prompt tokens per step between decode bursts, 0 for none (default:
        `cfg.decode_bursts`, none where that is unset; the engine resolves its automatic value); the same for
        `throughput_hold_ms` (`cfg.throughput_hold_ms`), the throughput hold's bound; `spec_costs`: the device's
        speculative decoding cost model (`SPEC_COSTS_*`); `lazy_constraints`: greedy constrained jobs decode in
        multi-step calls without their masks, their tokens checked as they are applied (the runner's
        `lazy_masks`: a CPU's)."""
        self.kv = kv
        self.cfg = cfg
        self.max_len = max_len
        self.burst_tokens = decode_bursts if decode_bursts is not None else (cfg.decode_bursts or 0)
        hold_ms = throughput_hold_ms if throughput_hold_ms is not None else (cfg.throughput_hold_ms or 0)
        self.hold_s = hold_ms / 1000  # the throughput hold's bound (0: no hold)
        # the runner's prefill attention reads KV pages in place: no cuts at attention-length buckets (`_align`),
        # and chunks of several sequences padded by their total tokens (ShapeBook.prefill_shape)
        self.attention_in_place = attention_in_place
        self.max_prefill_batch = max(cfg.prefill_bs_buckets)
        self.tokens: dict[str, list[int]] = {}  # every context's tokens (KV holds a prefix of them)
        self._queued = itertools.count()  # jobs taken (`Job.queued`)
        # every context's fed tokens (a prefix of its tokens, its KV's or longer): 1 where the token was fed as a
        # decode row, 0 where in a prompt chunk; a recomputed token is fed the same way again (`_next_feed`)
        self.row_fed: dict[str, bytearray] = {}
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.busy: dict[str, Job] = {}  # context -> its running job
        self.last_used: dict[str, float] = {}
        self.preemptions = 0  # running jobs whose KV was dropped for recompute
        self.priority_preemptions = 0  # ... of them, to make room in a full batch for more urgent work
        self.fair_preemptions = 0  # ... of them, to give a client its share of a full batch (`_yield_to_fair_share`)
        self.evictions = 0  # idle contexts whose KV was dropped for recompute
        self.aborts = 0  # jobs aborted before they finished
        self.prompt_tokens = 0  # tokens computed in prompt chunks (a throughput figure: recomputed ones too)
        self.generated_tokens = 0  # tokens that joined generates' outputs
        self.fast_forward_tokens = 0  # grammar-forced tokens fed as the rows of one step: decode steps saved
        self._copies: list[PageCopy] = []  # copy-on-write copies made between steps: run first next step
        self._burst_due = False  # the last step filled prompts while decodes waited: their burst is next
        self.decode_bursts = 0  # decode-only bursts planned between prompt steps (`EngineConfig.decode_bursts`)
        self._held_since: float | None = None  # throughput prompts wait for latency-critical decodes since then
        self.held_steps = 0  # steps planned while throughput prompts were held (`EngineConfig.throughput_hold_ms`)
        # slots kept for the primitive following an urgent prompt that ended (`EngineConfig.priority_handoff_ms`):
        # context -> when the slot is let go
        self.kept: dict[str, float] = {}
        self.handoff_s = cfg.priority_handoff_ms / 1000
        self.kept_slots = 0  # slots kept so, and taken by the primitive that followed
        # speculative decoding by prompt lookup (off where `speculative_tokens` is 0, or the engine turns it off)
        self.drafter = (NgramDrafter(cfg.speculative_tokens, cfg.speculative_ngram, cfg.speculative_min_ngram)
                        if cfg.speculative_tokens else None)
        self.spec_costs = spec_costs  # a plain and a verify step's cost beside their rows, in rows (`_plan_drafts`)
        # context -> decayed (confirmed, tried) draft tokens: of verify steps, and of the drafts a plain step's
        # token would have confirmed (`_shadow`)
        self._acceptance: dict[str, tuple[float, float]] = {}
        self.spec_steps = 0  # verify slots run
        self.spec_draft_tokens = 0  # draft tokens they fed
        self.spec_accepted_tokens = 0  # draft tokens the samples after them confirmed
        # greedy constrained jobs (`sampling.lazily_constrained`) run in multi-step calls, their tokens sampled
        # without masks and checked by their grammars when applied (`_update_steps`)
        self.lazy_constraints = lazy_constraints
        self.unchecked_tokens = 0  # tokens such calls sampled that their grammars took
        self.unchecked_refusals = 0  # ... that they refused (the call's tokens from there dropped)

    # ---- queue --------------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        """Queue a job by (priority, arrival). A job may also arrive 'earlier' than queued ones (`waited_s`),
        but never goes ahead of a queued or running job touching the same contexts (a running one may be
        preempted and queued again): primitives on one context keep their order."""
        job.queued = next(self._queued)
        related = {job.context_id, job.parent_context_id} - {None}
        for other in itertools.chain(self.waiting, self.running):
            if other.context_id in related or other.parent_context_id == job.context_id:
                job.arrival = max(job.arrival, other.arrival)
                job.priority = max(job.priority, other.priority)
        self.waiting.append(job)
        if len(self.waiting) > 1 and job.order < self.waiting[-2].order:
            self.waiting = deque(sorted(self.waiting, key=lambda j: j.order))

    def has_work(self) -> bool:
        """True if a step has something to do: running jobs, or waiting ones a kept slot does not hold back."""
        if self.running or not self.waiting:
            return bool(self.running)
        self._let_go()
        return len(self.kept) < self.cfg.max_batch_size or any(self._takes_kept(j) for j in self.waiting)

    def wake_in(self, most: float = 0.5) -> float:
        """Seconds until the first kept slot is let go (at most `most`): how long an engine with nothing else to
        do waits for new work before it looks again."""
        return max(0.0, min([most, *(t - time.monotonic() for t in self.kept.values())]))

    # ---- slots kept for the primitive after an urgent prompt --------------------------------------
    def _keep_slot(self, job: Job) -> None:
        """`job` (running, about to leave `running`) has filled its tokens: a prompt of more urgent work than some
        waiting job (or of a client within its share while another's waits: `_within_share`), in a full batch, with
        nothing queued on its context or forking it yet, keeps its slot `handoff_s` for that next primitive (see
        `EngineConfig.priority_handoff_ms`)."""
        ctx = job.context_id
        if (not self.handoff_s or job.kind is not JobKind.FILL or len(self.running) < self.cfg.max_batch_size
                or not (any(w.priority > job.priority for w in self.waiting) or self._within_share(job))
                or any(w.context_id == ctx or w.parent_context_id == ctx for w in self.waiting)):
            return
        self.kept[ctx] = time.monotonic() + self.handoff_s

    def _let_go(self) -> None:
        """Drop the kept slots whose time is up."""
        now = time.monotonic()
        for ctx in [c for c, t in self.kept.items() if t <= now]:
            del self.kept[ctx]

    def _takes_kept(self, job: Job) -> bool:
        return job.context_id in self.kept or (job.parent_context_id is not None and job.parent_context_id in self.kept)

    def _take_kept(self, job: Job) -> None:
        for ctx in (job.context_id, job.parent_context_id):
            if ctx is not None and self.kept.pop(ctx, None) is not None:
                self.kept_slots += 1
                return

    def referenced(self, context_id: str) -> bool:
        """True if a queued or running job uses the context (as its own or as the parent to fork)."""
        return context_id in self.busy or any(
            j.context_id == context_id or j.parent_context_id == context_id for j in self.waiting)

    def finish(self, job: Job) -> None:
        self.last_used[job.context_id] = time.monotonic()
        if self.drafter is not None:
            self.drafter.forget(job.context_id)
            self._acceptance.pop(job.context_id, None)
        job.status = JobStatus.FINISHED
        self.running.remove(job)
        del self.busy[job.context_id]

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self, steps: int = 1, fits: Fits | None = None) -> StepPlan:
        """Plan the next step. With decode bursts (`burst_tokens`), `steps` and `fits` (as in `schedule_ahead`)
        let a decode batch that waits beside prompts run as a decode-only burst of up to `steps` steps."""
        plan = StepPlan(copies=self._copies)
        self._copies = []
        self._admit(plan)
        scheduled: set[int] = set()
        feeds = {job.job_id: self._next_feed(job) for job in self.running
                 if job.pending and job.status is JobStatus.RUNNING}  # job -> (as decode rows, tokens fed so)
        decoding = [job for job in sorted(self.running, key=lambda j: j.order)
                    if job.job_id in feeds and feeds[job.job_id][0] and len(job.pending) == 1]
        skipped: list[Job] = []  # decodes that wait for their burst while this step fills prompts alone
        all_prompts = self._prompt_tokens_pending(feeds)
        latency_prompts = self._prompt_tokens_pending(feeds, latency_only=True) if self.hold_s else all_prompts
        held = self._holding(decoding, throughput_waits=all_prompts > latency_prompts)
        prompts = latency_prompts if held else all_prompts
        if held:
            self.held_steps += 1
            decoding = [j for j in decoding if j.priority == 0]  # throughput decodes wait with their prompts
        if self.burst_tokens and decoding and (prompts > self._beside_decodes() or (held and not prompts)):
            batch = decoding[: self.cfg.max_batch_size]
            spans = self._burst_spans(batch, steps, fits)
            if spans is not None:
                if self._burst_due or not prompts:  # the last step filled prompts, or only held ones wait: now
                    self._burst(plan, batch, spans)  # the decodes' burst, alone
                    return plan
                skipped, decoding = batch, []
        if self.drafter is not None:  # drafts first (verify slots), then plain decodes
            decoding = self._add_drafts(plan, decoding, scheduled)
        if ((self.drafter is not None or any(j.constraint is not None for j in decoding)) and not plan.decode
                and decoding and len(decoding) == len(self.running) and not prompts and not self.waiting
                and len(decoding) <= self.cfg.max_batch_size):
            # no draft now (or constrained jobs, which never run ahead: their grammars check each call's tokens)
            # and nothing else to run: a multi-step call at once, not one step before the ahead ones (after a
            # verify step every plan starts afresh)
            spans = self._burst_spans(decoding, steps, fits)
            if spans is not None:
                self._burst(plan, decoding, spans, count=False)
                return plan
        self._add_decodes(plan, decoding, scheduled)  # decodes first: running work keeps its pace
        if not skipped:  # then the jobs with several tokens to feed as decode rows (forced or recomputed)
            self._add_rows(plan, feeds, scheduled, held)
        # then prefill chunks within the token budget; the padded step (sequences bucket x longest
        # chunk bucket) must stay within it too, so every prefill step has a precompiled shape
        budget = self.cfg.max_num_batched_tokens
        if plan.decode:  # running decodes wait for the prefill chunk beside them: keep it short
            budget = self._beside_decodes()
        if skipped:  # a prompts-only step between two decode bursts
            budget = min(budget, self.burst_tokens)
        # throughput work's share beside latency-critical decodes (a chat's next token waits for it)
        background = budget
        latency_waits = any(s.job.priority == 0 for s in plan.decode) or any(j.priority == 0 for j in skipped)
        if held:
            background = 0
        elif self.cfg.prefill_tokens_beside_latency and latency_waits:
            background = min(budget, self.cfg.prefill_tokens_beside_latency)
        longest = 0
        for job in sorted(self.running, key=lambda j: j.order):
            if job.job_id not in feeds or feeds[job.job_id][0] or job.status is not JobStatus.RUNNING:
                continue  # nothing to feed, its next tokens go as decode rows, or preempted by this step
            if budget <= 0 or len(plan.prefill) >= self.max_prefill_batch:
                break
            limit = budget if job.priority == 0 else min(budget, background)
            if limit <= 0:
                continue
            if self._room(job.context_id) <= 0:
                if plan.decode or plan.prefill or not self._make_room(job, 1, scheduled, plan):
                    continue  # others progress this step and free pages
            n = self._align(self.kv.get(job.context_id).num_tokens, min(feeds[job.job_id][1], limit,
                                                                         self._room(job.context_id)))
            if plan.prefill and not self.attention_in_place:
                count = pick_bucket(len(plan.prefill) + 1, self.cfg.prefill_bs_buckets)
                if count * pick_bucket(max(longest, n), self.cfg.token_buckets) > self.cfg.max_num_batched_tokens:
                    break
            slot = self._slot(job, job.pending[:n], False)  # a generate's last token is a decode row's: not here
            slot.prompt = True
            plan.prefill.append(slot)
            scheduled.add(job.job_id)
            budget -= n
            background -= n
            longest = max(longest, n)
        if skipped and not plan.prefill:  # no prompt could be filled after all: the decodes go now
            spans = self._burst_spans(skipped, steps, fits)
            if spans is not None:
                self._burst(plan, skipped, spans)
                return plan
            self._add_decodes(plan, skipped, scheduled)
        self._burst_due = bool(skipped) and bool(plan.prefill)
        return plan

    def _add_decodes(self, plan: StepPlan, jobs: list[Job], scheduled: set[int]) -> None:
        """One step of each of `jobs` (in order, up to the batch size) into `plan`'s decode batch; the
        newest running job is preempted where pages run out."""
        for job in jobs:
            if len(job.pending) != 1 or job.status is not JobStatus.RUNNING:
                continue
            if len(plan.decode) >= self.cfg.max_batch_size:
                break
            if not self._make_room(job, 1, scheduled, plan):
                continue
            plan.decode.append(self._slot(job, job.pending[:1], job.kind is JobKind.GENERATE))
            scheduled.add(job.job_id)

    def _add_rows(self, plan: StepPlan, feeds: dict[int, tuple[bool, int]], scheduled: set[int],
                  held: bool) -> None:
        """A rows slot in `plan`'s decode batch for each running job whose next tokens are several decode rows'
        (a grammar's forced tokens after a sampled one, or generated tokens recomputed): each token a decode row of
        its own in this step, as many as the batch has rows left (`max_batch_size`); the job samples after the
        last of its pending tokens. Throughput jobs wait while they are `held`."""
        used = sum(len(s.tokens) if s.rows else 1 for s in plan.decode)
        for job in sorted(self.running, key=lambda j: j.order):
            feed = feeds.get(job.job_id)
            if (feed is None or not feed[0] or len(job.pending) == 1 or job.job_id in scheduled
                    or job.status is not JobStatus.RUNNING):
                continue  # nothing to feed as rows, fed already, or preempted by this step
            if held and job.priority:
                continue
            n = min(feed[1], self.cfg.max_batch_size - used)
            if n <= 0:
                break
            if not self._make_room(job, n, scheduled, plan):
                continue
            last = n == len(job.pending)
            slot = self._slot(job, job.pending[:n], job.kind is JobKind.GENERATE and last)
            slot.rows = True
            plan.decode.append(slot)
            scheduled.add(job.job_id)
            used += n
            if job.forced:
                self.fast_forward_tokens += n - 1

    def _next_feed(self, job: Job) -> tuple[bool, int]:
        """How `job`'s next pending token is fed (True: as a decode row, False: in a prompt chunk), and how many of
        its pending tokens from there are fed the same way: as recorded where the context fed them before
        (`row_fed`: its KV is recomputed), else a fill's as prompt rows and a generate's as decode rows."""
        fed = self.row_fed.setdefault(job.context_id, bytearray())
        p = self.kv.get(job.context_id).num_tokens  # the first pending token's position
        n = len(job.pending)
        new = job.kind is JobKind.GENERATE
        if p >= len(fed):
            return new, n
        row = fed[p] == 1
        end = min(len(fed), p + n)
        other = fed.find(b"\x00" if row else b"\x01", p, end)
        if other >= 0:
            return row, other - p
        return row, (n if end < p + n and new == row else end - p)

    def _record(self, context_id: str, start: int, n: int, row: bool) -> None:
        """Tokens `start..start + n` of a context were fed as decode rows (`row`) or in a prompt chunk."""
        fed = self.row_fed.get(context_id)
        if fed is None:
            return  # freed while its step was in flight
        end = min(start + n, len(self.tokens[context_id]))
        if start <= len(fed) and end > start:
            fed[start:end] = (b"\x01" if row else b"\x00") * (end - start)

    def draftable(self, job: Job) -> bool:
        """Whether speculative decoding may draft `job`'s tokens: a generate without forced tokens to feed (any
        sampling: logprobs, logit_bias, penalties, min_tokens and constraints are drafted)."""
        return (self.drafter is not None and job.kind is JobKind.GENERATE and job.sampling is not None
                and not job.forced)

    def _acceptance_rate(self, job: Job) -> float:
        """The context's recent share of draft tokens confirmed, each after the ones before it: from its verify
        steps, and from the tokens decoded without one that a draft would have predicted (`_shadow`)."""
        confirmed, tried = self._acceptance.get(job.context_id, SPEC_PRIOR)
        return confirmed / tried

    def _shadow(self, job: Job, token: int) -> None:
        """A token decoded without a draft: whether the draft from the tokens before it would have begun with it
        (a verify step's first row, at no cost) counts in the context's acceptance, so that odds are learned
        without paying for verify steps, and free text never pays for them."""
        assert self.drafter is not None
        guess = self.drafter.propose(job.context_id, self.tokens[job.context_id], 1)
        if guess:
            confirmed, tried = self._acceptance.get(job.context_id, SPEC_PRIOR)
            self._acceptance[job.context_id] = (SPEC_SHADOW_DECAY * confirmed + (guess[0] == token),
                                                SPEC_SHADOW_DECAY * tried + 1)

    def _plan_drafts(self, jobs: list[Job], ahead: bool = False) -> dict[int, list[int]]:
        """The drafts (job id -> tokens) worth verifying in a step of the decoding `jobs` (`ahead`: asked while
        their last tokens are still in flight, from the tokens known so far). A job's draft is as long as its
        tokens are likelier to be confirmed than their rows are dear: its i-th token (confirmed with probability
        a^i, a being the context's recent acceptance) costs one row, where a plain token costs
        (step + B) / B rows; and the step is worth waiting for only if its rows give more tokens per row than a
        plain step does (`SPEC_COSTS_*`). Within max_batch_size rows (one a job), max_tokens and the model's
        length; {} where none is worth it."""
        drafter = self.drafter
        if drafter is None or not jobs:
            return {}
        step, sync = self.spec_costs
        batch = len(jobs)
        plain = (step + batch) / batch  # rows a plain token costs
        spare = self.cfg.max_batch_size - min(batch, self.cfg.max_batch_size)
        drafts: dict[int, list[int]] = {}
        rows = gain = 0.0
        for job in jobs:
            if spare <= 0:
                break
            if not self.draftable(job) or (not ahead and (len(job.pending) != 1
                                                          or job.status is not JobStatus.RUNNING)):
                continue
            rate = self._acceptance_rate(job)
            k, p = 0, 1.0
            while k < drafter.tokens and p * rate * plain >= 1.0:
                p *= rate
                k += 1
            sp = job.sampling
            tokens = self.tokens[job.context_id]
            # a verify step gives at most len(draft) + 1 tokens: within max_tokens and the model's length
            room = min(sp.max_tokens - len(job.output_ids), self.max_len - len(tokens)) - 1
            draft = drafter.propose(job.context_id, tokens, min(k, room, spare)) if k else []
            if draft and job.constraint is not None:
                draft = _within_grammar(job, draft)
            if draft:
                drafts[job.job_id] = draft
                spare -= len(draft)
                rows += len(draft)
                gain += sum(rate ** (i + 1) for i in range(len(draft)))  # expected confirmed tokens
        if drafts and (sync + batch + rows) / (batch + gain) >= plain:
            return {}  # waiting for this step costs more than its drafts give
        return drafts

    def _add_drafts(self, plan: StepPlan, jobs: list[Job], scheduled: set[int]) -> list[Job]:
        """A verify slot in `plan`'s decode batch for each of the decoding `jobs` whose draft is worth its rows
        (`_plan_drafts`; its tokens run as decode rows; pages free without preempting anyone); returns the
        other jobs."""
        drafts = self._plan_drafts(jobs)
        rest: list[Job] = []
        for job in jobs:
            draft = drafts.get(job.job_id)
            if draft is None or not self.kv.can_extend(job.context_id, 1 + len(draft)):
                rest.append(job)
                continue
            slot = self._slot(job, [job.pending[0], *draft], False)
            slot.draft = draft
            slot.rows = True
            plan.decode.append(slot)
            scheduled.add(job.job_id)
        return rest

    def _prompt_tokens_pending(self, feeds: dict[int, tuple[bool, int]], latency_only: bool = False) -> int:
        """Prompt tokens the running jobs have to fill next, in prompt chunks (`feeds`: `_next_feed` of each);
        `latency_only`: of latency-critical jobs (priority 0) only."""
        return sum(feeds[j.job_id][1] for j in self.running
                   if j.job_id in feeds and not feeds[j.job_id][0] and not (latency_only and j.priority))

    def _holding(self, decoding: list[Job], throughput_waits: bool) -> bool:
        """True if throughput work waits this step (its prompts and its decodes): latency-critical jobs decode,
        throughput jobs have prompt tokens to fill (`throughput_waits`), and they have waited less than
        `hold_s` since the hold began (at the bound, this step runs as without a hold and the next starts a
        new hold)."""
        if not (self.hold_s and throughput_waits and any(j.priority == 0 for j in decoding)):
            self._held_since = None
            return False
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
        if now - self._held_since < self.hold_s:
            return True
        self._held_since = None
        return False

    def _beside_decodes(self) -> int:
        return beside_decodes(self.cfg)

    def _burst_spans(self, jobs: list[Job], steps: int, fits: Fits | None) -> list[int] | None:
        """`_decode_spans` of `jobs` now, where they can run as a burst (some job more than one step)."""
        spans = self._decode_spans(jobs, 0, steps, fits)
        return spans if spans is not None and max(spans) > 1 else None

    def _burst(self, plan: StepPlan, jobs: list[Job], spans: list[int], count: bool = True) -> None:
        """Make `plan` a decode-only plan of `jobs`, each taking its span of steps (`_decode_spans`); `count`: a
        decode burst between prompt steps (`decode_bursts`)."""
        plan.steps = max(spans)
        for job, n in zip(jobs, spans, strict=True):
            plan.decode.append(self._slot(job, job.pending[:1], True, steps=n))
        self._burst_due = False
        self.decode_bursts += count

    def schedule_ahead(self, plan: StepPlan, steps: int = 1, fits: Fits | None = None) -> StepPlan | None:
        """The next decode step of `plan`'s batch, planned before `plan`'s sampled tokens are known (see
        the module doc), or None when the batch is not stable enough to run ahead. With `steps` > 1, up to
        that many decode steps in one plan where `fits(jobs, their pages, longest KV, steps)` says the runner has
        the shape for it (and pages are free); one otherwise."""
        if plan.prefill or not plan.decode or plan.outputs or self._copies:
            return None
        if self.waiting and (len(self.running) + len(self.kept) < self.cfg.max_batch_size
                             or self.waiting[0].priority < max(j.priority for j in self.running)
                             or any(self._takes_kept(j) for j in self.waiting) or self._over_share() is not None):
            return None  # the full scheduler admits waiting work now (with a full batch only more urgent work, or a
            # client's below its share)
        jobs = [slot.job for slot in plan.decode]
        if len(jobs) != len(self.running) or not all(slot.sample for slot in plan.decode):
            return None  # a running job outside the batch (e.g. a fill waiting for pages) needs the full scheduler
        if any(job.constraint is not None for job in jobs):
            return None  # a grammar sees a job's last token before its next step is planned (it may force or refuse)
        if self._plan_drafts(jobs, ahead=True):
            return None  # the full scheduler drafts these jobs' next tokens (a draft needs the last one)
        spans = self._decode_spans(jobs, plan.steps, steps, fits)
        if spans is None:
            return None
        ahead = StepPlan(steps=max(spans))
        for i, (job, n) in enumerate(zip(jobs, spans, strict=True)):
            slot = self._slot(job, [PENDING], True, steps=n)
            slot.source = i
            ahead.decode.append(slot)
        return ahead

    def _decode_spans(self, jobs: list[Job], done: int, steps: int, fits: Fits | None) -> list[int] | None:
        """How many decode steps each of `jobs` may take in one plan once `done` more tokens of each are
        sampled (the plan in flight's): up to `steps` where `fits(jobs, their pages, longest KV, steps)` says
        the runner has the shape for it and pages are free, else 1. None where a job cannot be planned
        without its tokens (it may finish first, or its next token needs host work: constraints, logprobs,
        penalties, min_tokens) or the pages for one step each are not free (no plan is preempted). With
        `lazy_constraints`, a greedy constrained job decoding alone may run (`sampling.lazily_constrained`): its
        tokens are checked when applied, unless its grammar refused the loop's token at this very place."""
        room: list[int] = []  # tokens each job may still sample after `done`
        if len(jobs) > RUN_MAX_BATCH and any(job.constraint is not None for job in jobs):
            return None
        for job in jobs:
            sp = job.sampling
            if (job.kind is not JobKind.GENERATE or job.status is not JobStatus.RUNNING or sp is None
                    or len(job.pending) > 1 or needs_processing(job, lazy=self.lazy_constraints)
                    or job.refused_at == len(job.output_ids) + done
                    or len(job.output_ids) + done >= sp.max_tokens
                    or len(self.tokens[job.context_id]) + done >= self.max_len
                    or len(job.output_ids) + done < sp.min_tokens):
                return None
            room.append(min(sp.max_tokens - len(job.output_ids),
                            self.max_len - len(self.tokens[job.context_id])) - done)
            if job.constraint is not None:  # as long as its free runs tend to be
                room[-1] = min(room[-1], _run_span(job, steps))

        def pages(spans: list[int]) -> int:
            return sum(self.kv.pages_needed(job.context_id, n) for job, n in zip(jobs, spans, strict=True))

        spans = [min(steps, r) for r in room]
        if max(spans) > 1:
            longest = max(self.kv.get(job.context_id).num_tokens + n for job, n in zip(jobs, spans, strict=True))
            held = [self.kv.get(job.context_id).pages for job in jobs]
            if pages(spans) > self.kv.num_free_pages or fits is None or not fits(jobs, held, longest, max(spans)):
                spans = [1] * len(jobs)
        return spans if pages(spans) <= self.kv.num_free_pages else None

    def _align(self, start: int, n: int) -> int:
        """Cut a prefill chunk starting at `start` at the end of the attention-length bucket `start` lies
        in, when that keeps at least half of it: the chunk then attends over the shorter padded length
        (a 512-token chunk after a 31-token cached prefix would otherwise pay for 1024 keys). Not where
        attention reads the pages in place (`attention_in_place`): its cost does not depend on the bucket,
        and a cut would only add a step."""
        if self.attention_in_place:
            return n
        for bucket in self.cfg.kv_buckets:
            if bucket > start:
                if start + n > bucket and 2 * (bucket - start) >= n:
                    return bucket - start
                break
        return n

    def _slot(self, job: Job, tokens: list[int], sample: bool, steps: int = 1) -> Slot:
        start = self.kv.get(job.context_id).num_tokens
        pages = self.kv.extend(job.context_id, len(tokens) + steps - 1)
        slot = Slot(job, tokens, start, pages, sample, steps=steps)
        if job.kind is JobKind.FILL and job.fill_logprobs is not None:
            ctx = self.tokens[job.context_id]
            slot.targets = [ctx[p] if job.base_len <= p < len(ctx) else -1
                            for p in range(start + 1, start + len(tokens) + 1)]
        return slot

    # ---- applying a step's results ------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Sequence[int] | None, ahead: StepPlan | None = None) -> list[JobOutput]:
        """Apply an executed plan: the fed tokens leave each job's pending list; `sampled[i]` is the
        token sampled for `plan.slots[i]` (read only where `slot.sample`). `ahead`: the next step, already
        launched (`schedule_ahead`), whose slots feed these tokens. Returns the outputs: the plan's
        scheduling failures, streamed tokens, and the jobs that finished. A multi-step plan's `sampled` is
        `[plan.steps, slots]`: step j's token of each slot."""
        if plan.steps > 1:
            return self._update_steps(plan, sampled, ahead)
        outputs = list(plan.outputs)
        feeds = {slot.job.job_id: slot for slot in ahead.slots} if ahead is not None else {}
        for i, slot in enumerate(plan.slots):
            job = slot.job
            if slot.draft is not None:
                outputs.extend(self._accept(slot))
                continue
            self._record(job.context_id, slot.start, len(slot.tokens), not slot.prompt)
            if slot.prompt:
                self.prompt_tokens += len(slot.tokens)
            if job.status is JobStatus.FINISHED:
                continue  # aborted while its step was in flight
            if slot.scores is not None:
                self._score(job, slot)
            del job.pending[: len(slot.tokens)]
            if job.pending:
                continue
            if job.kind is JobKind.FILL:
                self._keep_slot(job)
                self.finish(job)
                outputs.append(JobOutput(job, result=FillResponse(
                    context_id=job.context_id, num_tokens=len(self.tokens[job.context_id]),
                    logprobs=self._fill_logprobs(job))))
                continue
            assert slot.sample and sampled is not None
            token = int(sampled[i])
            outputs.append(self._on_token(job, token, slot.logprob))
            self._hand_over(job, feeds.get(job.job_id))
        return outputs

    def _update_steps(self, plan: StepPlan, sampled: Sequence[Sequence[int]] | None,
                      ahead: StepPlan | None) -> list[JobOutput]:
        """`update` for a multi-step plan: each slot's tokens in order; token j was fed on the device in
        step j + 1 (the KV of a job that stopped earlier is cut back to its tokens). A constrained job's tokens
        (sampled without its mask: the argmax) stand while its grammar takes them, each then the masked argmax
        too; at the first it refuses, or after one its grammar forces tokens after, the rest are dropped and its
        KV cut back to its tokens fed (a verify step's cut): its next token comes from a step that sees it."""
        assert sampled is not None
        outputs = list(plan.outputs)
        feeds = {slot.job.job_id: slot for slot in ahead.slots} if ahead is not None else {}
        for i, slot in enumerate(plan.decode):
            job = slot.job
            for j in range(slot.steps):
                if job.status is JobStatus.FINISHED:
                    break  # aborted while its step was in flight, or stopped at an earlier token
                token = int(sampled[j][i])
                if job.constraint is not None:
                    if not job.constraint.accepts(token):
                        job.refused_at = len(job.output_ids)
                        self.unchecked_refusals += 1
                        _end_run(job)
                        break
                    self.unchecked_tokens += 1
                del job.pending[:1]  # fed: the slot's token, then each token the device sampled before
                outputs.append(self._on_token(job, token, None))
                if job.forced:
                    break
            if job.constraint is not None and job.status is JobStatus.RUNNING:
                fed = len(self.tokens[job.context_id]) - len(job.pending)  # the KV of the dropped tokens goes
                if self.kv.get(job.context_id).num_tokens > fed:
                    self._truncate(job.context_id, fed)
            self._record(job.context_id, slot.start, slot.steps, True)
            self._hand_over(job, feeds.get(job.job_id))
        return outputs

    def _accept(self, slot: Slot) -> list[JobOutput]:
        """Apply a verify slot (speculative decoding): the draft's longest prefix that the tokens sampled after
        each fed token confirm joins the output, then the sampled token after it; the KV fed for the rest is cut."""
        job, draft = slot.job, slot.draft
        assert draft is not None
        del job.pending[:1]
        if job.status is JobStatus.FINISHED:  # aborted while its step was in flight
            self._record(job.context_id, slot.start, 1, True)
            self._hand_over(job, None)
            return []
        sampled = slot.verified
        assert sampled is not None and len(sampled) == len(draft) + 1
        n = 0
        while n < len(draft) and sampled[n] == draft[n]:
            n += 1
        self.spec_steps += 1
        self.spec_draft_tokens += len(draft)
        self.spec_accepted_tokens += n
        confirmed, tried = self._acceptance.get(job.context_id, SPEC_PRIOR)  # a run of n confirmed, then a miss
        self._acceptance[job.context_id] = (SPEC_DECAY * confirmed + n, SPEC_DECAY * tried + n + (n < len(draft)))
        if self.kv.get(job.context_id).num_tokens > slot.start + 1 + n:
            self._truncate(job.context_id, slot.start + 1 + n)  # the rejected drafts' KV
        outputs = []
        logprobs = slot.verified_logprobs or [None] * len(sampled)
        # each fed already but the last, which is the job's next
        for i, (token, logprob) in enumerate(zip([*draft[:n], sampled[n]], logprobs, strict=False)):
            outputs.append(self._on_token(job, token, logprob, shadow=False))
            if job.status is JobStatus.FINISHED:
                break
            if job.forced and i < n:  # its grammar forces the tokens after this draft token (fast-forward): they
                self._truncate(job.context_id, slot.start + 1 + i)  # are fed with it next, as after a sampled one
                break
        self._record(job.context_id, slot.start, 1 + len(draft), True)  # its rows' places (the context's tokens)
        self._hand_over(job, None)  # a job that ended on a draft token drops the KV past its tokens
        return outputs

    def _hand_over(self, job: Job, feed: Slot | None) -> None:
        """After a step's tokens of a generate: a finished job drops the KV written past its tokens (by its
        ahead slot, or the rest of a multi-step plan); a running one hands its last token to the ahead slot
        that feeds it (`feed`)."""
        if job.status is JobStatus.FINISHED:
            n = len(self.tokens.get(job.context_id, ()))
            if job.context_id in self.kv and self.kv.get(job.context_id).num_tokens > n:
                self._truncate(job.context_id, n)
        elif feed is not None:
            feed.tokens[0] = job.pending[0]
            job.pending = []  # the ahead step feeds it

    def _score(self, job: Job, slot: Slot) -> None:
        """Keep the logprobs a step computed for a fill's tokens (by position: a preempted fill that feeds
        them again overwrites them)."""
        assert slot.targets is not None and slot.scores is not None and job.texts is not None
        for i, (target, score) in enumerate(zip(slot.targets, slot.scores, strict=True)):
            if score is not None and target >= 0:
                index = slot.start + 1 + i - job.base_len
                job.prompt_logprobs[index] = job.texts.logprob(target, score, job.fill_logprobs or 0)

    def _fill_logprobs(self, job: Job) -> list[TokenLogprob] | None:
        """A finished fill's logprobs, one per filled token (a context's first token has none)."""
        if job.fill_logprobs is None:
            return None
        assert job.texts is not None
        out = []
        for i, token in enumerate(job.fill_tokens):
            lp = job.prompt_logprobs.get(i)
            if lp is None:
                assert job.base_len + i == 0, f"fill token {i} of context {job.context_id!r} was not scored"
                lp = job.texts.unpredicted(token)
            out.append(lp)
        return out

    def _on_token(self, job: Job, token: int, logprob: SampledLogprob | None, shadow: bool = True) -> JobOutput:
        """Apply a generate's sampled token: its grammar advances (a rejected token fails the job alone), a
        stop token finishes it, otherwise the token joins the output. Then tokens its grammar forces join
        too (fast-forward, unless logprobs are asked for): they are fed as the decode rows of one step next."""
        sp = job.sampling
        assert sp is not None
        if shadow and self.draftable(job):
            self._shadow(job, token)
        out = JobOutput(job)
        try:
            if job.constraint is not None:
                job.constraint.consume(token)
            if token in job.stop_ids:
                named = token if token in job.named_stop_ids else None
                if named is not None and sp.include_stop_str_in_output:  # the token's text ends the output
                    self._append(job, out, token, logprob)
                return self._complete(out, "stop", named)
            reason = self._append(job, out, token, logprob)
            forced: list[int] = []
            if reason is None and job.constraint is not None and sp.logprobs is None:
                room = min(sp.max_tokens - len(job.output_ids), self.max_len - len(self.tokens[job.context_id]))
                for t in job.constraint.forced()[: max(room, 0)]:
                    if t in job.stop_ids:
                        break
                    job.constraint.consume(t)
                    forced.append(t)
                    reason = self._append(job, out, t, None)
                    if reason is not None:
                        break
        except ConstraintError as err:
            out.error = err
            self._fail(job, err)
            return out
        if reason is not None:
            return self._complete(out, reason)
        job.pending = [token, *forced]
        job.forced = bool(forced)
        if job.constraint is not None:
            job.run_tokens += 1
            if forced:
                _end_run(job)
        return out

    def _append(self, job: Job, out: JobOutput, token: int, logprob: SampledLogprob | None) -> str | None:
        """Add one token to a generate's output and context; returns why the job ends now, or None."""
        sp = job.sampling
        assert sp is not None
        ctx_tokens = self.tokens[job.context_id]
        job.output_ids.append(token)
        self.generated_tokens += 1
        ctx_tokens.append(token)  # in the context; its KV is written when it is fed (next step or job)
        delta, hit_stop = job.detok.add(token) if job.detok is not None else ("", False)
        lp = None
        if sp.logprobs is not None and logprob is not None and job.texts is not None:
            lp = job.texts.logprob(token, logprob, sp.logprobs)
            job.logprobs.append(lp)
        out.chunks.append(StreamChunk(token_id=token, text=delta, logprob=lp))
        if hit_stop or (job.constraint is not None and job.constraint.done):
            return "stop"
        if len(job.output_ids) >= sp.max_tokens or len(ctx_tokens) >= self.max_len:
            return "length"
        return None

    def _complete(self, out: JobOutput, reason: str, stop_token: int | None = None) -> JobOutput:
        """Finish a generate: a last chunk with the detokenizer's held-back text, the reason and what stopped it
        (`stop_token`: one of the request's stop_token_ids; else the stop string the text was cut at, if any)."""
        job = out.job
        job.finish_reason = reason
        self.finish(job)
        tail = job.detok.flush() if job.detok is not None else ""
        text = job.detok.text if job.detok is not None else ""
        stop_reason: int | str | None = None
        if reason == "stop":
            stop_reason = stop_token if stop_token is not None else job.detok.stop_hit if job.detok else None
        logprobs = kept = None
        if job.sampling.logprobs is not None:  # those of the tokens a stop string cut off are left out
            logprobs = list(job.logprobs)
            if job.detok is not None and job.detok.cut:
                logprobs = logprobs_within(logprobs, len(text))
                kept = len(logprobs)
        # the text is the grammar's whole output: the grammar may end there, and the text is that of the tokens it
        # took (a stop string kept with include_stop_str_in_output and nothing after it left out; a stop token's
        # text, one the grammar takes only where it may end, not kept)
        complete = None if job.constraint is None else job.constraint.complete and \
            (job.detok is None or job.detok.dropped == 0) and \
            not (stop_token is not None and job.sampling.include_stop_str_in_output)
        out.chunks.append(StreamChunk(text=tail, finish_reason=reason, stop_reason=stop_reason, logprobs_kept=kept,
                                      constraint_complete=complete))
        out.result = GenerateResponse(context_id=job.context_id, token_ids=list(job.output_ids), text=text,
                                      finish_reason=reason, stop_reason=stop_reason,
                                      num_tokens=len(self.tokens[job.context_id]), logprobs=logprobs,
                                      constraint_complete=complete)
        return out

    def fail_step(self, plan: StepPlan, err: BaseException) -> list[JobOutput]:
        """The runner could not execute `plan`: every job in it fails with `err`, its KV rolled back to
        before the step (a failed fill's tokens leave the context)."""
        outputs = list(plan.outputs)
        for slot in plan.slots:
            job = slot.job
            if job.status is JobStatus.FINISHED:
                continue  # already failed with the step before it (an ahead step), or aborted
            if job.context_id in self.kv and self.kv.get(job.context_id).num_tokens > slot.start:
                self._truncate(job.context_id, slot.start)
            outputs.extend(self._fail(job, err))
        return outputs

    def abort(self, context_id: str) -> list[JobOutput]:
        """Abort the queued and running jobs on `context_id` (not jobs that only fork from it). A fill's
        tokens leave the context; a generate's tokens so far stay in it. Returns their outputs."""
        victims = [j for j in self.waiting if j.context_id == context_id]
        if context_id in self.busy:
            victims.insert(0, self.busy[context_id])
        self.waiting = deque(j for j in self.waiting if j.context_id != context_id)
        self.aborts += len(victims)
        err = AbortedError(f"the primitive on context {context_id!r} was aborted")
        return [out for job in victims for out in self._fail(job, err)]

    def _fail(self, job: Job, err: BaseException) -> list[JobOutput]:
        """End `job` with `err` (a fill's tokens leave its context, a context it made is freed), and with it a
        failed fill's dependents."""
        if job.status is JobStatus.RUNNING:
            self.finish(job)
        job.status = JobStatus.FINISHED
        outputs = [JobOutput(job, error=err)]
        if job.kind is JobKind.FILL:
            outputs.extend(self._fail_dependents(job, err))
        if job.created and job.context_id in self.kv and not self.referenced(job.context_id):
            self.free_context(job.context_id)  # a context the fill made goes with it: its client never had it
        else:
            self.roll_back(job)
        return outputs

    def _fail_dependents(self, failed: Job, err: BaseException) -> list[JobOutput]:
        """A fill failed, its tokens gone: the queued primitives sent after it on its context, or forking it,
        counted on them, and fail too (as do, in turn, those counting on the contexts they would have made);
        run, they would have continued or forked the context without the fill's tokens. Each gets an error of
        the fill's kind (e.g. a full KV cache: retry) saying why."""
        outputs: list[JobOutput] = []
        lost = {failed.context_id}
        kept: deque[Job] = deque()
        for job in self.waiting:  # in queue order: a dependent's own dependents come after it
            if job.queued > failed.queued and (job.context_id in lost or job.parent_context_id in lost):
                how = "continues" if job.context_id in lost else "forks"
                lost.add(job.context_id)
                job.status = JobStatus.FINISHED
                msg = (f"the fill of context {failed.context_id!r} failed, and this primitive, sent after it, "
                       f"{how} a context counting on it: {err}")
                outputs.append(JobOutput(job, error=error_for_code(code_of(err), msg)))
            else:
                kept.append(job)
        self.waiting = kept
        return outputs

    def _truncate(self, context_id: str, n: int) -> None:
        copy = self.kv.truncate(context_id, n)
        if copy is not None:
            self._copies.append(copy)

    def _room(self, context_id: str) -> int:
        """Tokens the context can grow by with the free pages."""
        ctx = self.kv.get(context_id)
        tail = (-ctx.num_tokens) % self.kv.page_size
        return tail + self.kv.num_free_pages * self.kv.page_size

    def _make_room(self, job: Job, n: int, scheduled: set[int], plan: StepPlan) -> bool:
        """Free pages for `n` more tokens of `job` by preempting the newest running job not already
        in this step (vLLM's policy; that may be `job` itself: then False; among jobs of one arrival, the
        last taken, so the same one yields each time rather than each in turn). A job alone in the engine
        that still cannot fit fails with an explicit error instead of waiting forever."""
        while not self.kv.can_extend(job.context_id, n):
            if self._evict_idle():
                continue
            candidates = [j for j in self.running if j.job_id not in scheduled]
            if len(candidates) > 1:
                victim = max(candidates, key=lambda j: j.order)
                self._preempt(victim)
                if victim is job:
                    return False
                continue
            if scheduled:
                self._preempt(job)  # the jobs already in this step will finish and free pages
                return False
            err = OutOfPages(self.kv.pages_needed(job.context_id, n), self.kv.num_free_pages,
                             f"continue context {job.context_id!r}: the rest of the pool is held by "
                             f"{len(self.kv) - 1} other context(s); free contexts or raise kv_memory_mb")
            plan.outputs.extend(self._fail(job, err))
            return False
        return True

    def _evict_idle(self, keep: str | None = None) -> bool:
        """Free a page by dropping idle contexts' KV (other than `keep`'s; their tokens stay: the next
        primitive on one, or on a fork of it, recomputes them): the least recently used idle context that owns
        a page alone; failing that, the idle contexts sharing a page no other context holds (a prefix and a
        fork of it ending on the same page boundary, say), those least recently used first. False if none."""
        idle = sorted((c for c in self.kv if c not in self.busy and c != keep and self.kv.get(c).num_tokens),
                      key=lambda c: self.last_used.get(c, 0.0))
        for ctx_id in idle:
            if any(self.kv.refcount(p) == 1 for p in self.kv.get(ctx_id).pages):
                self.kv.truncate(ctx_id, 0)
                self.evictions += 1
                return True
        rank = {c: i for i, c in enumerate(idle)}
        holders: dict[int, list[str]] = {}
        for ctx_id in self.kv:
            for p in self.kv.get(ctx_id).pages:
                holders.setdefault(p, []).append(ctx_id)
        group = min((h for h in holders.values() if all(c in rank for c in h)),
                    key=lambda h: max(rank[c] for c in h), default=None)
        if group is None:
            return False
        for ctx_id in group:
            self.kv.truncate(ctx_id, 0)
            self.evictions += 1
        return True

    def _drop_partial_page(self, context_id: str) -> None:
        """Drop the KV of an idle context's tokens on its partial last page, if no other context holds that page
        (the tokens stay, recomputed by whatever uses them next): a fork of a prompt that fills the pool to its
        last page then has a page for them, instead of none to copy them into."""
        ctx = self.kv.get(context_id)
        cut = ctx.num_tokens - ctx.num_tokens % self.kv.page_size
        if cut < ctx.num_tokens and self.kv.refcount(ctx.pages[-1]) == 1:
            self._truncate(context_id, cut)
            self.evictions += 1

    def _preempt(self, job: Job) -> None:
        """Drop the job's private KV (recomputed when it runs again) and requeue it by arrival."""
        ctx = self.kv.get(job.context_id)
        self.kv.truncate(job.context_id, ctx.num_shared_tokens)
        job.pending = self.tokens[job.context_id][ctx.num_tokens :]
        job.forced = False
        job.status = JobStatus.WAITING
        job.preemptions += 1
        self.preemptions += 1
        self.running.remove(job)
        del self.busy[job.context_id]
        self.waiting.append(job)
        self.waiting = deque(sorted(self.waiting, key=lambda j: j.order))

    # ---- admission ----------------------------------------------------------------------------
    def _startable(self, jobs: list[Job]) -> Iterator[Job]:
        """`jobs` in their order, leaving out those that wait for work on their context anyway (or on their parent's,
        running or queued first) and later ones on a context already yielded: the jobs a freed slot would start."""
        taken: set[str] = set()
        first: dict[str, int] = {}  # each context's first waiting job, as taken (a fork waits for one on its parent)
        for job in self.waiting:
            first[job.context_id] = min(first.get(job.context_id, job.queued), job.queued)
        for job in jobs:
            parent = job.parent_context_id
            if (job.context_id in self.busy or job.context_id in taken or parent in self.busy or parent in taken
                    or (parent is not None and first.get(parent, job.queued) < job.queued)):
                continue
            taken.add(job.context_id)
            yield job

    def _yield_to_priority(self) -> None:
        """Priority preemption (as vLLM's priority scheduling): with the batch full, a waiting job that only the
        batch size keeps out takes the place of a running job of a larger priority number (the least urgent, the
        newest of those), which is preempted: its KV is dropped and recomputed when it runs again, so its output is
        the same. A chat arriving while a batch job fills the batch runs at once instead of after a batch job's
        whole generation."""
        room = self.cfg.max_batch_size - len(self.running) - len(self.kept)  # a kept slot is its follower's
        if not self.waiting or self.waiting[0].priority >= max((j.priority for j in self.running), default=0):
            return
        for job in self._startable(list(self.waiting)):  # most urgent first
            if self._takes_kept(job):
                continue  # the slot kept for it
            if room > 0:
                room -= 1
                continue
            victims = [j for j in self.running if j.priority > job.priority and j.status is JobStatus.RUNNING]
            if not victims:
                return  # the rest are no more urgent than any running job
            self._preempt(max(victims, key=lambda j: j.order))
            self.priority_preemptions += 1

    def _clients(self) -> Counter[str | None] | None:
        """Running jobs per client, where several clients have work running or waiting (else None)."""
        if not self.waiting:
            return None
        first = self.waiting[0].client
        if all(j.client == first for j in itertools.chain(self.waiting, self.running)):
            return None
        running: Counter[str | None] = Counter(j.client for j in self.running)
        for job in self.waiting:
            running.setdefault(job.client, 0)
        return running

    def _in_turns(self) -> list[Job] | None:
        """The waiting jobs in the order `_admit` takes them where several clients have work (None: one client, the
        queue's order): by priority, then each client's jobs take turns (a job's turn is how many requests of its
        client run or wait before it, each client's own order kept), then queue order. A request is a chain of
        primitives: on one context, or on contexts forking the one before (a prompt's pieces, then its generate)."""
        running = self._clients()
        if running is None:
            return None
        turns = running.copy()
        owner: dict[str, str | None] = {j.context_id: j.client for j in self.running}  # context -> its client
        keyed = []
        for job in self.waiting:
            keyed.append((job.priority, turns[job.client], job.order, job))
            if job.client not in (owner.get(job.context_id, ""), owner.get(job.parent_context_id or "", "")):
                turns[job.client] += 1  # a new request (not its client's context, nor forking one)
            owner[job.context_id] = job.client
        keyed.sort(key=lambda k: k[:3])
        return [k[3] for k in keyed]

    def _within_share(self, job: Job) -> bool:
        """Whether running `job` is within its client's share of the batch while another client's work waits (the
        slot of its prompt is then kept for its next primitive, as an urgent prompt's is: `_keep_slot`)."""
        running = self._clients()
        if running is None or not any(w.client != job.client for w in self.waiting):
            return False
        return running[job.client] <= self._share(len(running))

    def _share(self, clients: int) -> int:
        """Each client's share of a full batch: its size over the clients with work running or waiting."""
        return max(1, self.cfg.max_batch_size // clients)

    def _over_share(self) -> tuple[Counter[str | None], int] | None:
        """(running jobs per client, the share) where `_yield_to_fair_share` may preempt now: a full batch, a client
        running above its share, and one below it with a job that could start (not waiting for work on its context
        or its parent's). Else None."""
        if len(self.running) + len(self.kept) < self.cfg.max_batch_size:
            return None
        running = self._clients()
        if running is None:
            return None
        share = self._share(len(running))
        if not any(n > share for n in running.values()):
            return None
        if not any(running[j.client] < share for j in self._startable(list(self.waiting))):
            return None
        return running, share

    def _yield_to_fair_share(self) -> None:
        """Fair share between clients (`Job.client`): with the batch full, a waiting job whose client runs fewer jobs
        than its share (the batch size over the clients with work running or waiting) takes the place of a running
        job, no more urgent than it, of the client furthest above its share (its newest), which is preempted: its KV
        is dropped and recomputed when it runs again, so its output is the same. `_in_turns` then admits it first.
        A client that floods the engine runs its share; another's request does not wait for its whole first wave."""
        due = self._over_share()
        if due is None:
            return
        running, share = due
        for job in self._startable(self._in_turns() or []):
            if running[job.client] >= share or self._takes_kept(job):
                continue
            victims = [j for j in self.running if running[j.client] > share and j.priority >= job.priority
                       and j.status is JobStatus.RUNNING]
            if not victims:
                continue
            most = max(running[j.client] for j in victims)
            victim = max((j for j in victims if running[j.client] == most), key=lambda j: j.order)
            self._preempt(victim)
            running[victim.client] -= 1
            running[job.client] += 1
            self.fair_preemptions += 1

    def _admit(self, plan: StepPlan) -> None:
        """Move waiting jobs whose context (and parent) are idle into running, setting up contexts (a full batch
        first makes room for more urgent work: `_yield_to_priority`; a slot kept for the primitive after an
        urgent prompt is that primitive's: `_keep_slot`)."""
        self._let_go()
        self._yield_to_priority()
        self._yield_to_fair_share()
        blocked: set[str] = set()
        kept: deque[Job] = deque()
        first: dict[str, int] = {}  # each context's first job still waiting, as taken (`Job.queued`)
        for job in self.waiting:
            first[job.context_id] = min(first.get(job.context_id, job.queued), job.queued)
        turns = self._in_turns()
        reordered = turns is not None
        self.waiting = deque(turns) if reordered else self.waiting
        while self.waiting:
            job = self.waiting.popleft()
            ctx_id, parent = job.context_id, job.parent_context_id
            new_ctx = ctx_id not in self.kv
            # a fork waits for the work on its parent sent before it (a fill preempted and queued again may
            # stand behind it: forking then would copy tokens whose KV no step has computed)
            parent_busy = new_ctx and parent is not None and (parent in self.busy or parent in blocked
                                                              or first.get(parent, job.queued) < job.queued)
            others = len(self.kept) - self._takes_kept(job)  # slots kept for other jobs
            if (ctx_id in self.busy or ctx_id in blocked or parent_busy
                    or len(self.running) + others >= self.cfg.max_batch_size):
                blocked.add(ctx_id)  # later jobs on this context keep their order
                kept.append(job)
                continue
            if first[ctx_id] < job.queued:  # a job on this context taken before it waits behind it: it goes first
                kept.append(job)
                continue
            try:
                self._setup(job, plan)
            except OutOfPages as err:
                if self.running:  # a fork needs a page for its parent's partial tail: wait for one
                    blocked.add(ctx_id)
                    kept.append(job)
                else:
                    plan.outputs.extend(self._fail(job, err))
                continue
            except ParrotError as err:
                plan.outputs.extend(self._fail(job, err))
                continue
            job.status = JobStatus.RUNNING
            self.running.append(job)
            self.busy[ctx_id] = job
            self._take_kept(job)
        self.waiting = deque(sorted(kept, key=lambda j: j.order)) if reordered else kept

    def _setup(self, job: Job, plan: StepPlan) -> None:
        ctx_id, parent = job.context_id, job.parent_context_id
        resumed = job.preemptions > 0  # context and tokens already set up; KV partly dropped
        created = not resumed and ctx_id not in self.kv
        if not created:
            held = len(self.tokens[ctx_id])
        elif parent is not None:
            if parent not in self.kv:
                raise NotFoundError(f"parent context {parent!r} does not exist")
            held = len(self.tokens[parent]) if job.parent_num_tokens is None else job.parent_num_tokens
            if held > len(self.tokens[parent]):
                raise InvalidRequestError(f"parent_num_tokens {held} exceeds the {len(self.tokens[parent])} tokens "
                                          f"of parent context {parent!r}")
        elif job.kind is JobKind.FILL:
            held = 0
        else:
            raise NotFoundError(f"context {ctx_id!r} does not exist (and no parent_context_id to fork)")
        if not resumed:  # what the job makes of the context must fit the model and the pool (checked before a fork)
            if job.kind is JobKind.GENERATE and not held:
                raise InvalidRequestError(f"context {ctx_id!r} is empty: fill it before generating")
            extra = len(job.fill_tokens) if job.kind is JobKind.FILL else job.sampling.max_tokens
            if held + extra > self.max_len:
                what = "fill" if job.kind is JobKind.FILL else "max_tokens"
                raise InvalidRequestError(
                    f"context {ctx_id!r} would exceed the model's maximum length {self.max_len}: it holds "
                    f"{held} tokens, {what} adds {extra}")
            if self.kv.pages_for(held + extra) > self.kv.total_pages:
                raise InvalidRequestError(
                    f"context {ctx_id!r} needs {held + extra} tokens of KV; the whole cache holds "
                    f"{self.kv.total_pages * self.kv.page_size}")
        if created and parent is not None:
            while not self.kv.num_free_pages and self._evict_idle(keep=parent):
                pass  # the fork copies the parent's partial last page into a free page
            if not self.kv.num_free_pages and parent not in self.busy:
                self._drop_partial_page(parent)  # or recomputes those tokens: the parent's tail page is the room
            copy = self.kv.fork(ctx_id, parent, held)
            if copy is not None:
                plan.copies.append(copy)
            self.tokens[ctx_id] = list(self.tokens[parent][:held])
            self.row_fed[ctx_id] = self.row_fed[parent][:held]
        elif created:
            self.kv.create(ctx_id)
            self.tokens[ctx_id] = []
            self.row_fed[ctx_id] = bytearray()
        tokens = self.tokens[ctx_id]
        job.context_tokens = tokens
        if job.kind is JobKind.FILL and not resumed:
            job.base_len = len(tokens)
            job.created = created
            tokens.extend(job.fill_tokens)
        kv_len = self.kv.get(ctx_id).num_tokens
        job.pending = tokens[kv_len:]
        fed = self.row_fed.setdefault(ctx_id, bytearray())
        if job.kind is JobKind.FILL and job.fill_logprobs is not None:
            # the first filled token's logprob needs the logits of the token before it: feed that one again, in
            # the fill's chunk (and so where the context's KV is recomputed)
            if 0 < job.base_len <= len(fed):
                fed[job.base_len - 1] = 0
            if 0 < kv_len == job.base_len:
                copy = self.kv.truncate(ctx_id, kv_len - 1)
                if copy is not None:
                    plan.copies.append(copy)
                job.pending = tokens[kv_len - 1 :]
        if job.kind is JobKind.GENERATE and not resumed:
            if len(fed) >= len(tokens):
                fed[len(tokens) - 1] = 1  # a decode row feeds the last token (again, below) for its logits
        if job.kind is JobKind.GENERATE and not job.pending:
            copy = self.kv.truncate(ctx_id, kv_len - 1)  # re-feed the last token for its logits
            if copy is not None:
                plan.copies.append(copy)
            job.pending = tokens[-1:]

    def roll_back(self, job: Job) -> None:
        """Undo a failed fill: its tokens leave the context (KV and token list)."""
        if job.kind is not JobKind.FILL or job.base_len < 0 or job.context_id not in self.kv:
            return
        if self.kv.get(job.context_id).num_tokens > job.base_len:
            self._truncate(job.context_id, job.base_len)
        del self.tokens[job.context_id][job.base_len :]
        del self.row_fed.setdefault(job.context_id, bytearray())[job.base_len :]

    def free_context(self, context_id: str) -> int:
        self.kept.pop(context_id, None)
        if self.drafter is not None:
            self.drafter.forget(context_id)
        freed = self.kv.free(context_id)
        del self.tokens[context_id]
        self.row_fed.pop(context_id, None)
        self.last_used.pop(context_id, None)
        return freed
