"""Prometheus metrics of the serve core: `GET /metrics` in the Prometheus text format.

Each `ParrotMetrics` has its own `CollectorRegistry` (never the process-global one), so several apps can
live in one process (tests do). Names follow vLLM / SGLang (`<namespace>:<name>`), and every sample carries
vLLM's `model_name` label (the first `--served-model-name`, else the model as given) beside those below:

Observed (histograms / counters fed through the `observe_*` API below):
  parrot:time_to_first_token_seconds     request arrival -> first non-empty text delta
  parrot:time_per_output_token_seconds   per request: (last delta - first delta) / (completion tokens - 1)
  parrot:inter_token_latency_seconds     gap between consecutive text deltas (a delta is usually one token)
  parrot:e2e_request_latency_seconds     request arrival -> CompletionResult
  parrot:request_queue_time_seconds      task submitted to the GlobalScheduler -> placed on an engine
  parrot:request_success_total{endpoint, finished_reason}, parrot:request_failure_total{endpoint}
                                         (finished_reason "abort": the client went away first, as in vLLM;
                                         a task re-run after its engine died counts once, by its re-run)
  parrot:prompt_tokens_total, parrot:generation_tokens_total

Computed at scrape time from the core (a custom collector, read on the event loop):
  parrot:num_requests_running / parrot:num_requests_waiting   tasks dispatched / queued in the scheduler
  parrot:engine_num_requests_running{engine} / ..._waiting{engine}   from each engine's RuntimeInfo
  parrot:kv_cache_usage_perc{engine}     used fraction (0..1, as vLLM) of the engine's KV pages, from its
                                         latest heartbeat / ping (`core.engines.runtime(name)`); engines
                                         that have not reported yet are left out
  parrot:kv_cache_written_pages{engine}  KV pages the engine handed out and did not give back since: on a CPU,
                                         where its lazily zeroed pool is resident (times engine_info's kv_bytes /
                                         kv_pages: bytes); free pages go back to the OS after the engine idles
  parrot:kv_cache_released_pages_total{engine}  free KV pages given back to the OS so far
  parrot:prefix_cache_hit_rate           `core.contexts.hit_rate` (cached / looked-up prompt tokens)
  parrot:prefix_cache_queries_total, parrot:prefix_cache_hits_total   those token counts
  parrot:engines_live, parrot:num_sessions, parrot:variable_bytes, parrot:num_cached_contexts (with several
  API keys also parrot:api_key_sessions, parrot:api_key_requests_waiting and parrot:api_key_requests_running,
  labelled by the key's place)
  parrot:aborted_requests_total          generations cancelled because their clients went away (a
                                         disconnected OpenAI stream or variable stream), queued or running
  parrot:engine_aborts_total{engine}     primitives each engine aborted (its RuntimeInfo)
  parrot:engine_compiled_shapes{engine} / parrot:engine_total_shapes{engine}   warm-up progress
  parrot:engine_warmup_seconds{engine} / parrot:engine_startup_seconds{engine}   engine start / process
                                         start to every shape compiled
  parrot:engine_resident_memory_bytes{engine}   the engine process's resident memory
  parrot:engine_step_ms{engine} / parrot:engine_host_ms{engine}   median wall / host time of recent steps
  parrot:engine_ahead_steps_total{engine}   steps launched while the previous one ran (overlap)
  parrot:engine_mixed_steps_total{engine}   steps that ran decodes and prompt chunks in one pass (mixed steps)
  parrot:engine_multi_step_launches_total{engine}   calls that ran several decode steps (multi-step decode)
  parrot:engine_spec_draft_tokens_total{engine}     draft tokens fed for verification (speculative decoding)
  parrot:engine_spec_accepted_tokens_total{engine}  draft tokens the model confirmed
  parrot:engine_decode_bursts_total{engine}   decode-only bursts between prompt steps (--decode-bursts)
  parrot:engine_preemptions_total{engine} / parrot:engine_priority_preemptions_total{engine}   running sequences
                                         preempted (KV dropped, recomputed later); of them, for more urgent work
  parrot:engine_fair_preemptions_total{engine}   of them, to give an API key its share of a full batch
  parrot:engine_held_steps_total{engine}   steps planned while throughput prompts waited for latency-critical
                                         decodes (--throughput-hold-ms)
  parrot:engine_info{engine, platform, weights, kv_dtype, kv_pages, ...}   the engine's device settings (1)
  parrot:engine_process_up{engine} / parrot:engine_process_restarts_total{engine}   the engine processes
                                         `parrot serve --engines N` started: running (1) or not, restarts
  parrot:overload_retries_total          tasks re-queued after an engine had no KV space for them
  parrot:engine_deaths_total{engine}     times each engine was taken for dead (gone with an engine forgotten)
  parrot:redispatched_tasks_total        unfinished tasks of dead engines run again on the others
  parrot:serve_first_primitive_seconds   the serve layer's own time per task (parrot/serve/serve_time.py):
                                         ready -> its first engine primitive sent
  parrot:serve_between_primitives_seconds   one primitive of a task done -> its next one sent

Who observes what: the OpenAI-compatible routes (parrot/frontend/openai_api.py) time every choice with
`start_request()` -> `RequestTimer.delta()` / `.finish()` / `.fail()` / `.abort()`. Queue time is observed for every
task the core schedules (semantic calls too) by wrapping the core's `scheduler.schedule` on the instance
(`hook_scheduler`, on by default); if the core ever calls `observe_queue_time` itself, construct
`ParrotMetrics(core, hook_scheduler=False)`. Other callers (e.g. the core's semantic-variable path) can
use `start_request(endpoint)` the same way, or the raw `observe_ttft / observe_inter_token /
observe_tpot / observe_e2e / observe_queue_time / observe_tokens` methods. All of them must be called on
the core's event loop or any single thread (prometheus_client metrics are thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from parrot.protocol import RuntimeInfo
from parrot.serve.core import ParrotServeCore

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0, 600.0)


class _CoreCollector(Collector):
    """Gauges read from the core at scrape time."""

    def __init__(self, core: ParrotServeCore) -> None:
        self.core = core

    def describe(self) -> list[Metric]:
        return []  # nothing to check for duplicates at registration; names are fixed below

    def collect(self) -> Iterator[Metric]:
        core = self.core
        sched = core.scheduler
        yield GaugeMetricFamily("parrot:num_requests_running", "Completion tasks dispatched to engines.",
                                value=len(sched.running))
        yield GaugeMetricFamily("parrot:num_requests_waiting", "Completion tasks queued in the scheduler.",
                                value=len(sched.queue))
        live = core.engines.live_engines()
        yield GaugeMetricFamily("parrot:engines_live", "Engines currently live.", value=len(live))
        usage = GaugeMetricFamily("parrot:kv_cache_usage_perc",
                                  "Fraction (0..1) of the engine's KV cache pages in use.", labels=["engine"])
        running = GaugeMetricFamily("parrot:engine_num_requests_running",
                                    "Sequences the engine reports running.", labels=["engine"])
        waiting = GaugeMetricFamily("parrot:engine_num_requests_waiting",
                                    "Sequences the engine reports waiting.", labels=["engine"])
        written = GaugeMetricFamily("parrot:kv_cache_written_pages", "KV pages the engine handed out and did not "
                                    "give back since (on a CPU, where its pool is resident).", labels=["engine"])
        released = CounterMetricFamily("parrot:kv_cache_released_pages", "Free KV pages the engine gave back to "
                                       "the OS after idling.", labels=["engine"])
        for client in live:
            info = core.engines.runtime(client.name)
            if info is None:
                continue
            used = 1.0 - info.free_pages / info.total_pages if info.total_pages else 0.0
            usage.add_metric([client.name], min(1.0, max(0.0, used)))
            running.add_metric([client.name], info.running)
            waiting.add_metric([client.name], info.waiting)
            written.add_metric([client.name], info.written_pages)
            released.add_metric([client.name], info.released_pages)
        yield usage
        yield running
        yield waiting
        yield written
        yield released
        contexts = core.contexts
        yield GaugeMetricFamily("parrot:prefix_cache_hit_rate",
                                "Fraction of prompt tokens served from cached prefix contexts.",
                                value=contexts.hit_rate)
        yield CounterMetricFamily("parrot:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=contexts.lookup_tokens)
        yield CounterMetricFamily("parrot:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=contexts.hit_tokens)
        yield GaugeMetricFamily("parrot:num_cached_contexts", "KV contexts the core keeps track of.",
                                value=len(contexts.contexts()))
        yield GaugeMetricFamily("parrot:num_sessions", "Open Parrot sessions.", value=len(core.sessions))
        yield from _key_metrics(core)
        yield GaugeMetricFamily("parrot:variable_bytes", "UTF-8 bytes of text all semantic variables hold.",
                                value=core.vars.held)
        yield CounterMetricFamily("parrot:aborted_requests", "Generations cancelled because their clients went "
                                  "away.", value=core.aborts)
        yield CounterMetricFamily("parrot:overload_retries", "Tasks re-queued after an engine had no KV space.",
                                  value=core.overload_retries)
        yield CounterMetricFamily("parrot:redispatched_tasks", "Unfinished tasks of dead engines run again elsewhere.",
                                  value=core.redispatched)
        deaths = CounterMetricFamily("parrot:engine_deaths", "Times the engine was taken for dead (it stopped "
                                     "answering, its process exited, a request failed as engine_unavailable).",
                                     labels=["engine"])
        for name, n in sorted(core.engine_deaths.items()):
            deaths.add_metric([name], n)
        yield deaths
        engine_aborts = CounterMetricFamily("parrot:engine_aborts", "Primitives the engine aborted.",
                                            labels=["engine"])
        for client in live:
            info = core.engines.runtime(client.name)
            if info is not None:
                engine_aborts.add_metric([client.name], info.aborts)
        yield engine_aborts
        yield from _warmup_metrics(core)
        yield from _step_metrics(core)
        yield from _process_metrics(core)
        for name, hist, doc in (
                ("parrot:serve_first_primitive_seconds", core.serve_time.first,
                 "Serve layer's own time per task: ready (inputs set, output needed) -> first engine primitive sent."),
                ("parrot:serve_between_primitives_seconds", core.serve_time.gap,
                 "Serve layer's own time per task: a primitive done -> the task's next primitive sent.")):
            yield HistogramMetricFamily(name, doc, buckets=hist.cumulative(), sum_value=hist.total)


def _key_metrics(core: ParrotServeCore) -> Iterator[Metric]:
    """Per API key where the server has several (each a client, named by its place in the list, never by its
    text): its open sessions, its completion tasks waiting for an engine and those running on one (the turns the
    scheduler gives the keys, `GlobalScheduler._fair`)."""
    keys = len(core.config.api_keys)
    if keys < 2:
        return
    sessions = GaugeMetricFamily("parrot:api_key_sessions", "Open sessions of the API key (its place in the list).",
                                 labels=["key"])
    waiting = GaugeMetricFamily("parrot:api_key_requests_waiting", "Completion tasks of the API key (its place in "
                                "the list) queued in the scheduler.", labels=["key"])
    running = GaugeMetricFamily("parrot:api_key_requests_running", "Completion tasks of the API key (its place in "
                                "the list) dispatched to an engine and not finished.", labels=["key"])
    held, queued, dispatched = [0] * keys, [0] * keys, [0] * keys
    for session in core.sessions.values():
        if session.owner is not None:
            held[session.owner] += 1
    for tasks, counts in ((core.scheduler.queue, queued), (core.scheduler.running.values(), dispatched)):
        for task in tasks:
            if task.client is not None:
                counts[task.client] += 1
    for i in range(keys):
        sessions.add_metric([str(i)], held[i])
        waiting.add_metric([str(i)], queued[i])
        running.add_metric([str(i)], dispatched[i])
    yield sessions
    yield waiting
    yield running


def _warmup_metrics(core: ParrotServeCore) -> Iterator[Metric]:
    """Each engine's start-up: shapes compiled of all, seconds to warm, process age then, memory."""
    compiled = GaugeMetricFamily("parrot:engine_compiled_shapes", "Step shapes the engine has compiled.",
                                 labels=["engine"])
    total = GaugeMetricFamily("parrot:engine_total_shapes", "Step shapes the engine compiles while warming up.",
                              labels=["engine"])
    warm = GaugeMetricFamily("parrot:engine_warmup_seconds", "Engine start to every shape compiled (set once "
                             "warm).", labels=["engine"])
    uptime = GaugeMetricFamily("parrot:engine_startup_seconds", "Engine process start to every shape compiled "
                               "(set once warm).", labels=["engine"])
    rss = GaugeMetricFamily("parrot:engine_resident_memory_bytes", "Resident memory of the engine's process.",
                            labels=["engine"])
    for name, info in _runtimes(core):
        compiled.add_metric([name], info.compiled_shapes)
        total.add_metric([name], info.total_shapes)
        for family, value in ((warm, info.warmup_s), (uptime, info.process_uptime_s), (rss, info.rss_bytes)):
            if value is not None:
                family.add_metric([name], value)
    yield from (compiled, total, warm, uptime, rss)


def _process_metrics(core: ParrotServeCore) -> Iterator[Metric]:
    """The engine processes this server started (`--engines N`): up or not, restarts."""
    if core.engine_processes is None:
        return
    up = GaugeMetricFamily("parrot:engine_process_up", "1 while the engine process this server started runs; 0 "
                           "while it waits to be started again or was given up.", labels=["engine"])
    restarts = CounterMetricFamily("parrot:engine_process_restarts", "Times the server started the engine process "
                                   "again after it exited.", labels=["engine"])
    for p in core.engine_processes.status():
        up.add_metric([str(p["name"])], 1 if p["state"] == "running" else 0)
        restarts.add_metric([str(p["name"])], float(p["restarts"]))  # type: ignore[arg-type]
    yield from (up, restarts)


def _runtimes(core: ParrotServeCore) -> Iterator[tuple[str, RuntimeInfo]]:
    """Each live engine's name and latest runtime info (engines that have not reported yet are left out)."""
    for client in core.engines.live_engines():
        info = core.engines.runtime(client.name)
        if info is not None:
            yield client.name, info


def _step_metrics(core: ParrotServeCore) -> Iterator[Metric]:
    """Each engine's recent step: wall milliseconds, the host's share, steps launched ahead (overlap)."""
    step = GaugeMetricFamily("parrot:engine_step_ms", "Median wall time of the engine's recent steps.",
                             labels=["engine"])
    host = GaugeMetricFamily("parrot:engine_host_ms", "Median host time of the engine's recent steps: scheduling, "
                             "batch building and applying tokens, outside the device calls.", labels=["engine"])
    ahead = CounterMetricFamily("parrot:engine_ahead_steps", "Steps the engine launched while the previous one "
                                "ran (overlap).", labels=["engine"])
    mixed = CounterMetricFamily("parrot:engine_mixed_steps", "Steps the engine ran decodes and prompt chunks in one "
                                "pass over the weights (mixed steps).", labels=["engine"])
    multi = CounterMetricFamily("parrot:engine_multi_step_launches", "Calls the engine ran several decode steps "
                                "in (multi-step decode).", labels=["engine"])
    bursts = CounterMetricFamily("parrot:engine_decode_bursts", "Decode-only bursts the engine ran between prompt "
                                 "steps (decode bursts).", labels=["engine"])
    held = CounterMetricFamily("parrot:engine_held_steps", "Steps the engine planned while throughput prompts "
                               "waited for latency-critical decodes (throughput hold).", labels=["engine"])
    preempted = CounterMetricFamily("parrot:engine_preemptions", "Running sequences whose KV the engine dropped to "
                                    "recompute later (for KV space, or for more urgent work).", labels=["engine"])
    yielded = CounterMetricFamily("parrot:engine_priority_preemptions", "Of those, the ones that made room in a full "
                                  "batch for more urgent (latency-critical) work.", labels=["engine"])
    shared = CounterMetricFamily("parrot:engine_fair_preemptions", "Of those, the ones that gave an API key (a client) "
                                 "its share of a full batch another key ran more of.", labels=["engine"])
    drafted = CounterMetricFamily("parrot:engine_spec_draft_tokens", "Draft tokens the engine fed for verification "
                                  "(speculative decoding by prompt lookup).", labels=["engine"])
    accepted = CounterMetricFamily("parrot:engine_spec_accepted_tokens", "Draft tokens the samples after them "
                                   "confirmed (speculative decoding: decode steps saved).", labels=["engine"])
    settings = GaugeMetricFamily("parrot:engine_info", "What the engine runs with on its device (value 1).",
                                 labels=["engine", "platform", "weights", "kv_dtype", "kv_pages", "max_batch_size",
                                         "max_num_batched_tokens", "overlap", "tensor_parallel_size", "cpu_matmul"])
    keys = ("platform", "weights", "kv_dtype", "kv_pages", "max_batch_size", "max_num_batched_tokens", "overlap",
            "tensor_parallel_size", "cpu_matmul")
    for name, info in _runtimes(core):
        step.add_metric([name], info.recent_step_ms)
        host.add_metric([name], info.recent_host_ms)
        ahead.add_metric([name], info.ahead_steps)
        mixed.add_metric([name], info.mixed_steps)
        multi.add_metric([name], info.multi_step_launches)
        bursts.add_metric([name], info.decode_bursts)
        held.add_metric([name], info.held_steps)
        preempted.add_metric([name], info.preemptions)
        yielded.add_metric([name], info.priority_preemptions)
        shared.add_metric([name], info.fair_preemptions)
        drafted.add_metric([name], info.spec_draft_tokens)
        accepted.add_metric([name], info.spec_accepted_tokens)
        if info.settings:
            settings.add_metric([name, *(str(info.settings.get(k, "")) for k in keys)], 1)
    yield from (step, host, ahead, mixed, multi, bursts, held, preempted, yielded, shared, drafted, accepted, settings)


class RequestTimer:
    """Times one generated sequence (one choice). Call `delta()` for each non-empty text delta as it
    arrives, then `finish(...)` or `fail()` once."""

    def __init__(self, metrics: ParrotMetrics, endpoint: str, start: float | None = None) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.start = time.perf_counter() if start is None else start
        self.first: float | None = None
        self.last: float | None = None
        self.done = False

    def delta(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first is None:
            self.first = now
            self.metrics.observe_ttft(now - self.start)
        else:
            self.metrics.observe_inter_token(now - self.last)
        self.last = now

    def finish(self, prompt_tokens: int, completion_tokens: int, finish_reason: str,
               now: float | None = None) -> None:
        if self.done:
            return
        self.done = True
        now = time.perf_counter() if now is None else now
        if self.first is None:  # nothing streamed (e.g. an immediate EOS): first output is the result
            self.metrics.observe_ttft(now - self.start)
        elif completion_tokens > 1 and self.last is not None:
            self.metrics.observe_tpot((self.last - self.first) / (completion_tokens - 1))
        self.metrics.observe_e2e(now - self.start)
        self.metrics.observe_tokens(prompt_tokens, completion_tokens)
        self.metrics.request_success.labels(self.endpoint, finish_reason).inc()

    def fail(self) -> None:
        if not self.done:
            self.done = True
            self.metrics.request_failure.labels(self.endpoint).inc()

    def abort(self) -> None:
        """The client went away (or the session was deleted) before the end: not a failure of the server's.
        Counted as vLLM counts it, `request_success_total{finished_reason="abort"}`, with no latency."""
        if not self.done:
            self.done = True
            self.metrics.request_success.labels(self.endpoint, "abort").inc()


class _ModelNamed(Collector):
    """Every metric of `inner` with a `model_name` label on each sample, as vLLM's (its dashboards select by it):
    the first name the served model answers to."""

    def __init__(self, inner: CollectorRegistry, model_name: str) -> None:
        self.inner = inner
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            named = Metric(family.name, family.documentation, family.type, family.unit)
            named.samples = [s._replace(labels={"model_name": self.model_name, **s.labels}) for s in family.samples]
            yield named


class ParrotMetrics:
    def __init__(self, core: ParrotServeCore, *, hook_scheduler: bool = True) -> None:
        self.core = core
        self.registry = CollectorRegistry(auto_describe=False)  # the metrics, unlabelled
        self.exposed = CollectorRegistry(auto_describe=False)  # ... as /metrics shows them: model_name on each
        self.exposed.register(_ModelNamed(self.registry, core.served_model_names[0]))
        r = self.registry
        self.ttft = Histogram("parrot:time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("parrot:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("parrot:inter_token_latency_seconds", "Time between consecutive text deltas.",
                             buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("parrot:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("parrot:request_queue_time_seconds",
                                    "Time a completion task waited in the scheduler before dispatch.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.request_success = Counter("parrot:request_success", "Finished requests (per generated choice).",
                                       ["endpoint", "finished_reason"], registry=r)
        self.request_failure = Counter("parrot:request_failure", "Requests (choices) that failed.",
                                       ["endpoint"], registry=r)
        self.prompt_tokens = Counter("parrot:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("parrot:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        r.register(_CoreCollector(core))
        if hook_scheduler:
            self._hook_scheduler()
        core.request_timer = self.start_request  # semantic-call generations are timed too

    # ---- observation API ------------------------------------------------------------------------
    def start_request(self, endpoint: str, start: float | None = None) -> RequestTimer:
        """A timer for one generated sequence; `start` is a time.perf_counter() value (default: now)."""
        return RequestTimer(self, endpoint, start)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(max(0.0, seconds))

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(max(0.0, seconds))

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(max(0.0, seconds))

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(max(0.0, seconds))

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(max(0.0, seconds))

    def observe_tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generation_tokens.inc(max(0, completion_tokens))

    def _hook_scheduler(self) -> None:
        """Observe queue time of every task the scheduler places (arrival is time.monotonic())."""
        scheduler = self.core.scheduler
        inner = scheduler.schedule

        def schedule():  # noqa: ANN202 - same signature as GlobalScheduler.schedule
            placed = inner()
            now = time.monotonic()
            for task in placed:
                self.observe_queue_time(now - task.arrival)
            return placed

        scheduler.schedule = schedule

    # ---- exposition -----------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.exposed)

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/metrics", include_in_schema=False)
        async def metrics() -> Response:  # async: reads core state on the event loop that mutates it
            return Response(self.render(), media_type=CONTENT_TYPE_LATEST)

        return router
