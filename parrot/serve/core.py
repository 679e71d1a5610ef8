"""ParrotServeCore: owns every serve-layer manager and runs apps from semantic variables.

Flow (one asyncio loop): a semantic call is parsed into chunks, bound to variables (the first constant
text is a global, content-addressed variable split by the prefix matcher; other text is session-local),
inserted into the session's graph as completion chains. Reading a variable marks what it depends on as
needed (performance deduction); ready and needed chains become tasks for the GlobalScheduler, which
places them on engines by cached prefix and load. A task tokenizes its whole prompt at once (the same
tokens a plain completion of that text gets), forks the longest cached context whose tokens begin its
prompt (automatic prefix caching: any earlier prompt, checkpoint or output on that engine, matched
block by block), fills the rest, keeping contexts at the boundaries later work can share, and
generates into its output variable, streaming. An engine that dies has its unfinished tasks
re-dispatched elsewhere.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import concurrent.futures
import dataclasses
import logging
import math
import random
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parrot.config import ServeConfig
from parrot.errors import (
    AbortedError,
    ConflictError,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerationFailedError,
    InvalidRequestError,
    NotFoundError,
    ParrotError,
    RateLimitError,
)
from parrot.protocol import (
    CONSTRAINTS,
    CallCreated,
    FillRequest,
    GenerateRequest,
    NativeCallRequest,
    ParamInfo,
    SamplingParams,
    SemanticCallRequest,
    TokenLogprob,
)
from parrot.serve import perf
from parrot.serve.contexts import CachedContext, ContextManager, salt_digest
from parrot.serve.engines import EngineClient, EngineManager
from parrot.serve.executor import NATIVE_ID_PREFIX, NativeNode
from parrot.serve.graph import ConstantFill, Node, PlaceholderFill, PlaceholderGen, RequestChain
from parrot.serve.perf import Criterion
from parrot.serve.prefix_matcher import PrefixMatcher
from parrot.serve.request import Parameter, PlaceholderChunk, parse_request
from parrot.serve.scheduler import CompletionTask, EngineView, GlobalScheduler
from parrot.serve.serve_time import ServeTime, TaskClock
from parrot.serve.session import Session
from parrot.serve.stats_log import StatsLog
from parrot.serve.tokenizers import TokenizerManager
from parrot.serve.transforms import TransformContext, TransformError, run_transform, validate_call
from parrot.serve.variables import SemanticVariable, SemanticVariableManager

if TYPE_CHECKING:
    from parrot.serve.engine_processes import EngineProcesses

log = logging.getLogger(__name__)
FILL_ERROR_WAIT_S = 5.0  # how long a generate that found no parent waits for the failing fill's reason
INLINE_TOKENIZE_CHARS = 1 << 16  # a semantic call's prompt longer than this is tokenized on a worker thread
EMPTY_TOKENS = ("the prompt is empty: its text has no token in the model's vocabulary (characters the tokenizer "
                "drops, such as some control characters)")


@dataclass(eq=False)
class _TaskRecord:
    """What a task generates into. `owners[i]`: the session owning the prefix context ending at boundary
    i (None: global constant text, kept across sessions). Subclasses deliver the output."""

    sampling: SamplingParams
    owners: list[str | None]
    owner: str  # owner of the generated context
    streamed: str = ""  # text already delivered (kept across retries on another engine)
    diverged: bool = False  # a re-run elsewhere generated other text than what was delivered (`deliver`)
    created: float = field(default_factory=time.perf_counter)
    priority: int = 0  # engine queue priority: 0 latency-critical, 1 throughput
    client: str | None = None  # whose work it is for the engines' fair share (`ServeCore._engine_client`)
    overloads: int = 0  # times an engine refused it for KV space (it is retried later or elsewhere)
    cancelled: str | None = None  # why it was cancelled (its readers went away); None while wanted
    running_on: tuple[EngineClient, str] | None = None  # (engine, context id) of the generate in flight
    ended: bool = False  # finished, failed or cancelled for good
    clock: TaskClock = field(default_factory=TaskClock)  # the serve layer's own time (serve_time.py)
    fills: list[asyncio.Future] = field(default_factory=list)  # fills this run sent or forks, not awaited
    others: set[asyncio.Future] = field(default_factory=set)  # those of `fills` for others' longer prompts
    prompt_logprobs: int | None = None  # the prompt's token logprobs too, with this many alternatives each
    constraint_complete: bool | None = None  # a constrained generate's text is a whole output (its last chunk's)

    app_started: float | None = None  # app-aware: when its app's current run began (app-FIFO in the engine)

    def waited(self) -> float:
        """Seconds since the task became runnable, or (app-aware) since its app's current run began: its
        engine primitives keep that place in line, so an app's later steps go ahead of work that arrived
        after the app started (app-FIFO), as requests deeper in a DAG do in the scheduler."""
        return max(0.0, time.perf_counter() - (self.app_started or self.created))

    def deliver(self, text: str, tokens: int = 0) -> None:
        """`text` is everything generated so far in this attempt, from `tokens` tokens; pass on what is new. A
        re-run (its engine died) repeats the text delivered (greedy, or sampled from the seed the core gave it);
        one that does not, on an engine that computes otherwise, is marked `diverged`."""
        if len(text) > len(self.streamed) and text.startswith(self.streamed):
            self.on_text(text[len(self.streamed):], tokens)
            self.streamed = text
        elif not self.streamed.startswith(text):
            self.diverged = True

    def note(self, **info: Any) -> None:
        """Record how the task ran (engine, times, tokens), for inspection."""

    def on_text(self, delta: str, tokens: int = 0) -> None: ...
    def on_logprob(self, position: int, logprob: TokenLogprob) -> None: ...
    def on_logprobs_kept(self, kept: int) -> None: ...
    def on_prompt_logprobs(self, items: list[TokenLogprob]) -> None: ...
    def done(self, text: str, token_ids: list[int], prompt_tokens: int, cached_tokens: int, finish: str,
             stop_reason: int | str | None = None) -> None: ...
    def failed(self, reason: str, error: ParrotError | None = None) -> None: ...


@dataclass(eq=False)
class _ChainRecord(_TaskRecord):
    session: Session | None = None
    chain: object = None  # CompletionChain

    def note(self, **info: Any) -> None:
        self.chain.run.update(info)

    def on_text(self, delta: str, tokens: int = 0) -> None:
        self.chain.output_var.append_stream(delta)

    def done(self, text: str, token_ids: list[int], prompt_tokens: int, cached_tokens: int, finish: str,
             stop_reason: int | str | None = None) -> None:
        field = self.sampling.constraint
        if field is not None and finish == "length" and not self.constraint_complete:  # a typed output must be whole
            self.chain.output_var.fail_if_pending(
                f"the output did not complete its {field} within max_tokens={self.sampling.max_tokens} "
                f"(partial output: {text[:200]!r}); raise max_tokens")
            return
        if field is not None and stop_reason is not None and not self.constraint_complete:  # a stop cut it short
            self.chain.output_var.fail_if_pending(
                f"the stop {'string' if isinstance(stop_reason, str) else 'token'} {stop_reason!r} ended the output "
                f"before it completed its {field} (partial output: {text[:200]!r}); a typed output takes no stop "
                "that its text may contain")
            return
        self.chain.output_var.set(text)

    def failed(self, reason: str, error: ParrotError | None = None) -> None:
        if "dispatched" in self.chain.run:  # it ran: the live view shows how long, until it failed
            self.note(latency_s=time.perf_counter() - self.created)
        self.chain.output_var.fail_if_pending(reason)


def _generation_stats(rec: _ChainRecord, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                      t_first: float | None) -> dict:
    """One finished generation's timings, measured from when its task became runnable (all inputs set
    and the output needed): time to first token, time per output token after it, and latency."""
    now = time.perf_counter()
    first = t_first if t_first is not None else now
    return {"var_id": rec.chain.output_var.id, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "output_tokens": output_tokens, "ttft_s": first - rec.created, "serve_s": rec.clock.serve_s,
            "tpot_s": (now - first) / (output_tokens - 1) if output_tokens > 1 else None,
            "latency_s": now - rec.created}


def _failed_fill(rec: _TaskRecord) -> asyncio.Future | None:
    """The first failed fill the task sent or forked (pipelined), if any."""
    for fut in rec.fills:
        if fut.done() and not fut.cancelled() and isinstance(fut.exception(), ParrotError):
            return fut
    return None


def _fill_error(rec: _TaskRecord) -> ParrotError | None:
    """The error of the first failed fill the task sent or forked (pipelined), if any."""
    fut = _failed_fill(rec)
    return None if fut is None else fut.exception()


@dataclass(eq=False)
class CompletionResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None  # with sampling.logprobs: one per token of token_ids
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt_logprobs: one per prompt token
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (GenerateResponse's)


class TextDelta(str):
    """Queue item of a plain completion: text that follows what came before, and how many tokens had been
    generated when it was (vLLM's continuous usage statistics)."""

    tokens: int

    def __new__(cls, text: str, tokens: int = 0) -> TextDelta:
        delta = super().__new__(cls, text)
        delta.tokens = tokens
        return delta


@dataclass(eq=False)
class TokenLogprobs:
    """Queue item of a plain completion with sampling.logprobs: the logprobs of tokens whose text comes next."""

    items: list[TokenLogprob]


@dataclass(eq=False)
class PromptLogprobs:
    """Queue item of a plain completion with prompt_logprobs, before any text: one per prompt token (the
    first has none)."""

    items: list[TokenLogprob]


@dataclass(eq=False)
class _PlainRecord(_TaskRecord):
    """A plain completion (OpenAI-compatible API): text deltas (preceded by TokenLogprobs when logprobs
    were asked for) and the result go to an asyncio queue."""

    queue: asyncio.Queue | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    _sent_logprobs: int = 0  # logprobs already queued (kept across retries on another engine)
    # where each token's text starts in the generated text, in characters (a token holding part of a
    # character starts where that character does): a token's logprob goes out with the text it starts in
    _starts: list[int] = field(default_factory=list)
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _end: int = 0  # characters the tokens of `_starts` decode to
    logprobs_kept: int | None = None  # where a stop string cut the text: the tokens whose logprobs are the answer's
    prompt_items: list[TokenLogprob] | None = None  # the prompt's logprobs (queued once, at the first attempt)

    def _send_logprobs(self, upto: int) -> None:
        if upto > self._sent_logprobs:
            self.queue.put_nowait(TokenLogprobs(self.logprobs[self._sent_logprobs:upto]))
            self._sent_logprobs = upto

    def on_text(self, delta: str, tokens: int = 0) -> None:
        """`delta` follows the text streamed so far, and `tokens` were generated up to its end: the logprobs of the
        tokens starting in it go first (a token whose text is held back, e.g. what may begin a stop string, waits
        for its text)."""
        end = len(self.streamed) + len(delta)
        upto = self._sent_logprobs
        while upto < len(self._starts) and self._starts[upto] < end:
            upto += 1
        self._send_logprobs(upto)
        self.queue.put_nowait(TextDelta(delta, tokens))

    def on_logprobs_kept(self, kept: int) -> None:
        self.logprobs_kept = kept

    def on_prompt_logprobs(self, items: list[TokenLogprob]) -> None:
        if self.prompt_items is None:
            self.queue.put_nowait(PromptLogprobs(items))
        self.prompt_items = items

    def on_logprob(self, position: int, logprob: TokenLogprob) -> None:
        """The logprob of this attempt's token `position` (a retry elsewhere generates the same positions)."""
        if position < len(self.logprobs):
            self.logprobs[position] = logprob
        else:
            self.logprobs.append(logprob)
            self._starts.append(self._end)
            self._end += len(self._decoder.decode(bytes(logprob.bytes)))

    def done(self, text: str, token_ids: list[int], prompt_tokens: int, cached_tokens: int, finish: str,
             stop_reason: int | str | None = None) -> None:
        kept = len(token_ids) if self.logprobs_kept is None else min(self.logprobs_kept, len(token_ids))
        self._send_logprobs(min(kept, len(self.logprobs)))
        logprobs = self.logprobs[:kept] if self.sampling.logprobs is not None else None
        self.queue.put_nowait(CompletionResult(text, token_ids, finish, prompt_tokens, cached_tokens, logprobs,
                                               self.prompt_items, stop_reason))

    def failed(self, reason: str, error: ParrotError | None = None) -> None:
        if self.cancelled:
            self.queue.put_nowait(AbortedError(reason))
        else:  # keep the error's class (an InvalidRequestError stays a 400 for the API)
            self.queue.put_nowait(error if error is not None else ParrotError(reason))


class ParrotServeCore:
    def __init__(self, model: str | None = None, session_ttl: float | None = None, dead_after: float | None = None,
                 tokenizers: TokenizerManager | None = None, default_max_tokens: int | None = None,
                 max_global_contexts: int | None = None, prefix_sharing: bool | None = None,
                 app_aware: bool | None = None, *, config: ServeConfig | None = None) -> None:
        """Every knob is in `config` (ServeConfig); the keyword arguments override its fields.
        `prefix_sharing=False` and `app_aware=False` give the baseline of the benchmarks: every task
        prefills its whole prompt in a fresh context freed afterwards, and the scheduler serves first come
        first served by load only."""
        overrides = {k: v for k, v in (("model", model), ("session_ttl_s", session_ttl), ("dead_after_s", dead_after),
                                       ("default_max_tokens", default_max_tokens),
                                       ("max_global_contexts", max_global_contexts),
                                       ("prefix_sharing", prefix_sharing), ("app_aware", app_aware)) if v is not None}
        cfg = dataclasses.replace(config or ServeConfig(), **overrides)
        self.config = cfg
        self.model = cfg.model
        self.session_ttl = cfg.session_ttl_s
        self.dead_after = cfg.dead_after_s
        self.default_max_tokens = cfg.default_max_tokens
        self.max_global_contexts = cfg.max_global_contexts
        self.vars = SemanticVariableManager(cfg.max_variable_memory_mb << 20, cfg.max_session_variable_memory_mb << 20,
                                            cfg.retry_after_s)
        self.tokenizers = tokenizers or TokenizerManager()
        self.engines = EngineManager()
        self.contexts = ContextManager(pin_hits=cfg.pin_hits, block=cfg.prefix_block_tokens)
        self.prefix_sharing = cfg.prefix_sharing
        self.scheduler = GlobalScheduler(self.contexts, self._engine_views, latency_cap=cfg.latency_cap,
                                         app_aware=cfg.app_aware, cache_aware=cfg.prefix_sharing,
                                         fair=cfg.fair_share)
        self.prefix_matchers: dict[str | None, PrefixMatcher] = {}  # one a cache salt (None: unsalted sessions)
        self.sessions: dict[str, Session] = {}
        # prefixes being filled: (engine, tokens) -> (context, fill future) on ordered engines (the context is
        # registered at once and forked right away), else (None, future of the context) that others await
        self._inflight_prefix: dict[tuple[str, str | None, tuple[int, ...]],
                                    tuple[CachedContext | None, asyncio.Future]] = {}
        self._background: set[asyncio.Task] = set()
        self.engines.on_engine_dead(self._on_engine_dead)
        self.engines.on_engine_back(self._on_engine_back)
        self.engines.on_engine_forgotten(self._on_engine_forgotten)
        # contexts on engines taken for dead, by engine: a death that was a slip (a late heartbeat, a slow ping)
        # leaves the engine holding them, and they are freed when it is live again
        self._orphans: dict[str, set[str]] = {}
        self._expiry: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # native functions run here, never on the event loop (a slow transform must not stall the server)
        self._natives = concurrent.futures.ThreadPoolExecutor(cfg.native_workers, thread_name_prefix="parrot-native")
        self._completions: weakref.WeakKeyDictionary[asyncio.Queue, CompletionTask] = weakref.WeakKeyDictionary()
        self._chain_tasks: dict[str, CompletionTask] = {}  # chain id -> its task, while queued or running
        # chains whose long prompts are tokenized on a worker thread (`_tokenize_then_submit`) -> why they were
        # cancelled meanwhile (None: still wanted)
        self._tokenizing: dict[str, str | None] = {}
        # session id -> when its app's current run began: its first chain became ready since the session last
        # had no chain left (app-aware mode: the engine queues the app's later steps as of then)
        self._app_started: dict[str, float] = {}
        self._readers: dict[str, int] = {}  # var id -> clients reading it now (get / stream)
        self.aborts = 0  # generations cancelled because their clients went away
        self.engine_deaths: collections.Counter[str] = collections.Counter()  # live -> dead, by engine
        self.redispatched = 0  # unfinished tasks of dead engines queued again for the others
        self._seeds = random.Random(self.config.seed)  # the seeds of sampled tasks that give none (`_seeded`)
        self.overload_retries = 0  # tasks re-queued after an engine refused them for KV space
        self.serve_time = ServeTime()  # the core's own time per task: ready -> first primitive, between primitives
        # set by the frontend's metrics: (endpoint, start) -> a timer with delta() / finish(...) / fail()
        self.request_timer: Callable[[str, float], Any] | None = None
        # the engine processes this server started (`parrot serve --engines N`; None: an embedded engine or
        # engines started elsewhere): /health and /metrics show their state
        self.engine_processes: EngineProcesses | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()  # the loop every coroutine of the core runs on
        self.engines.start_monitor(interval=self.config.monitor_interval_s, dead_after=self.dead_after,
                                   forget_after=self.config.forget_dead_engine_s)
        self._expiry = asyncio.create_task(self._expire_sessions())
        self._spawn(self._tick())
        if self.config.stats_log_interval_s:
            self._spawn(StatsLog(self, self.config.stats_log_interval_s).run())

    def drain(self) -> int:
        """The server is stopping: no request can set a variable any more, so each pending one that nothing
        produces fails now ("the server is shutting down"), and with it what waits on it; what can still be
        computed is. Readers of such variables (long-polls, streams) get their answer instead of holding the
        shutdown open. Returns how many variables it failed."""
        failed = 0
        for session in list(self.sessions.values()):
            for var in self.vars.session_variables(session.session_id):
                if var.is_pending and var.producer is None:
                    failed += var.fail_if_pending("the server is shutting down: nothing can set this variable now")
            self._progress(session)
        return failed

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        for t in list(self._background):
            t.cancel()
        await self.engines.stop_monitor()
        await self.engines.close()
        self._natives.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro) -> asyncio.Task:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _engine_views(self) -> list[EngineView]:
        views = []
        for client in self.engines.live_engines():
            info = self.engines.runtime(client.name)
            if info is not None and info.draining:  # stopping: what runs there finishes, nothing new goes there
                continue
            capacity = (client.max_batch_size or (info.max_batch_size if info else None)
                        or self.config.default_max_batch)
            views.append(EngineView(client.name, max_batch=capacity, queued=info.waiting if info else 0))
        return views

    # ---- sessions -----------------------------------------------------------------------------
    def create_session(self, cache_salt: str | None = None, owner: int | None = None) -> Session:
        """A new session; `owner`: the API key (its index in `ServeConfig.api_keys`) that opens it, None where the
        server takes no key. Past `max_sessions`, or the owner's `max_sessions_per_key`: 429."""
        per_key = self.config.max_sessions_per_key
        if owner is not None and per_key is not None:
            held = sum(1 for s in self.sessions.values() if s.owner == owner)
            if held >= per_key:
                raise RateLimitError(f"this API key holds {held} open sessions (limit {per_key} a key): delete "
                                     "finished sessions or retry later", self.config.retry_after_s)
        if len(self.sessions) >= self.config.max_sessions:
            # Retry-After: when the idlest session expires (the TTL less its idle time, and a sweep), if any is idle
            idle = [s.idle_seconds() for s in self.sessions.values() if s.readers == 0]
            wait = math.ceil(self.session_ttl - max(idle) + self._expiry_sweep_s()) if idle else None
            when = f" (the idlest expires in about {wait} s)" if wait else ""
            raise RateLimitError(f"too many open sessions (limit {self.config.max_sessions}): delete finished "
                                 f"sessions or retry later{when}", max(self.config.retry_after_s, wait or 0))
        session = Session(max_generations=self.config.max_generations_kept,
                          max_requests=self.config.max_requests_kept, salt=salt_digest(cache_salt), owner=owner)
        self.sessions[session.session_id] = session
        return session

    def _check_vars(self, session: Session, adding: int) -> None:
        have = self.vars.count(session.session_id)
        if have + adding > self.config.max_vars_per_session:
            raise RateLimitError(f"session {session.session_id} would hold {have + adding} variables (limit "
                                 f"{self.config.max_vars_per_session}): delete the session and start a new one",
                                 self.config.retry_after_s)

    def _check_pending(self, session: Session) -> None:
        pending = session.pending_calls()
        if pending >= self.config.max_pending_calls_per_session:
            raise RateLimitError(f"session {session.session_id} has {pending} calls not finished yet (limit "
                                 f"{self.config.max_pending_calls_per_session}): read their outputs first or retry "
                                 "later", self.config.retry_after_s)

    def get_session(self, session_id: str, token: str | None, owner: int | None = None) -> Session:
        """The session, for a request with its token and (where the server has API keys) the key that opened it:
        to another key it does not exist (404), whatever token comes with it."""
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFoundError(f"session {session_id!r} does not exist")
        session.check_token(token)
        return session

    async def delete_session(self, session: Session) -> None:
        """End a session (DELETE, or its TTL): its queued generations leave the queue and running ones are
        aborted on their engines (nobody can read them now); its variables fail ("session ended")."""
        self.sessions.pop(session.session_id, None)
        self._app_started.pop(session.session_id, None)
        if session.salt is not None and not any(s.salt == session.salt for s in self.sessions.values()):
            self.prefix_matchers.pop(session.salt, None)  # a salt's last session: its matcher goes (one a salt)
        for task in [t for t in self._chain_tasks.values() if t.payload.session is session]:
            self._cancel_task(task, "aborted: the session was deleted")
        for chain in session.executor.graph.chains:  # a long prompt being tokenized is dropped after it
            if chain.id in self._tokenizing:
                self._tokenizing[chain.id] = "aborted: the session was deleted"
        self.vars.free_session(session.session_id)
        for ctx in self.contexts.release_session(session.session_id):
            self._spawn(self._free_context(ctx))

    async def _free_context(self, ctx: CachedContext) -> None:
        await self._free_context_id(ctx.engine, ctx.context_id)

    async def _free_context_id(self, engine: str, context_id: str) -> None:
        if not self.engines.is_live(engine):  # freed if the engine is live again (`_on_engine_back`)
            if engine in self.engines:
                self._orphans.setdefault(engine, set()).add(context_id)
            return
        client = self.engines.get(engine)
        for _ in range(self.config.free_context_retries):  # a context still generating is freed once it ends
            try:
                await client.free_context(context_id)
                return
            except NotFoundError:
                return
            except EngineUnavailableError:
                return
            except ParrotError:
                await asyncio.sleep(self.config.free_context_retry_s)

    async def _tick(self) -> None:
        """Queued tasks wait for engine capacity or a newly registered engine: retry placing them. Every
        few seconds, global prefix contexts beyond `max_global_contexts` are dropped, coldest first (hot
        ones, forked `pin_hits` times or more, are pinned and go last)."""
        cfg = self.config
        last_evict = time.monotonic()
        while True:
            await asyncio.sleep(cfg.dispatch_tick_s)
            if self.scheduler.queue:
                self._dispatch()
            if time.monotonic() - last_evict >= cfg.evict_every_s:
                last_evict = time.monotonic()
                self._evict(cfg.global_idle_s)

    def _evict(self, idle_seconds: float) -> None:
        for ctx in self.contexts.evict_cold_globals(keep=self.max_global_contexts, idle_seconds=idle_seconds,
                                                    limit=self.config.max_cached_contexts):
            self._spawn(self._free_context(ctx))

    def _expiry_sweep_s(self) -> float:
        return min(30.0, self.session_ttl / 2)

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(self._expiry_sweep_s())
            for s in [s for s in self.sessions.values() if s.idle_seconds() > self.session_ttl]:
                log.info("session %s expired after %.0f s idle", s.session_id, s.idle_seconds())
                await self.delete_session(s)

    # ---- variables ----------------------------------------------------------------------------
    def create_var(self, session: Session, name: str, content: str | None) -> SemanticVariable:
        self._check_vars(session, 1)
        return self.vars.create(session.session_id, name, content)

    def set_var(self, session: Session, var_id: str, content: str) -> None:
        var = self.vars.get(var_id, session.session_id)
        if var.is_pending and var.producer is not None:  # a call computes it (set when the call is taken)
            raise ConflictError(f"variable {var.name!r} ({var.id}) is computed by call {var.producer}: "
                                "it is not set by a client")
        self.vars.set_by_client(var, content)
        session.executor.wanted.pop(var.id, None)
        self._progress(session)

    async def get_var(self, session: Session, var_id: str, criterion: Criterion, timeout: float | None) -> str:
        var = self.vars.get(var_id, session.session_id)
        if var.is_pending:
            self._need(session, var, criterion)
        self._readers[var.id] = self._readers.get(var.id, 0) + 1
        session.readers += 1
        left = False
        try:
            return await var.wait(timeout)
        except asyncio.CancelledError:  # the client disconnected (a `timeout` is a 408 to a reader still there)
            left = True
            raise
        finally:
            session.readers -= 1
            session.last_access = time.monotonic()
            self._unread(var)
            if left and var.is_pending:
                self.cancel_var(session, var, "its reader disconnected")

    def stream_var(self, session: Session, var_id: str, criterion: Criterion) -> AsyncIterator[str]:
        """Text deltas of the variable as it is generated. A reader that stops before the end (a client that
        disconnected) cancels the generation, unless something else still needs the variable."""
        var = self.vars.get(var_id, session.session_id)
        if var.is_pending:
            self._need(session, var, criterion)
        return self._reading(session, var)

    def _need(self, session: Session, var: SemanticVariable, criterion: Criterion) -> None:
        """A client reads `var` with `criterion`: what computes it is needed; tasks of chains this makes
        latency-critical (queued, or filling their prompts) take that criterion and the engines' first priority
        from their next primitive on."""
        for chain in session.executor.need(var, criterion):
            task = self._chain_tasks.get(chain.id)
            if task is not None:
                task.criterion = chain.run["criterion"] = "latency"
                task.payload.priority = self._priority("latency")
        self._progress(session)

    async def _reading(self, session: Session, var: SemanticVariable) -> AsyncIterator[str]:
        self._readers[var.id] = self._readers.get(var.id, 0) + 1  # counted once the stream is consumed
        session.readers += 1
        try:
            async for delta in var.stream():
                yield delta
        finally:
            session.readers -= 1
            session.last_access = time.monotonic()
            self._unread(var)
            if var.is_pending:  # the reader left before the end
                self.cancel_var(session, var, "its reader disconnected")

    def _unread(self, var: SemanticVariable) -> None:
        n = self._readers.get(var.id, 0) - 1
        if n > 0:
            self._readers[var.id] = n
        else:
            self._readers.pop(var.id, None)

    def still_needed(self, session: Session, var: SemanticVariable) -> bool:
        """Whether anything besides a departed reader needs `var`: another client reading it, a call submitted
        with `output_criteria`, or a needed call (semantic or native) that has not started and consumes it."""
        if self._readers.get(var.id, 0) > 0 or var.id in session.pinned:
            return True
        ex = session.executor
        for chain in ex.graph.chains:
            if not chain.started and chain.id in ex.criteria and any(v is var for v in chain.dependency_vars):
                return True
        return any(n.needed and not n.done and any(v is var for v in n.inputs.values()) for n in ex.natives)

    def cancel_var(self, session: Session, var: SemanticVariable, why: str) -> bool:
        """Cancel the generation producing `var` if nothing else needs it: a queued task leaves the queue, a
        running one is aborted on its engine (its KV is freed); `var` fails with an `aborted` reason. Where
        `var`'s own call has not started (it waits for its inputs), it is just not needed now, and the calls
        computing those inputs are cancelled so in turn (a chain's upstream). True when a generation was
        cancelled."""
        if not var.is_pending or self.still_needed(session, var):
            return False
        chain = next((c for c in session.executor.graph.chains if c.output_var is var), None)
        task = self._chain_tasks.get(chain.id) if chain is not None else None
        if task is not None:
            return self._cancel_task(task, f"aborted: {why}")
        if chain is not None and chain.id in self._tokenizing:  # its long prompt is being tokenized
            self._tokenizing[chain.id] = f"aborted: {why}"
            return True
        # not runnable yet (its inputs are computed) or a native call's output: nothing needs what computes it
        # now, and what computes their inputs is cancelled in turn unless something else needs it
        cancelled = False
        for dep in session.executor.unneed(var, lambda v: self.still_needed(session, v)):
            if dep.is_pending:
                cancelled = self.cancel_var(session, dep, f"nothing needs it now ({why})") or cancelled
        return cancelled

    def _cancel_task(self, task: CompletionTask, reason: str) -> bool:
        rec: _TaskRecord = task.payload
        if rec.cancelled is not None or rec.ended:
            return False
        rec.cancelled = reason
        self.aborts += 1
        if task in self.scheduler.queue:  # not started anywhere: drop it
            self.scheduler.queue.remove(task)
            self._task_ended(task, rec)
            rec.failed(reason)
            self._after_task(task, rec)
            return True
        if rec.running_on is not None:  # generating: abort it on its engine (the stream then ends)
            client, ctx_id = rec.running_on
            self._spawn(self._abort(client, ctx_id))
        return True  # still filling its prompt: it stops before generating

    async def _abort(self, client: EngineClient, context_id: str) -> None:
        try:
            await client.abort(context_id)
        except ParrotError as exc:
            log.debug("abort of %s on %s: %s", context_id, client.name, exc)

    # ---- calls --------------------------------------------------------------------------------
    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names the served model answers to: `--served-model-name`'s, else the model as given."""
        return self.config.served_model_names or (self.model,)

    def semantic_call(self, session: Session, req: SemanticCallRequest) -> CallCreated:
        if req.models is not None and not set(req.models) & set(self.served_model_names):
            served = ", ".join(map(repr, self.served_model_names))
            raise NotFoundError(f"none of the call's models {req.models!r} is served here (served: {served})")
        params = [Parameter(p.name, p.is_output, p.var_id, p.value,
                            p.sampling_config.model_dump(exclude_unset=True) if p.sampling_config else None)
                  for p in req.parameters]
        parsed = parse_request(req.template, params)
        if not parsed.outputs:
            raise InvalidRequestError("the template has no output placeholder: nothing to generate")
        for p in parsed.params.values():
            if p.is_output:
                self._check_output_sampling(p.name, p.sampling_config or {})
        self._check_pending(session)
        self._check_vars(session, len(parsed.chunks))
        request_id = f"r-{uuid.uuid4().hex[:12]}"
        bound: dict[str, SemanticVariable] = {}
        types: list[tuple[SemanticVariable, dict[str, Any]]] = []
        created: list[SemanticVariable] = []  # removed again if the request is refused
        constants: list[SemanticVariable] = []
        try:
            for p in parsed.params.values():
                if p.var_id is not None:
                    var = self.vars.get(p.var_id, session.session_id)
                    if p.is_output and not var.is_pending:
                        raise ConflictError(f"output variable {p.var_id} is already {var.state.value}")
                else:
                    var = self.create_var(session, p.name, p.value)
                    created.append(var)
                cfg = p.sampling_config or {}
                field = next((f for f in CONSTRAINTS if cfg.get(f) is not None), None)
                if p.is_output and field is not None:  # a typed output: shown in session inspection
                    types.append((var, {field: cfg[field]}))
                bound[p.name] = var
            nodes: list[Node] = []
            first_text = True
            for chunk in parsed.chunks:
                if isinstance(chunk, PlaceholderChunk):
                    var, p = bound[chunk.name], parsed.params[chunk.name]
                    nodes.append(PlaceholderGen(var, p.sampling_config) if p.is_output else PlaceholderFill(var))
                    continue
                if first_text:  # the leading constant: global and content-addressed, split where apps share it
                    matcher = self.prefix_matchers.setdefault(session.salt, PrefixMatcher())
                    matcher.add(chunk.text)
                    for piece in matcher.split(chunk.text):
                        constants.append(self.vars.constant(piece, session.session_id, session.salt))
                        nodes.append(ConstantFill(constants[-1]))
                    first_text = False
                else:
                    created.append(self.vars.create(session.session_id, "constant", chunk.text, is_constant=True))
                    nodes.append(ConstantFill(created[-1]))
            chain = RequestChain.build(request_id, session.session_id, nodes)
            session.executor.add_request(chain, req.output_criteria)
        except ParrotError:  # refused (a second producer, a cycle, ...): the session is as it was
            for var in created:
                self.vars.discard(var)
            for var in constants:
                self.vars.release_constant(var, session.session_id)
            raise
        for var, typ in types:
            var.type = typ
        session.add_request(request_id, {"template": req.template, "outputs": [v.id for v in chain.output_vars]},
                            chain.output_vars)
        if req.output_criteria is not None:
            session.pinned.update(v.id for v in chain.output_vars)
        self._progress(session)
        return CallCreated(request_id=request_id, param_info=[
            ParamInfo(name=n, is_output=parsed.params[n].is_output, var_id=v.id) for n, v in bound.items()])

    def _check_output_sampling(self, name: str, cfg: dict[str, Any]) -> None:
        """What an output's sampling config asks for that no prompt could get, refused when the call arrives (as
        vLLM refuses it) rather than when its output is read: more tokens than a sequence may hold, token ids
        outside the vocabulary."""
        most = self.engines.max_sequence_len()
        if most is not None and cfg.get("max_tokens", 0) >= most:
            raise InvalidRequestError(f"output {name!r}: max_tokens {cfg['max_tokens']} leaves no room for a prompt "
                                      f"in a sequence of at most {most} tokens")
        try:
            vocab = self.tokenizers.get(self.model).vocab_size
        except ParrotError:
            return
        ids = [*(int(t) for t in cfg.get("logit_bias") or {}), *(cfg.get("stop_token_ids") or [])]
        bad = sorted({t for t in ids if not 0 <= t < vocab})
        if bad:
            raise InvalidRequestError(f"output {name!r}: token ids {bad[:5]} are outside the vocabulary (ids 0 to "
                                      f"{vocab - 1}) in logit_bias / stop_token_ids")

    def native_call(self, session: Session, req: NativeCallRequest) -> CallCreated:
        call = validate_call(req.transform, req.params, list(req.inputs), list(req.outputs))
        self._check_pending(session)
        self._check_vars(session, len(req.inputs) + len(req.outputs))
        request_id = f"{NATIVE_ID_PREFIX}{uuid.uuid4().hex[:12]}"
        inputs: dict[str, SemanticVariable] = {}
        for name, src in req.inputs.items():
            if (src.var_id is None) == (src.value is None):
                raise InvalidRequestError(f"native input {name!r} needs exactly one of var_id or value")
            inputs[name] = (self.vars.get(src.var_id, session.session_id) if src.var_id is not None
                            else self.create_var(session, name, src.value))
        outputs = {name: self.vars.create(session.session_id, name, producer=request_id) for name in req.outputs}
        session.executor.add_native(NativeNode(call, inputs, outputs, request_id))
        session.add_request(request_id, {"transform": req.transform, "outputs": [v.id for v in outputs.values()]},
                            list(outputs.values()))
        params = [ParamInfo(name=n, is_output=False, var_id=v.id) for n, v in inputs.items()]
        params += [ParamInfo(name=n, is_output=True, var_id=v.id) for n, v in outputs.items()]
        self._progress(session)
        return CallCreated(request_id=request_id, param_info=params)

    # ---- execution ----------------------------------------------------------------------------
    def _progress(self, session: Session) -> None:
        """Run what became runnable: natives on worker threads (their results call this again), chains via
        the scheduler."""
        session.executor.fail_downstream(lambda v, r: v.fail_if_pending(r))
        chains, natives = session.executor.ready()
        for node in natives:
            self._run_native(session, node)
        for chain, criterion in chains:
            self._submit_chain(session, chain, criterion)
        self._dispatch()

    def _run_native(self, session: Session, node: NativeNode) -> None:
        tok = self.tokenizers.get(self.model)
        ctx = TransformContext.from_tokenizer(tok, regex_timeout_s=self.config.transform_timeout_s)
        inputs = {k: v.content or "" for k, v in node.inputs.items()}
        self._spawn(self._native(session, node, inputs, ctx))

    async def _native(self, session: Session, node: NativeNode, inputs: dict[str, str],
                      ctx: TransformContext) -> None:
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._natives, run_transform, node.call, inputs, ctx)
        except TransformError as exc:
            for var in node.outputs.values():
                var.fail_if_pending(str(exc))
        except RuntimeError as exc:  # the pool shut down (the server is stopping)
            for var in node.outputs.values():
                var.fail_if_pending(f"{node.call.name}: not run ({exc})")
        else:
            for name, var in node.outputs.items():
                if var.is_pending:
                    var.set(out[name])
        if session.session_id in self.sessions:
            self._progress(session)

    def _submit_chain(self, session: Session, chain, criterion: Criterion,  # noqa: ANN001
                      token_pieces: list[list[int]] | None = None, clock: TaskClock | None = None) -> None:
        clock = clock or TaskClock()  # ready now: tokenizing is the serve layer's time too
        pieces = [v.content or "" for v in chain.prefix_vars]
        if token_pieces is None:
            if sum(len(p) for p in pieces) > INLINE_TOKENIZE_CHARS:  # seconds for a megabyte: not on the loop
                self._spawn(self._tokenize_then_submit(session, chain, criterion, pieces, clock))
                return
            token_pieces = self.tokenizers.encode_pieces(self.model, pieces)
        tokens = [t for piece in token_pieces for t in piece]
        if not tokens:  # e.g. its only input an earlier output that came back empty: nothing to continue
            chain.output_var.fail_if_pending("the prompt is empty: its template and inputs rendered no text (an "
                                             "input that came back empty, say); the model needs a prompt")
            session.executor.finished(chain)
            return
        boundaries, n = [], 0
        for piece in token_pieces:
            n += len(piece)
            if n and (not boundaries or boundaries[-1] != n):
                boundaries.append(n)
        cfg = dict(chain.gen.sampling_config or {})
        cfg.setdefault("max_tokens", self.default_max_tokens)
        try:
            sampling = self._seeded(SamplingParams(**cfg))
        except Exception as exc:  # validated on the way in; a bad config fails only this output
            chain.output_var.fail_if_pending(f"invalid sampling config: {exc}")
            session.executor.finished(chain)
            return
        owners, all_global = [], True
        for var, piece in zip(chain.prefix_vars, token_pieces, strict=True):
            all_global = all_global and var.session_id is None
            if piece:
                owners.append(None if all_global else session.session_id)
        started = self._app_started.setdefault(session.session_id, clock.ready)
        chain.run["criterion"] = criterion  # the live view keeps it once the chain has ended
        rec = _ChainRecord(sampling, owners, session.session_id, created=clock.ready, clock=clock, session=session,
                           chain=chain, priority=self._priority(criterion), client=self._engine_client(session.owner),
                           app_started=started if self.scheduler.app_aware else None)
        task = CompletionTask(session.session_id, tokens, boundaries, criterion, session.executor.depth(chain),
                              session.executor.group(chain), payload=rec, salt=session.salt, client=session.owner)
        self._chain_tasks[chain.id] = task
        self.scheduler.submit(task)

    async def _tokenize_then_submit(self, session: Session, chain, criterion: Criterion,  # noqa: ANN001
                                    pieces: list[str], clock: TaskClock) -> None:
        """`_submit_chain` of a long prompt: tokenized on a worker thread (`encode_pieces` lets go of the GIL),
        the event loop serving other clients meanwhile; then submitted as a short one is."""
        self._tokenizing[chain.id] = None
        try:
            token_pieces = await asyncio.to_thread(self.tokenizers.encode_pieces, self.model, pieces)
            failed = self._tokenizing.pop(chain.id, None)  # its reader left meanwhile: why it was cancelled
            self.aborts += failed is not None
        except Exception as exc:  # noqa: BLE001 - fails this output alone
            self._tokenizing.pop(chain.id, None)
            failed = f"the prompt could not be tokenized: {exc}"
        if session.session_id not in self.sessions:  # deleted meanwhile
            return
        if failed is not None:
            chain.output_var.fail_if_pending(failed)
            session.executor.finished(chain)
            self._progress(session)
            return
        # a reader may have raised its criterion while it was tokenized (`_need`)
        criterion = perf.merge(session.executor.criteria.get(chain.id), criterion)
        self._submit_chain(session, chain, criterion, token_pieces, clock)
        self._dispatch()

    def _seeded(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with a seed of its own where it gives none (drawn from `ServeConfig.seed`'s sequence): a
        task re-run on another engine (its engine died) then samples the same tokens, so the text its readers
        already have goes on where it stopped."""
        if sampling.seed is not None or sampling.temperature == 0:
            return sampling
        return sampling.model_copy(update={"seed": self._seeds.getrandbits(63)})

    def _engine_client(self, key: int | None) -> str | None:
        """The client an API key's work is for in the engines (`FillRequest.client`: several keys share a full batch
        in turns, each its share), where the keys take turns (`--no-fair-share` off, app-aware mode)."""
        if key is None or not (self.scheduler.fair and self.scheduler.app_aware):
            return None
        return f"key-{key}"

    def _priority(self, criterion: Criterion) -> int:
        """Latency-critical work goes first in the engines' queues too (app-aware mode only)."""
        return 1 if self.scheduler.app_aware and criterion == "throughput" else 0

    def _dispatch(self) -> None:
        stranded = self.engines.stranded()
        if stranded:
            self._fail_queued(stranded)
            return
        for task in self.scheduler.schedule():
            self._spawn(self._run_task(task))

    def _fail_queued(self, stranded: dict[str, str]) -> None:
        """Every engine stopped for good (`EngineManager.stranded`): fail every queued task with an explicit
        error instead of leaving it waiting for an engine that cannot come."""
        reasons = "; ".join(f"{name}: {why}" for name, why in stranded.items())
        err = EngineUnavailableError(f"the engine stopped, and no other engine can run this ({reasons})")
        stranded, self.scheduler.queue = self.scheduler.queue, []
        for task in stranded:
            rec: _TaskRecord = task.payload
            self._task_ended(task, rec)
            rec.failed(str(err), err)
            self._after_task(task, rec)

    async def _run_task(self, task: CompletionTask) -> None:
        rec: _TaskRecord = task.payload
        engine = task.engine
        assert engine is not None
        rec.note(engine=engine, created=rec.created, dispatched=time.perf_counter())
        gen_id: str | None = None  # the generate's context, once asked for (freed here unless it succeeded)
        generated = False
        rec.fills, rec.others = [], set()
        try:
            client = self.engines.get(engine)
            parent, cached = await self._prefix_context(client, task)
            rec.note(prompt_tokens=len(task.tokens), cached_tokens=cached)  # the live view's, while it generates
            if rec.cancelled is not None:
                raise AbortedError(rec.cancelled)
            gen_owner = rec.owner if self.prefix_sharing else task.task_id
            gen_id = self.contexts.new_id(gen_owner)
            req = GenerateRequest(context_id=gen_id, parent_context_id=parent.context_id, sampling=rec.sampling,
                                  waited_s=rec.waited(), priority=rec.priority, client=rec.client)
            text, ids, finish, stop_reason = "", [], "stop", None
            timer = (self.request_timer("semantic_call", rec.created)
                     if self.request_timer is not None and isinstance(rec, _ChainRecord) else None)
            t_first: float | None = None
            parent.in_use += 1
            rec.running_on = (client, gen_id)
            aborted_again = False
            self.serve_time.sending(rec.clock)
            try:
                async for chunk in client.generate_stream(req):
                    if rec.cancelled is not None and not aborted_again:  # an abort that beat the generate there
                        aborted_again = True
                        self._spawn(self._abort(client, gen_id))
                    if chunk.token_id is not None:
                        ids.append(chunk.token_id)
                        if t_first is None:
                            t_first = time.perf_counter()
                            rec.note(ttft_s=t_first - rec.created)
                        rec.note(output_tokens=len(ids))
                    if chunk.logprob is not None:
                        rec.on_logprob(len(ids) - 1, chunk.logprob)
                    if chunk.logprobs_kept is not None:
                        rec.on_logprobs_kept(chunk.logprobs_kept)
                    if chunk.text and timer is not None:
                        timer.delta()
                    text += chunk.text
                    if chunk.finish_reason is not None:
                        finish, stop_reason = chunk.finish_reason, chunk.stop_reason
                        rec.constraint_complete = chunk.constraint_complete
                    rec.deliver(text, len(ids))
            except AbortedError:
                if timer is not None:
                    timer.abort()
                raise
            except EngineUnavailableError:
                raise  # re-dispatched: its re-run is the one counted
            except ParrotError:
                if timer is not None:
                    timer.fail()
                raise
            finally:
                self.serve_time.done(rec.clock)
                parent.in_use -= 1
                if rec.running_on == (client, gen_id):  # (a re-run elsewhere may have its own by now)
                    rec.running_on = None
            if task.engine != engine:  # its engine was taken for dead meanwhile (e.g. a draining engine) and the
                # task re-dispatched: that run answers (it repeats this text), this one ends here, once
                log.info("task %s finished on %s after it was re-dispatched; the re-run answers", task.task_id, engine)
                return
            generated = True
            self.contexts.register(engine, gen_id, [*task.tokens, *ids], parent, gen_owner, task.salt)
            if isinstance(rec, _ChainRecord):
                stats = _generation_stats(rec, len(task.tokens), cached, len(ids), t_first)
                rec.session.add_generation(stats)
                rec.note(**stats)
            if rec.diverged:  # what its readers have is not this text: an explicit error, not a spliced answer
                raise GenerationFailedError("the engine generating this stopped, and its re-run on another engine "
                                            "did not repeat the text already sent")
            rec.done(text, ids, len(task.tokens), cached, finish, stop_reason)
            if timer is not None:
                timer.finish(len(task.tokens), len(ids), finish)
        except EngineUnavailableError as exc:  # (its generate's context is freed if the engine is live again)
            log.warning("engine %s failed during task %s (%s): re-dispatching", engine, task.task_id, exc)
            self.engines.mark_dead(engine, str(exc))
            self._engine_gone(engine)
            return
        except ParrotError as exc:
            if isinstance(exc, NotFoundError | InvalidRequestError) and _fill_error(rec) is None:
                # its parent missing or shorter than it forked: a fill it forked failed in the same step, and that
                # fill's error may not have reached this loop yet (an overloaded engine's error does not wait)
                pending = [f for f in rec.fills if not f.done()]
                if pending:
                    await asyncio.wait(pending, timeout=FILL_ERROR_WAIT_S)
            failed = _failed_fill(rec)
            exc = failed.exception() if failed is not None else exc  # that is why (e.g. no KV space: retry)
            if failed in rec.others and not isinstance(exc, EngineOverloadedError):
                # the fill of another task's longer prompt, whose first blocks this task forked: whatever stopped
                # it, this task runs again, on what is cached then (within the retries' bound)
                exc = EngineOverloadedError(f"a longer context this task forked could not be filled: {exc}")
            if task.engine != engine:
                # the engine died or restarted meanwhile and the task is queued again: that run takes over (this
                # error is an effect of the restart, e.g. a parent context the restarted engine never had)
                log.info("task %s on %s failed after it was re-dispatched (%s)", task.task_id, engine, exc)
                return
            if (isinstance(exc, EngineOverloadedError) and rec.cancelled is None
                    and rec.overloads < self.config.overload_retries):
                rec.overloads += 1
                self.overload_retries += 1
                log.info("engine %s has no KV space for task %s (%s): retrying (%d)", engine, task.task_id, exc,
                         rec.overloads)
                self._spawn(self._retry_later(task))
                return
            if rec.cancelled is not None and isinstance(exc, AbortedError):  # the abort it asked for: say why
                rec.failed(rec.cancelled)
            else:
                rec.failed(str(exc) or type(exc).__name__, exc)
        except asyncio.CancelledError as exc:
            rec.failed(str(exc) or type(exc).__name__)
            raise
        except Exception as exc:  # a fault of the serve layer: this task fails explicitly, its readers do not hang
            log.exception("task %s failed on an internal error", task.task_id)
            rec.failed(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if task.engine == engine:
                self.scheduler.finished(task)
            if gen_id is not None and not generated:  # a failed or aborted generate: free what it made
                self._spawn(self._free_context_id(engine, gen_id))
        self._task_ended(task, rec)
        self._after_task(task, rec)

    async def _retry_later(self, task: CompletionTask) -> None:
        """A task an engine refused for KV space: queue it again after a pause (any engine may take it)."""
        rec: _TaskRecord = task.payload
        await asyncio.sleep(self.config.overload_backoff_s * min(rec.overloads, 4))
        if rec.cancelled is not None:
            self._task_ended(task, rec)
            rec.failed(rec.cancelled)
            self._after_task(task, rec)
            return
        task.engine = None
        rec.clock = TaskClock()  # its serve time counts afresh from here (the pause is a deliberate back-off)
        self.scheduler.submit(task)
        self._dispatch()

    def _task_ended(self, task: CompletionTask, rec: _TaskRecord) -> None:
        rec.ended = True
        if isinstance(rec, _ChainRecord):
            self._chain_tasks.pop(rec.chain.id, None)

    def _after_task(self, task: CompletionTask, rec: _TaskRecord) -> None:
        """A task is over (done, failed or cancelled): free what is no longer needed, run what it unblocked."""
        if not self.prefix_sharing:
            for ctx in self.contexts.release_session(task.task_id):
                self._spawn(self._free_context(ctx))
        elif self.contexts.num_globals() > self.config.max_cached_contexts:  # a burst of prompts: bound the cache
            self._evict(self.config.global_idle_s)
        if isinstance(rec, _ChainRecord):
            if rec.session.session_id not in self.sessions:  # deleted while this task ran: free what it made
                for ctx in self.contexts.release_session(rec.session.session_id):
                    self._spawn(self._free_context(ctx))
                return
            rec.session.executor.finished(rec.chain)
            self._progress(rec.session)
            if not rec.session.executor.graph.chains:  # the app's run is over: its next call starts a new one
                self._app_started.pop(rec.session.session_id, None)
        else:  # a plain completion keeps only its shared (global) prefixes cached
            for ctx in self.contexts.release_session(rec.owner):
                self._spawn(self._free_context(ctx))
            self._dispatch()

    async def _prefix_context(self, client: EngineClient, task: CompletionTask) -> tuple[CachedContext, int]:
        """Fork the longest cached context whose tokens begin the prompt on this engine and fill the rest,
        stopping (and caching a context) where later work can share a prefix (none less than
        `min_prefix_cut_tokens` after the prompt's start or the context it continues, but the whole
        prompt): global text, prefixes
        another live task shares (semantic boundaries or full blocks), the full blocks a cached longer
        context shares with this prompt, every `prefix_checkpoint_tokens`, the last block boundary
        `prefix_tail_checkpoint_tokens` before the end, and the whole prompt.
        Concurrent tasks needing the same prefix wait for one fill instead of repeating it.
        Returns the context holding the whole prompt and how many prompt tokens this task did not compute
        itself (found cached, or filled once for several tasks by another of them)."""
        engine = client.name
        rec: _TaskRecord = task.payload
        if rec.prompt_logprobs is not None:
            return await self._scored_prompt(client, task), 0
        if not self.prefix_sharing:  # baseline: the whole prompt into a fresh context, freed after the task
            self.contexts.record_lookup(len(task.tokens), 0)
            ctx_id = self.contexts.new_id(task.task_id)
            req = FillRequest(context_id=ctx_id, token_ids=task.tokens, waited_s=rec.waited(), priority=rec.priority,
                              client=rec.client)
            self.serve_time.sending(rec.clock)
            if client.ordered:  # the generate goes right behind it
                fut = client.send_fill(req)
                fut.add_done_callback(lambda f: self._fill_done(f, rec, None, None))
                rec.fills.append(fut)
            else:
                try:
                    await client.fill(req)
                finally:
                    self.serve_time.done(rec.clock)
            return self.contexts.register(engine, ctx_id, task.tokens, None, task.task_id, task.salt), 0
        block = self.contexts.block
        hashes = task.hashes(block)
        parent = self.contexts.longest_cached(engine, task.tokens, hashes, task.salt)
        if parent is not None:
            self.contexts.touch(parent)
            self._depend(rec, parent)
        rec.note(boundaries=task.boundaries, forked_from=parent.context_id if parent else None,
                 forked_tokens=parent.num_tokens if parent else 0)
        n = len(task.tokens)
        keep = self.scheduler.shared_boundaries(task)
        last = len(task.boundaries) - 1
        cuts: dict[int, str | None] = {}  # prompt length -> owner of the context kept there
        least = max(1, self.config.min_prefix_cut_tokens)  # the nearest a context is kept to the one it continues
        for i, b in enumerate(task.boundaries):
            if i == last or rec.owners[i] is None or b in keep:
                cuts[b] = rec.owners[i]

        def owner_at(c: int) -> str | None:  # the owner of the variable a block boundary lies in
            return rec.owners[next(i for i, b in enumerate(task.boundaries) if b >= c)]

        blocks = {self.contexts.matched_blocks(engine, hashes, task.salt) * block}
        if self.config.prefix_checkpoint_tokens:
            blocks.update(range(self.config.prefix_checkpoint_tokens, n, self.config.prefix_checkpoint_tokens))
        tail = self.config.prefix_tail_checkpoint_tokens
        if tail and n >= 4 * tail:  # where a prompt sharing all but a last question diverges
            blocks.add((n - tail) // block * block)
        for c in blocks:
            if 0 < c < n and c not in cuts:
                cuts[c] = owner_at(c)
        computed = 0
        held = parent  # a context this task forks next is in use: it is not evicted meanwhile
        if held is not None:
            held.in_use += 1
        try:
            while True:
                start = parent.num_tokens if parent is not None else 0
                shared = self.scheduler.shared_blocks(task) * block  # a task that arrived since shares more
                if start < shared < n and shared not in cuts:
                    cuts[shared] = owner_at(shared)
                # the next cut at least `least` tokens on (a shorter piece goes into the next fill; so no cut
                # before `least` either), or the end
                c = min((c for c in cuts if c > start and (c - start >= least or c == n)), default=None)
                if c is None:
                    break
                parent, filled = await self._fill_prefix(client, task.tokens[:c], parent, cuts[c], rec, task.salt)
                parent.in_use += 1
                if held is not None:
                    held.in_use -= 1
                held = parent
                computed += filled
                if not filled:  # filled by a concurrent task: this one forks it
                    rec.note(forked_from=parent.context_id, forked_tokens=parent.num_tokens)
        finally:
            if held is not None:
                held.in_use -= 1
        assert parent is not None
        self.contexts.record_lookup(n, n - computed)
        return parent, n - computed

    async def _scored_prompt(self, client: EngineClient, task: CompletionTask) -> CachedContext:
        """The prompt of a task that asks for its logprobs (a completion's `echo` with `logprobs`): filled whole
        into a fresh context whose Fill computes every token's logprob. A cached prefix would have none (its
        tokens were computed by earlier requests, which kept no logits), so no cached context is read, and
        this one is the task's own (freed with it). The logprobs go to the record before the generate starts."""
        rec: _TaskRecord = task.payload
        self.contexts.record_lookup(len(task.tokens), 0)
        owner = rec.owner if self.prefix_sharing else task.task_id
        ctx_id = self.contexts.new_id(owner)
        req = FillRequest(context_id=ctx_id, token_ids=task.tokens, logprobs=rec.prompt_logprobs,
                          waited_s=rec.waited(), priority=rec.priority, client=rec.client)
        self.serve_time.sending(rec.clock)
        try:
            resp = await client.fill(req)
        finally:
            self.serve_time.done(rec.clock)
        ctx = self.contexts.register(client.name, ctx_id, task.tokens, None, owner, task.salt)
        if resp.logprobs is None or len(resp.logprobs) != len(task.tokens):
            raise GenerationFailedError(f"engine {client.name!r} answered a fill without its prompt logprobs")
        rec.on_prompt_logprobs(resp.logprobs)
        return ctx

    async def _fill_prefix(self, client: EngineClient, tokens: list[int], parent: CachedContext | None,
                           owner: str | None, rec: _TaskRecord, salt: str | None = None,
                           ) -> tuple[CachedContext, int]:
        """The context of `tokens` on this engine, and how many tokens this call filled (0 when it was
        cached, or filled by a concurrent task). On an `ordered` engine client nothing is awaited: the fill
        is sent and the context registered at once, so the task's next fill or its generate (and other tasks'
        forks of it) go to the engine right behind it, which runs them in order; `rec.fills` keeps the
        futures. Elsewhere the fill is awaited, and a concurrent task waits for it."""
        key = (client.name, salt, tuple(tokens))
        pending = self._inflight_prefix.get(key)
        if pending is not None:  # another task fills it
            ctx, fut = pending
            if ctx is not None:  # ordered: fork it now
                self._depend(rec, ctx)
                return ctx, 0
            self.serve_time.sending(rec.clock)  # waiting for that is engine time for this task
            try:
                return await asyncio.shield(fut), 0
            finally:
                self.serve_time.done(rec.clock)
        cached = self.contexts.longest_prefix(client.name, tokens, [len(tokens)], salt)
        if cached is not None:
            self._depend(rec, cached)
            return cached, 0
        ctx_id = self.contexts.new_id(owner)
        start = parent.num_tokens if parent is not None else 0
        fork_len = None
        holder = self.contexts.holder(client.name, tokens, salt=salt) if len(tokens) - start > 1 else None
        if holder is not None:  # a longer context holds these blocks: fork its prefix, feed only the last token
            parent, start = holder, len(tokens) - 1
            fork_len = start
            self._depend(rec, holder, longer=True)
            rec.note(forked_from=holder.context_id, forked_tokens=fork_len)
        req = FillRequest(context_id=ctx_id, parent_context_id=parent.context_id if parent else None,
                          parent_num_tokens=fork_len, token_ids=tokens[start:], waited_s=rec.waited(),
                          priority=rec.priority, client=rec.client)
        if client.ordered:
            self.serve_time.sending(rec.clock)
            sent = client.send_fill(req)
            ctx = self.contexts.register(client.name, ctx_id, tokens, parent, owner, salt)
            ctx.filling = sent
            self._inflight_prefix[key] = (ctx, sent)
            sent.add_done_callback(lambda f: self._fill_done(f, rec, key, ctx))
            rec.fills.append(sent)
            return ctx, len(tokens) - start
        waiters: asyncio.Future[CachedContext] = asyncio.get_running_loop().create_future()
        self._inflight_prefix[key] = (None, waiters)
        if holder is not None:
            holder.in_use += 1  # not evicted while the engine forks it
        try:
            self.serve_time.sending(rec.clock)
            try:
                await client.fill(req)
            finally:
                self.serve_time.done(rec.clock)
                if holder is not None:
                    holder.in_use -= 1
            ctx = self.contexts.register(client.name, ctx_id, tokens, parent, owner, salt)
            waiters.set_result(ctx)
            return ctx, len(tokens) - start
        except BaseException as exc:
            waiters.set_exception(exc)
            waiters.exception()  # mark retrieved: waiters re-raise it
            raise
        finally:
            del self._inflight_prefix[key]

    def _fill_done(self, fut: asyncio.Future, rec: _TaskRecord, key: tuple[str, str | None, tuple[int, ...]] | None,
                   ctx: CachedContext | None) -> None:
        """A pipelined fill ended: its task's clock moves on; a failed one's context is forgotten (the forks
        sent behind it fail too, and their tasks report this fill's error)."""
        self.serve_time.done(rec.clock)
        if key is not None and self._inflight_prefix.get(key, (None, None))[1] is fut:
            del self._inflight_prefix[key]
        if ctx is not None:
            ctx.filling = None
            if fut.cancelled() or fut.exception() is not None:
                self.contexts.discard(ctx)

    @staticmethod
    def _depend(rec: _TaskRecord, ctx: CachedContext, longer: bool = False) -> None:
        """The task forks `ctx`: if a pipelined fill is still computing its KV, the task depends on it (that
        fill failing, the fork fails too, and the task reports the fill's error). `longer`: `ctx` holds more
        than this task needs (another task's longer prompt): whatever stopped its fill, the task runs again
        (`_run_task`)."""
        fut = ctx.filling
        if fut is not None and not fut.done() and fut not in rec.fills:
            rec.fills.append(fut)
            if longer:
                rec.others.add(fut)

    # ---- plain completions (OpenAI-compatible API) ---------------------------------------------
    def complete(self, pieces: Sequence[str] | Sequence[list[int]], sampling: SamplingParams,
                 criterion: Criterion = "latency", shared: int = 1,
                 prompt_logprobs: int | None = None, tokens: list[list[int]] | None = None,
                 arrived: float | None = None, cache_salt: str | None = None,
                 client: int | None = None) -> asyncio.Queue:
        """Schedule a plain completion of "".join(pieces) through the same scheduler and context cache.
        Piece boundaries are where prefixes can be shared (e.g. chat messages); the first `shared`
        pieces are kept as global contexts for later requests (a system prompt). With prefix sharing on,
        the whole prompt (and its block checkpoints) stays cached too, evicted least recently used;
        without, the rest is freed when the completion ends. With `prompt_logprobs` (n alternatives) the
        prompt is computed afresh instead, for its tokens' logprobs (`_scored_prompt`).
        The pieces are all text (tokenized together, `encode_pieces`) or all token ids (lists of ints: the
        prompt is their concatenation exactly as given, no BOS added; the prefix cache matches them as it
        does any tokens). `tokens`: `prompt_tokens(pieces)` where the caller has them already (a front end
        that counted them), so a prompt is tokenized once. `arrived`: when the request arrived
        (`time.perf_counter()`), where the serve layer's time for it starts (default: now). `cache_salt`
        (vLLM's): the prompt shares cached prefixes only with requests of the same salt. `client`: the API key it
        came with (its index), whose waiting completions `max_queued_completions_per_key` bounds. Returns a queue
        receiving text deltas (with prompt_logprobs, a PromptLogprobs first), then a CompletionResult or an
        error."""
        clock = TaskClock() if arrived is None else TaskClock(ready=arrived)
        if not any(pieces):
            raise InvalidRequestError("the prompt is empty")
        if not self.engines.live_engines():
            if self.engine_processes is not None and self.engine_processes.all_given_up:
                raise EngineUnavailableError("every engine process of this server stopped for good (its log says "
                                             "why): restart the server")
            raise EngineUnavailableError("no engine is live: start one (parrot engine --serve-core URL) or wait")
        pending = len(self.scheduler.queue)
        if pending >= self.config.max_queued_completions:
            raise RateLimitError(f"{pending} completions are waiting for an engine (limit "
                                 f"{self.config.max_queued_completions}): retry later", self.config.retry_after_s)
        per_key = self.config.max_queued_completions_per_key
        if client is not None and per_key is not None:
            own = sum(1 for task in self.scheduler.queue  # its completions (its sessions' chains carry it too)
                      if task.client == client and isinstance(task.payload, _PlainRecord))
            if own >= per_key:
                raise RateLimitError(f"{own} completions of this API key are waiting for an engine (limit {per_key} "
                                     "a key): retry later", self.config.retry_after_s)
        token_pieces = self.prompt_tokens(pieces) if tokens is None else tokens
        flat = [t for piece in token_pieces for t in piece]
        if not flat:
            raise InvalidRequestError(EMPTY_TOKENS)
        owner = f"completion-{uuid.uuid4().hex[:12]}"
        boundaries, owners, n = [], [], 0
        for i, piece in enumerate(token_pieces):
            n += len(piece)
            if piece:
                boundaries.append(n)
                # automatic prefix caching: the whole prompt stays cached (a global context, evicted least
                # recently used); only the generated context is the completion's own
                owners.append(None if i < shared or self.prefix_sharing else owner)
        queue: asyncio.Queue = asyncio.Queue()
        rec = _PlainRecord(self._seeded(sampling), owners, owner, created=clock.ready, clock=clock, queue=queue,
                           priority=self._priority(criterion), client=self._engine_client(client),
                           prompt_logprobs=prompt_logprobs)
        task = CompletionTask(owner, flat, boundaries, criterion, payload=rec, salt=salt_digest(cache_salt),
                              client=client)
        self._completions[queue] = task
        self.scheduler.submit(task)
        self._dispatch()
        return queue

    def prompt_tokens(self, pieces: Sequence[str] | Sequence[list[int]]) -> list[list[int]]:
        """The token ids of each piece of a plain completion's prompt: text pieces tokenized together
        (`encode_pieces`), token-id pieces as given (checked against the vocabulary, never re-encoded).
        Raises InvalidRequestError for an empty prompt, pieces mixing text and ids, or ids outside the
        vocabulary."""
        if all(isinstance(p, str) for p in pieces):
            if not "".join(pieces):  # type: ignore[arg-type]
                raise InvalidRequestError("the prompt is empty")
            encoded = self.tokenizers.encode_pieces(self.model, pieces)  # type: ignore[arg-type]
            if not any(encoded):
                raise InvalidRequestError(EMPTY_TOKENS)
            return encoded
        if not all(isinstance(p, list | tuple) for p in pieces):
            raise InvalidRequestError("a prompt's pieces are all text or all token ids, not both")
        token_pieces = [list(p) for p in pieces]
        if not any(token_pieces):
            raise InvalidRequestError("the prompt is empty")
        vocab = self.tokenizers.get(self.model).backend.get_vocab_size()
        bad = [t for p in token_pieces for t in p
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (ids 0 to {vocab - 1})")
        return token_pieces

    def cancel_completion(self, queue: asyncio.Queue, why: str = "the client disconnected") -> bool:
        """Cancel the plain completion feeding `queue` (from `complete`) unless it is over: it leaves the
        queue, or is aborted on its engine. True when it was cancelled."""
        task = self._completions.get(queue)
        return task is not None and self._cancel_task(task, f"aborted: {why}")

    async def run_completion(self, pieces: Sequence[str] | Sequence[list[int]], sampling: SamplingParams,
                             criterion: Criterion = "latency",
                             shared: int = 1) -> AsyncIterator[str | CompletionResult]:
        """Yield text deltas, then the CompletionResult; raises the ParrotError of a failure."""
        queue = self.complete(pieces, sampling, criterion, shared)
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, CompletionResult):
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:  # the consumer stopped early
                self.cancel_completion(queue)

    # ---- engine failure -----------------------------------------------------------------------
    async def _on_engine_dead(self, name: str) -> None:
        self.engine_deaths[name] += 1  # once per death (the manager calls back once per live -> dead)
        self._engine_gone(name)

    async def _on_engine_back(self, name: str, same_run: bool) -> None:
        """A dead engine is live again: free what it may still hold (the same run), or nothing (a new run)."""
        orphans = self._orphans.pop(name, set())
        if same_run and orphans:
            log.info("freeing %d context(s) engine %s held when it was taken for dead", len(orphans), name)
            for context_id in orphans:
                self._spawn(self._free_context_id(name, context_id))

    async def _on_engine_forgotten(self, name: str) -> None:
        self.engine_deaths.pop(name, None)
        self._orphans.pop(name, None)

    def _engine_gone(self, name: str) -> None:
        """Forget the engine's contexts and run its unfinished tasks elsewhere."""
        for ctx in self.contexts.release_engine(name):
            self._orphans.setdefault(name, set()).add(ctx.context_id)
        requeued = self.scheduler.engine_dead(name)
        self.redispatched += len(requeued)
        if requeued:
            log.warning("re-dispatching %d task(s) of dead engine %s", len(requeued), name)
        self._dispatch()

    def inspect(self, session: Session) -> dict:
        return {
            "session_id": session.session_id,
            "variables": [v.to_json(with_content=True) for v in self.vars.session_variables(session.session_id)],
            "requests": session.requests,
            "generations": list(session.generations),
            "graph": session.executor.graph.to_json(),
            "idle_seconds": session.idle_seconds(),
            "now": time.time(),
        }

