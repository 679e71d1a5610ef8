"""LLMEngine: Fill / Generate / FreeContext / Ping on forkable paged contexts, one step loop.

The step loop runs in its own thread (JAX calls block); callers submit primitives from any thread or
from asyncio and get results through callbacks, futures or async iterators. All scheduler and KV
state is touched only by the loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine import kernels
from parrot.engine.device import auto_decode_bursts, device_memory, for_device
from parrot.engine.kv_cache import KVCacheManager
from parrot.engine.loader import LoadedModel
from parrot.engine.logprobs import TokenTexts
from parrot.engine.multihost import Mirror
from parrot.engine.runner import Launched, ModelRunner
from parrot.engine.sampling import SamplingParams, check_sampling
from parrot.engine.scheduler import (
    AUTO_THROUGHPUT_HOLD_MS,
    SPEC_COSTS_ACCELERATOR,
    SPEC_COSTS_CPU,
    Scheduler,
    StepPlan,
)
from parrot.engine.sequence import Job, JobKind, JobOutput
from parrot.engine.step_trace import StepTrace
from parrot.engine.structured import Constraint, Grammars
from parrot.engine.tokenizer import IncrementalDetokenizer
from parrot.errors import (
    ConflictError,
    EngineUnavailableError,
    GenerationFailedError,
    InvalidRequestError,
    NotFoundError,
    ParrotError,
)
from parrot.protocol import (
    FillRequest,
    FillResponse,
    FreeContextResponse,
    GenerateRequest,
    GenerateResponse,
    RuntimeInfo,
    StreamChunk,
)

log = logging.getLogger(__name__)
COMPILE_JOIN_S = 120.0  # at shutdown, how long to wait for the compiles under way (one shape each)
RELEASE_MIN_PAGES = 16  # free written KV pages worth giving back to the OS (idle engine)
RELEASE_CHUNK_PAGES = 128  # given back in one call, ~5-10 ms on a CPU: work that arrives waits for one call at most


class EngineDeadError(ParrotError):
    """The engine loop stopped (shut down or crashed); nothing more will run."""

    code = EngineUnavailableError.code


@dataclass
class Completion:
    """A whole prompt run through `LLMEngine.complete`, with its timings."""

    response: GenerateResponse
    prompt_tokens: int
    ttft_s: float  # submit to first sampled token
    total_s: float


class LLMEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig | None = None, name: str | None = None,
                 runner: ModelRunner | None = None, mirror: Mirror | None = None) -> None:
        """`mirror`: process 0 of an engine over several processes (multihost.py) sends its runner's device
        operations to the other processes through it."""
        self.cfg = runner.ecfg if runner is not None else for_device(cfg or EngineConfig())
        self.model = dataclasses.replace(model, weights={})  # the runner holds the weights: not twice
        self.name = name or model.source
        self.tokenizer = model.tokenizer
        self.runner = runner or ModelRunner(model.config, model.weights, self.cfg)
        self.runner.mirror = mirror
        procinfo.release_free_memory()  # the host copies made while building the weights
        self.kv = KVCacheManager(self.runner.num_pages, self.runner.page_size)
        pool_tokens = self.kv.total_pages * self.kv.page_size
        if pool_tokens < self.runner.seq_limit:
            log.warning("the KV cache holds %d tokens, fewer than the model's context of %d: longer sequences are "
                        "refused (raise --kv-memory-mb, or lower --max-model-len to match)", pool_tokens,
                        self.runner.seq_limit)
        bursts = self.cfg.decode_bursts  # unset: on where the runner decodes several steps a call
        if bursts is None:
            bursts = auto_decode_bursts(self.cfg) if self.runner.multi_step > 1 else 0
        hold = self.cfg.throughput_hold_ms  # unset: on where decode bursts run
        if hold is None:
            hold = AUTO_THROUGHPUT_HOLD_MS if bursts else 0
        self.scheduler = Scheduler(self.kv, self.cfg, self.runner.seq_limit,
                                   attention_in_place=self.runner.prefill_in_place, decode_bursts=bursts,
                                   throughput_hold_ms=hold,
                                   spec_costs=SPEC_COSTS_CPU if device_memory().platform == "cpu"
                                   else SPEC_COSTS_ACCELERATOR,
                                   lazy_constraints=self.runner.lazy_masks)
        if self.runner.mirror is not None or self.runner.following:
            self.scheduler.drafter = None  # a verify step's rows are sampled on one process's device
        self.trace = StepTrace()  # PARROT_STEP_TRACE: one line per step (step_trace.py)
        self.vocab_size = model.config.vocab_size
        self.grammars = Grammars(self.tokenizer, self.vocab_size)
        self.token_texts = TokenTexts(self.tokenizer)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead: BaseException | None = None
        self._closed = False  # the loop has ended: nothing more may enter its inbox (`_call`)
        self._inbox_lock = threading.Lock()
        self._applying: list[Job] = []  # the jobs of the step being applied: a crash there still answers them
        self._rng = np.random.default_rng(self.cfg.seed)  # the seeds of requests that give none
        self.steps = 0
        self.warmup_s: float | None = None  # start() to every shape compiled
        self.warm_process_uptime_s: float | None = None
        self._step_ms: collections.deque[float] = collections.deque(maxlen=32)
        # host time per step: the loop's own work (scheduling, batch building, applying tokens, streaming),
        # outside JAX's dispatch and waits (`ModelRunner.dispatch_s`, `wait_s`)
        self._host_ms: collections.deque[float] = collections.deque(maxlen=256)
        self._idle_since: float | None = None  # when the loop last found nothing to do (None: busy since)
        self.released_pages = 0  # KV pages given back to the OS (`_release_idle_pages`)
        self._releasing: tuple[int, float, int] | None = None  # pages, seconds and calls of the giving back under way
        self._inflight: tuple[StepPlan, Launched] | None = None  # a launched step not applied yet
        self.ahead_steps = 0  # steps launched before the previous step's tokens were read (overlap)
        self._settings: dict[str, object] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, precompile: bool | None = None, wait: bool = True) -> LLMEngine:
        """Start the step loop. With precompile (default: `cfg.precompile`) every serving shape is
        compiled first; `wait=False` serves at once while shapes compile in the background, smallest
        first (a step waits for its shape; `ping()` reports the progress)."""
        t0 = time.monotonic()
        if precompile if precompile is not None else self.cfg.precompile:
            self.runner.precompile(wait=wait, progress=wait)
            threading.Thread(target=self._log_warm, args=(t0,), name="parrot-warmup", daemon=True).start()
        else:
            self.warmup_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="parrot-engine", daemon=True)
        self._thread.start()
        return self

    def _log_warm(self, t0: float) -> None:
        try:
            self.runner.compiler.wait()
        except Exception:
            return  # logged by the compiler; the step that needs the shape reports it
        if self._stop:  # shut down while compiling (the queue was dropped): nothing was warmed
            return
        warmup_s, uptime_s = time.monotonic() - t0, procinfo.uptime_s()
        frozen = procinfo.freeze_heap() if self.cfg.gc_freeze else 0
        self.warmup_s, self.warm_process_uptime_s = warmup_s, uptime_s  # warm (and frozen) from here
        procinfo.release_free_memory()
        rss = procinfo.rss_bytes()
        log.info("engine %s warm: %d shapes compiled in %.1f s (process up %.1f s), resident memory %.2f GB%s",
                 self.name, self.runner.compile_status()[1], self.warmup_s, self.warm_process_uptime_s or -1,
                 (rss or 0) / 1e9, f", {frozen} objects frozen for the garbage collector" if frozen else "")

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self.runner.compiler.cancel()  # shapes still queued are not compiled any more
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self.runner.compiler.join(timeout=COMPILE_JOIN_S):  # those under way finish first
            log.warning("a shape was still compiling %.0f s after the engine shut down", COMPILE_JOIN_S)
        self.runner.close()  # the other processes of a multi-process engine stop too
        self.trace.close()

    # ---- submitting (any thread) --------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job; its callbacks run on the engine thread."""
        if self._thread is None or self._dead is not None or self._stop:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'not started or shut down'})")
        if job.kind is JobKind.FILL:
            bad = [t for t in job.fill_tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
            if not job.fill_tokens:
                raise InvalidRequestError("a fill needs at least one token")
            if job.fill_logprobs is not None:
                job.texts = self.token_texts
        else:
            assert job.sampling is not None
            check_sampling(job.sampling, self.vocab_size)
            if job.sampling.constraint is not None and job.constraint is None:
                job.constraint = self.grammars.compile(job.sampling)
            if job.sampling.logprobs is not None:
                job.texts = self.token_texts
            if job.sampling.seed is None:
                job.sampling = job.sampling.model_copy(update={"seed": int(self._rng.integers(2**31))})
            stops = set(job.sampling.stop_token_ids)
            job.named_stop_ids = frozenset(stops)
            if not job.sampling.ignore_eos:
                stops |= self.tokenizer.stop_token_ids
                job.named_stop_ids -= self.tokenizer.stop_token_ids
            job.stop_ids = frozenset(stops)
            job.detok = IncrementalDetokenizer(self.tokenizer, job.sampling.stop, job.sampling.min_tokens,
                                               job.sampling.include_stop_str_in_output)
        self._call(lambda: self.scheduler.add(job))

    def _call(self, fn: Callable[[], None]) -> None:
        with self._inbox_lock:  # against the loop's last drain: what comes after it would never run
            if self._closed:
                raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")
            self._inbox.put(fn)
        self._wake.set()

    def fill_future(self, req: FillRequest) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        job = Job(JobKind.FILL, req.context_id, req.parent_context_id, fill_tokens=list(req.token_ids),
                  parent_num_tokens=req.parent_num_tokens, fill_logprobs=req.logprobs,
                  on_done=_resolver(fut), arrival=time.monotonic() - req.waited_s, priority=req.priority,
                  client=req.client)
        self.submit(job)
        return fut

    def generate_future(self, req: GenerateRequest, on_chunk: Callable[[StreamChunk], None] | None = None,
                        constraint: Constraint | None = None) -> concurrent.futures.Future:
        """Submit a Generate. Its constraint (if any) is compiled here, blocking this thread, unless passed in
        already compiled (`compile_constraint`): async callers compile off their event loop first."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        job = Job(JobKind.GENERATE, req.context_id, req.parent_context_id, sampling=req.sampling,
                  parent_num_tokens=req.parent_num_tokens,
                  on_chunk=on_chunk, on_done=_resolver(fut), arrival=time.monotonic() - req.waited_s,
                  priority=req.priority, client=req.client, constraint=constraint)
        self.submit(job)
        return fut

    async def compile_constraint(self, req: GenerateRequest) -> Constraint | None:
        """The request's constraint compiled in a worker thread (None without one): invalid, unsupported or
        too slow to compile raises InvalidRequestError, before any engine work."""
        if req.sampling.constraint is None:
            return None
        check_sampling(req.sampling, self.vocab_size)
        return await asyncio.to_thread(self.grammars.compile, req.sampling)

    def free_future(self, context_id: str) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def do() -> None:
            try:
                if self.scheduler.referenced(context_id):
                    raise ConflictError(f"context {context_id!r} is in use by a running or queued primitive")
                freed = self.scheduler.free_context(context_id) if context_id in self.kv else None
                if freed is None:
                    raise NotFoundError(f"context {context_id!r} does not exist")
                _settle(fut, FreeContextResponse(context_id=context_id, freed_pages=freed))
            except ParrotError as exc:
                _settle(fut, None, exc)

        if self._thread is None or self._dead is not None or self._stop:
            raise EngineDeadError("the engine is not running")
        self._call(do)
        return fut

    def abort_future(self, context_id: str) -> concurrent.futures.Future:
        """Abort the queued and running primitives on `context_id` before their next step; they fail
        with AbortedError. The future's result: whether any primitive was aborted."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def do() -> None:
            outputs = self.scheduler.abort(context_id)
            self._deliver(outputs)
            _settle(fut, bool(outputs))

        if self._thread is None or self._dead is not None or self._stop:
            raise EngineDeadError("the engine is not running")
        self._call(do)
        return fut

    def complete(self, prompt_ids: list[int], sampling: SamplingParams, timeout: float | None = None) -> Completion:
        """Run one prompt to completion on a fresh context (freed afterwards), blocking: the one-shot path
        of `parrot generate`, the reference tests and the benchmarks, on the same loop as serving."""
        ctx = f"complete-{uuid.uuid4().hex}"
        first: list[float] = []
        t0 = time.perf_counter()
        fill = self.fill_future(FillRequest(context_id=ctx, token_ids=prompt_ids))
        gen = self.generate_future(GenerateRequest(context_id=ctx, sampling=sampling),
                                   on_chunk=lambda c: first or first.append(time.perf_counter()))
        try:
            fill.result(timeout)
            response = gen.result(timeout)
        finally:
            if fill.done() and fill.exception() is None:
                gen.exception(timeout)  # the context is referenced until the generate is done
                self.free_future(ctx).result(timeout)
        t1 = time.perf_counter()
        return Completion(response, len(prompt_ids), (first[0] if first else t1) - t0, t1 - t0)

    # ---- asyncio front -------------------------------------------------------------------------
    async def fill(self, req: FillRequest) -> FillResponse:
        return await asyncio.wrap_future(self.fill_future(req))

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        constraint = await self.compile_constraint(req)
        return await asyncio.wrap_future(self.generate_future(req, constraint=constraint))

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamChunk | BaseException | None] = asyncio.Queue()
        constraint = await self.compile_constraint(req)

        def put(item: StreamChunk | BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the reader's loop closed (a server stopped at once): no reader
                loop.call_soon_threadsafe(q.put_nowait, item)

        fut = self.generate_future(req, on_chunk=put, constraint=constraint)
        fut.add_done_callback(lambda f: put(f.exception() if f.exception() else None))
        while True:
            item = await q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def free_context(self, context_id: str) -> FreeContextResponse:
        return await asyncio.wrap_future(self.free_future(context_id))

    async def abort(self, context_id: str) -> bool:
        return await asyncio.wrap_future(self.abort_future(context_id))

    def ping(self) -> RuntimeInfo:
        s = self.scheduler
        compiled, total = self.runner.compile_status()
        return RuntimeInfo(
            model=self.name, max_context_len=self.runner.seq_limit, page_size=self.kv.page_size,
            total_pages=self.kv.total_pages, free_pages=self.kv.num_free_pages,
            written_pages=self.kv.num_written_pages, released_pages=self.released_pages, num_contexts=len(self.kv),
            num_cached_tokens=self.kv.num_cached_tokens, running=len(s.running), waiting=len(s.waiting),
            recent_step_ms=float(np.median(self._step_ms)) if self._step_ms else 0.0, steps=self.steps,
            prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens,
            recent_host_ms=float(np.median(self._host_ms)) if self._host_ms else 0.0, ahead_steps=self.ahead_steps,
            overlap=self.cfg.overlap, settings=self.settings(),
            shape_misses=self.runner.shape_misses, preemptions=s.preemptions,
            priority_preemptions=s.priority_preemptions, fair_preemptions=s.fair_preemptions,
            kept_slots=s.kept_slots, evictions=s.evictions,
            cascade_steps=self.runner.cascade_steps, mixed_steps=self.runner.mixed_steps, aborts=s.aborts,
            multi_step_launches=self.runner.multi_step_launches, decode_bursts=s.decode_bursts,
            held_steps=s.held_steps,
            max_batch_size=self.cfg.max_batch_size,
            compiled_shapes=compiled, total_shapes=total, warmup_s=self.warmup_s,
            process_uptime_s=self.warm_process_uptime_s, rss_bytes=procinfo.rss_bytes(),
            constrained_steps=self.grammars.masked_steps, fast_forward_tokens=s.fast_forward_tokens,
            spec_steps=s.spec_steps, spec_draft_tokens=s.spec_draft_tokens,
            spec_accepted_tokens=s.spec_accepted_tokens,
            unmasked_tokens=self.grammars.unmasked_tokens + s.unchecked_tokens, refused_tokens=s.unchecked_refusals,
            walked_tokens=self.grammars.walked_tokens,
            **self.grammars.mask_stats(),
        )

    def settings(self) -> dict[str, object]:
        """What this engine runs with on its device (for /health and /metrics); fixed at construction."""
        if self._settings is None:
            self._settings = self._device_settings()
        return self._settings

    def _device_settings(self) -> dict[str, object]:
        r, c = self.runner, self.cfg
        dev = device_memory()
        return {"platform": dev.platform, "device": dev.kind,
                "weights": r.weights_mode, "dtype": str(r.dtype), "kv_dtype": r.kv_dtype_name,
                "kv_pages": self.kv.total_pages, "kv_bytes": r.kv_bytes or None, "page_size": c.page_size,
                "kv_release_idle_s": c.kv_release_idle_s if r.lazy_pool else None,
                "memory_utilization": c.memory_utilization, "max_batch_size": c.max_batch_size,
                "max_num_batched_tokens": c.max_num_batched_tokens, "bs_buckets": list(c.bs_buckets),
                "prefill_bs_buckets": list(c.prefill_bs_buckets),
                "token_buckets": list(c.token_buckets), "kv_buckets": list(r.shapes.kv_buckets), "overlap": c.overlap,
                "multi_step": r.multi_step, "multi_step_max_batch": r.multi_max_batch if r.multi_step > 1 else None,
                "decode_bursts": self.scheduler.burst_tokens,
                "speculative_tokens": c.speculative_tokens if self.scheduler.drafter is not None else 0,
                "speculative_ngram": [c.speculative_min_ngram, c.speculative_ngram],
                "throughput_hold_ms": round(self.scheduler.hold_s * 1000), "gc_freeze": c.gc_freeze,
                "priority_handoff_ms": c.priority_handoff_ms,
                "native_kernels": kernels.available(), "cpu_matmul": kernels.matmul_path(),
                "prefill_dtype": str(r.prefill_dtype), "generated_row_limbs": r.generated_row_limbs,
                "bf16_tiles": kernels.bf16_tiles(),
                "bf16_fills": r.bf16_fills, "mixed_steps": r.mixed,
                "decode_attention_bf16": r.decode_attention_bf16,
                "decode_attention": r.decode_attention,
                # which sampler parts run: named by the host (accelerators: no branch on the device) or branched
                "sampler_parts": "named" if r.host_stages else "device",
                "prefill_attention": "in place" if r.prefill_in_place else "gathered",
                "prefill_tokens_beside_decodes": c.prefill_tokens_beside_decodes,
                "prefill_tokens_beside_latency": c.prefill_tokens_beside_latency,
                "tensor_parallel_size": r.tp,
                "tensor_parallel_mode": ("exact" if r.tp_exact else "megatron") if r.tp > 1 else None}

    @property
    def death_reason(self) -> str | None:
        """Why the loop is not running (None while it runs)."""
        if self.alive:
            return None
        return str(self._dead) if self._dead is not None else "not started, or shut down"

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    # ---- the loop (engine thread) ---------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain()
                busy = self.scheduler.has_work() or self._inflight is not None
                self.runner.compiler.serving(busy)  # background compiling yields the cores to steps
                if not busy:  # nothing to do, or waiting work held back by a kept slot until it is let go
                    if self._release_idle_pages():
                        continue  # more pages to give back: new work first
                    self._wake.wait(timeout=self.scheduler.wake_in())
                    self._wake.clear()
                    continue
                self._idle_since = None
                self._releasing = None
                self.step()
        except BaseException as exc:  # a crash must not leave callers waiting forever
            self._dead = exc  # first: a submit that checks it now is refused
            log.exception("engine loop crashed")
        finally:
            with self._inbox_lock:
                self._closed = True
            while True:  # what was queued before the close runs; one that raises must not skip the rest
                try:
                    self._drain()
                    break
                except Exception:
                    log.exception("a queued call failed as the engine stopped")
            err = EngineDeadError(f"the engine stopped ({self._dead or 'shut down'})")
            s = self.scheduler
            for job in [*self._applying, *s.running, *s.waiting]:  # each answered once (`_finish`)
                _finish(job, None, err)
            s.running.clear()
            s.waiting.clear()
            s.busy.clear()

    def _drain(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

    def _release_idle_pages(self) -> bool:
        """Once the engine has idled `kv_release_idle_s`, the free KV pages written since are given back to the OS
        (a CPU's pool: `ModelRunner.release_pages`), once at least `RELEASE_MIN_PAGES` are, in calls of about
        `RELEASE_CHUNK_PAGES` (new work goes first between them). Returns whether some are left to give back."""
        after = self.cfg.kv_release_idle_s
        if not after or not self.runner.lazy_pool:
            return False
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < after:
            return False
        written = self.kv.releasable()
        n = int(written.sum())
        if n == 0 or (n < RELEASE_MIN_PAGES and self._releasing is None):
            return False
        t0 = time.perf_counter()
        pages = self.kv.release_span(RELEASE_CHUNK_PAGES)
        self.runner.release_pages(pages)
        self.kv.released(pages)
        k = int((pages & written).sum())
        self.released_pages += k
        done, secs, calls = self._releasing or (0, 0.0, 0)
        self._releasing = (done + k, secs + time.perf_counter() - t0, calls + 1)
        if k < n:
            return True
        done, secs, calls = self._releasing
        self._releasing = None
        log.info("gave %d free KV pages back to the OS after %g s idle (%.1f ms in %d call(s))", done, after,
                 secs * 1e3, calls)
        return False

    def step(self) -> None:
        """One iteration: the scheduler plans, the runner launches the plan, the scheduler applies the
        sampled tokens; then the outputs go to their listeners.

        With `overlap` a stable decode batch keeps a step in flight: the next step is planned and launched
        (`Scheduler.schedule_ahead`) before this one's tokens are read, so the device never waits for
        the host's bookkeeping, streaming and stop checks between the two."""
        t0 = time.perf_counter()
        device0 = self.runner.wait_s + self.runner.dispatch_s
        if self._inflight is None:
            plan = self.scheduler.schedule(self.runner.multi_step, self.runner.multi_fits)
            try:
                launched = self.runner.launch(plan)
            except ParrotError as err:
                self._deliver(self.scheduler.fail_step(plan, err))
                return
            except Exception as exc:  # noqa: BLE001 - what this step's inputs met: they fail, the engine serves on
                self._deliver(self.scheduler.fail_step(plan, _step_failed(exc)))
                return
        else:
            plan, launched = self._inflight
            self._inflight = None
        ahead = (self.scheduler.schedule_ahead(plan, self.runner.multi_step, self.runner.multi_fits)
                 if self.cfg.overlap else None)
        if ahead is not None:
            try:
                self._inflight = (ahead, self.runner.launch(ahead, prev=launched))
            except ParrotError as err:
                self._deliver(self.scheduler.fail_step(ahead, err))  # its jobs fail; `plan` skips them
                ahead = None
            except Exception as exc:  # noqa: BLE001 - as above
                self._deliver(self.scheduler.fail_step(ahead, _step_failed(exc)))
                ahead = None
        self._applying = [slot.job for slot in plan.slots]  # a job may finish, and leave `running`, in `update`
        try:
            sampled = self.runner.collect(launched)
        except ParrotError as err:
            outputs = self.scheduler.fail_step(plan, err)
        else:
            outputs = self.scheduler.update(plan, sampled, ahead)
        self._deliver(outputs)
        self._applying = []
        if not plan.empty:  # a multi-step plan counts as its steps, its times shared among them
            self.steps += plan.steps
            self.ahead_steps += ahead is not None
            wall = time.perf_counter() - t0
            self._step_ms.append(wall * 1e3 / plan.steps)
            device = self.runner.wait_s + self.runner.dispatch_s - device0
            self._host_ms.append((wall - device) * 1e3 / plan.steps)
            self.trace.step(plan, wall, ahead is not None)

    @staticmethod
    def _deliver(outputs: list[JobOutput]) -> None:
        for out in outputs:
            for chunk in out.chunks:
                _emit(out.job, chunk)
            if out.finished:
                _finish(out.job, out.result, out.error)


def _step_failed(exc: Exception) -> GenerationFailedError:
    """The error for the jobs of a step whose launch raised something other than a ParrotError (a bug met by
    their inputs, e.g. a value the host could not pack): they fail with it, their KV rolled back, and the
    loop goes on, so one request cannot take the engine, and everyone's work, down with it."""
    log.exception("a step could not be launched; its jobs fail, the engine serves on")
    return GenerationFailedError(f"the engine could not run this step: {type(exc).__name__}: {exc}")


def _emit(job: Job, chunk: StreamChunk) -> None:
    """Hand a chunk to the job's listener; a failing listener (e.g. a closed event loop) is dropped,
    never allowed to stop the engine."""
    if job.on_chunk is None:
        return
    try:
        job.on_chunk(chunk)
    except Exception:
        log.warning("stream listener of job %d failed; dropping it", job.job_id, exc_info=True)
        job.on_chunk = None


def _finish(job: Job, result: object | None, err: BaseException | None = None) -> None:
    """Answer the job's caller, once: later calls (a crash's cleanup after its result) do nothing."""
    on_done, job.on_done = job.on_done, None
    if on_done is None:
        return
    try:
        on_done(result, err)
    except Exception:
        log.warning("completion listener of job %d failed", job.job_id, exc_info=True)


def _resolver(fut: concurrent.futures.Future) -> Callable[[object | None, BaseException | None], None]:
    return lambda result, err: _settle(fut, result, err)


def _settle(fut: concurrent.futures.Future, result: object | None, err: BaseException | None = None) -> None:
    """Resolve a caller's future from the engine thread; one the caller cancelled (or that is already
    resolved) is left as it is: the loop thread must never die of it."""
    try:
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
