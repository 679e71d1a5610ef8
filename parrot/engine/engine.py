"""LLMEngine: Fill / Generate / FreeContext / Ping on forkable paged contexts, one step loop.

The step loop runs in its own thread (JAX calls block); callers submit primitives from any thread or
from asyncio and get results through callbacks, futures or async iterators. All scheduler and KV
state is touched only by the loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from parrot.config import EngineConfig
from parrot.engine.batch import SequenceSlice, build_batch, find_shared_prefix
from parrot.engine.kv_cache import KVCacheManager
from parrot.engine.loader import LoadedModel
from parrot.engine.runner import ModelRunner
from parrot.engine.sampling import SamplingBatch, check_sampling
from parrot.engine.scheduler import Scheduler, Slot, StepPlan
from parrot.engine.sequence import Job, JobKind
from parrot.engine.tokenizer import IncrementalDetokenizer
from parrot.errors import ConflictError, InvalidRequestError, NotFoundError, ParrotError
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


class EngineDeadError(ParrotError):
    """The engine loop stopped (shut down or crashed); nothing more will run."""


class LLMEngine:
    def __init__(self, model: LoadedModel, cfg: EngineConfig | None = None, name: str | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.model = model
        self.name = name or model.source
        self.tokenizer = model.tokenizer
        self.runner = ModelRunner(model.config, model.weights, self.cfg)
        self.kv = KVCacheManager(self.runner.num_pages, self.runner.page_size)
        self.scheduler = Scheduler(self.kv, self.cfg, self.runner.max_len)
        self.vocab_size = model.config.vocab_size
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead: BaseException | None = None
        self._rng = np.random.default_rng()
        self.steps = 0
        self.cascade_steps = 0  # decode steps that read a shared prefix once for all its forks
        self._step_ms: collections.deque[float] = collections.deque(maxlen=32)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, precompile: bool | None = None) -> LLMEngine:
        if precompile if precompile is not None else self.cfg.precompile:
            self.runner.precompile()
        self._thread = threading.Thread(target=self._loop, name="parrot-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

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
        else:
            assert job.sampling is not None
            check_sampling(job.sampling, self.vocab_size)
            if job.sampling.seed is None:
                job.sampling = job.sampling.model_copy(update={"seed": int(self._rng.integers(2**31))})
            stops = set(job.sampling.stop_token_ids)
            if not job.sampling.ignore_eos:
                stops |= self.tokenizer.stop_token_ids
            job.stop_ids = frozenset(stops)
            job.detok = IncrementalDetokenizer(self.tokenizer, job.sampling.stop)
        self._call(lambda: self.scheduler.add(job))

    def _call(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self._wake.set()

    def fill_future(self, req: FillRequest) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        job = Job(JobKind.FILL, req.context_id, req.parent_context_id, fill_tokens=list(req.token_ids),
                  on_done=_resolver(fut), arrival=time.monotonic() - req.waited_s, priority=req.priority)
        self.submit(job)
        return fut

    def generate_future(self, req: GenerateRequest,
                        on_chunk: Callable[[StreamChunk], None] | None = None) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        job = Job(JobKind.GENERATE, req.context_id, req.parent_context_id, sampling=req.sampling,
                  on_chunk=on_chunk, on_done=_resolver(fut), arrival=time.monotonic() - req.waited_s,
                  priority=req.priority)
        self.submit(job)
        return fut

    def free_future(self, context_id: str) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def do() -> None:
            try:
                if self.scheduler.referenced(context_id):
                    raise ConflictError(f"context {context_id!r} is in use by a running or queued primitive")
                freed = self.scheduler.free_context(context_id) if context_id in self.kv else None
                if freed is None:
                    raise NotFoundError(f"context {context_id!r} does not exist")
                fut.set_result(FreeContextResponse(context_id=context_id, freed_pages=freed))
            except ParrotError as exc:
                fut.set_exception(exc)

        if self._thread is None or self._dead is not None or self._stop:
            raise EngineDeadError("the engine is not running")
        self._call(do)
        return fut

    # ---- asyncio front -------------------------------------------------------------------------
    async def fill(self, req: FillRequest) -> FillResponse:
        return await asyncio.wrap_future(self.fill_future(req))

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        return await asyncio.wrap_future(self.generate_future(req))

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamChunk | BaseException | None] = asyncio.Queue()
        fut = self.generate_future(req, on_chunk=lambda c: loop.call_soon_threadsafe(q.put_nowait, c))
        fut.add_done_callback(
            lambda f: loop.call_soon_threadsafe(q.put_nowait, f.exception() if f.exception() else None))
        while True:
            item = await q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def free_context(self, context_id: str) -> FreeContextResponse:
        return await asyncio.wrap_future(self.free_future(context_id))

    def ping(self) -> RuntimeInfo:
        s = self.scheduler
        return RuntimeInfo(
            model=self.name, max_context_len=self.runner.max_len, page_size=self.kv.page_size,
            total_pages=self.kv.total_pages, free_pages=self.kv.num_free_pages, num_contexts=len(self.kv),
            num_cached_tokens=self.kv.num_cached_tokens, running=len(s.running), waiting=len(s.waiting),
            recent_step_ms=float(np.median(self._step_ms)) if self._step_ms else 0.0, steps=self.steps,
            shape_misses=self.runner.shape_misses, preemptions=s.preemptions, evictions=s.evictions,
            cascade_steps=self.cascade_steps,
        )

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
                if not self.scheduler.has_work():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self.step()
        except BaseException as exc:  # a crash must not leave callers waiting forever
            log.exception("engine loop crashed")
            self._dead = exc
        finally:
            self._drain()
            err = EngineDeadError(f"the engine stopped ({self._dead or 'shut down'})")
            for job in [*self.scheduler.running, *self.scheduler.waiting]:
                _finish(job, None, err)

    def _drain(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

    def step(self) -> None:
        """One iteration: schedule, copy pages, run the decode and prefill batches, emit results."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for job, err in plan.failed:
            self._fail(job, err)
        if plan.copies:
            self.runner.copy_pages(plan.copies)
        if plan.empty:
            return
        try:
            if plan.decode:
                self._run(plan.decode, decode=True)
            if plan.prefill:
                self._run(plan.prefill, decode=False)
        except ParrotError as err:
            self._abort(plan, err)
        self.steps += 1
        self._step_ms.append((time.perf_counter() - t0) * 1e3)

    def _run(self, slots: list[Slot], decode: bool) -> None:
        r = self.runner
        kv_len = max(s.start + len(s.tokens) for s in slots)
        seqs = [SequenceSlice(s.tokens, s.start, s.pages) for s in slots]
        shape = None
        if decode and self.cfg.shared_prefix_attention and len(slots) > 1:
            members, shared = find_shared_prefix([s.pages for s in slots])
            if shared:
                for i in members:
                    seqs[i].shared_pages = shared
                own = max(s.start + len(s.tokens) - (s.shared_pages * r.page_size) for s in seqs)
                shape = r.cascade_shape(len(slots), own, shared * r.page_size)
                if shape is not None:
                    self.cascade_steps += 1
                else:
                    for i in members:
                        seqs[i].shared_pages = 0
        if shape is None:
            shape = (r.decode_shape(len(slots), kv_len) if decode
                     else r.prefill_shape(len(slots), max(len(s.tokens) for s in slots), kv_len))
        batch = build_batch(seqs, r.page_size, shape.tokens, shape.batch, shape.q_len, shape.pages,
                            shape.prefix_pages)
        logits = r.forward(batch)
        # which rows produce a token: generate jobs whose pending tokens are all fed by this step
        sampling_rows = [i for i, s in enumerate(slots)
                         if s.job.kind is JobKind.GENERATE and len(s.tokens) == len(s.job.pending)]
        tokens = None
        if sampling_rows:
            params = [slots[i].job.sampling for i in range(len(slots))]
            if all(p is None or p.greedy for p in params):
                tokens = r.sample(logits, None)
            else:
                filled = [p if p is not None else params[sampling_rows[0]] for p in params]
                steps = [len(s.job.output_ids) for s in slots]
                sb = SamplingBatch.build(filled, steps, shape.batch, [p.seed or 0 for p in filled])
                tokens = r.sample(logits, sb)
        for i, s in enumerate(slots):
            job = s.job
            del job.pending[: len(s.tokens)]
            if job.pending:
                continue
            if job.kind is JobKind.FILL:
                self.scheduler.finish(job)
                _finish(job, FillResponse(context_id=job.context_id, num_tokens=self.kv.get(job.context_id).num_tokens))
            else:
                assert tokens is not None
                self._on_token(job, int(tokens[i]))

    def _on_token(self, job: Job, token: int) -> None:
        sp = job.sampling
        assert sp is not None and job.detok is not None
        if job.first_token_time is None:
            job.first_token_time = time.monotonic()
        ctx_tokens = self.scheduler.tokens[job.context_id]
        if token in job.stop_ids:
            return self._complete(job, "stop")
        job.output_ids.append(token)
        ctx_tokens.append(token)  # in the context; its KV is written when it is fed (next step or job)
        delta, hit_stop = job.detok.add(token)
        _emit(job, StreamChunk(token_id=token, text=delta))
        if hit_stop:
            return self._complete(job, "stop")
        if len(job.output_ids) >= sp.max_tokens or len(ctx_tokens) >= self.runner.max_len:
            return self._complete(job, "length")
        job.pending = [token]

    def _complete(self, job: Job, reason: str) -> None:
        job.finish_reason = reason
        self.scheduler.finish(job)
        assert job.detok is not None
        _emit(job, StreamChunk(text=job.detok.flush(), finish_reason=reason))
        _finish(job, GenerateResponse(context_id=job.context_id, token_ids=list(job.output_ids), text=job.detok.text,
                                      finish_reason=reason, num_tokens=len(self.scheduler.tokens[job.context_id])))

    def _fail(self, job: Job, err: BaseException) -> None:
        copy = self.scheduler.roll_back(job)
        if copy is not None:
            self.runner.copy_pages([copy])
        _finish(job, None, err)

    def _abort(self, plan: StepPlan, err: ParrotError) -> None:
        for s in [*plan.decode, *plan.prefill]:
            if s.job in self.scheduler.running:
                self.scheduler.finish(s.job)
            self._fail(s.job, err)


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
    if job.on_done is None:
        return
    try:
        job.on_done(result, err)
    except Exception:
        log.warning("completion listener of job %d failed", job.job_id, exc_info=True)


def _resolver(fut: concurrent.futures.Future) -> Callable[[object | None, BaseException | None], None]:
    def done(result: object | None, err: BaseException | None) -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(result)

    return done
