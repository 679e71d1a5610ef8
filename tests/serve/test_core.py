"""ParrotServeCore without engines: sessions, expiry, variable binding, global constants, laziness."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from parrot.config import ServeConfig
from parrot.errors import (
    ConflictError,
    GenerationFailedError,
    InvalidRequestError,
    KVCacheFullError,
    NotFoundError,
    ParrotError,
    RateLimitError,
)
from parrot.protocol import (
    FillRequest,
    FillResponse,
    FreeContextResponse,
    GenerateRequest,
    GenerateResponse,
    NativeCallRequest,
    NativeInput,
    RuntimeInfo,
    SamplingParams,
    SemanticCallParameter,
    SemanticCallRequest,
    StreamChunk,
)
from parrot.serve.core import ParrotServeCore
from parrot.serve.engines import EngineClient
from parrot.serve.session import AuthError, ForbiddenError
from parrot.serve.tokenizers import TokenizerManager
from tests.conftest import tiny_tokenizer


def make_core(**kw) -> ParrotServeCore:
    tokenizers = TokenizerManager()
    tokenizers.register("tiny", tiny_tokenizer())
    return ParrotServeCore(model="tiny", tokenizers=tokenizers, **kw)


@contextlib.asynccontextmanager
async def started_core(engine: EngineClient, **cfg: object) -> AsyncIterator[ParrotServeCore]:
    """A started core on `engine` (ServeConfig(model="tiny", **cfg)), stopped on the way out."""
    core = make_core(config=ServeConfig(model="tiny", **cfg))  # type: ignore[arg-type]
    core.engines.register(engine)
    await core.start()
    try:
        yield core
    finally:
        await core.stop()


def test_sessions_auth_and_expiry() -> None:
    async def run() -> None:
        core = make_core(session_ttl=0.4)
        await core.start()
        try:
            s = core.create_session()
            with pytest.raises(AuthError):
                core.get_session(s.session_id, None)
            with pytest.raises(ForbiddenError):
                core.get_session(s.session_id, "wrong")
            assert core.get_session(s.session_id, s.token) is s
            var = core.create_var(s, "x", None)
            await asyncio.sleep(1.2)
            with pytest.raises(NotFoundError):
                core.get_session(s.session_id, s.token)
            assert var.is_failed and "session ended" in (var.error or "")
        finally:
            await core.stop()

    asyncio.run(run())


def test_leading_text_is_a_global_constant_shared_across_sessions() -> None:
    core = make_core()
    a, b = core.create_session(), core.create_session()
    system = "You are a helpful assistant. " * 4
    req = {"template": system + "Q: {{q}} A: {{a}}", "parameters": [
        SemanticCallParameter(name="q", value="hi"), SemanticCallParameter(name="a", is_output=True)]}
    core.semantic_call(a, SemanticCallRequest(session_id=a.session_id, **req))
    core.semantic_call(b, SemanticCallRequest(session_id=b.session_id, **req))
    const_a = [c for c in a.executor.graph.chains[0].fills if c.var.is_constant or c.var.session_id is None]
    const_b = [c for c in b.executor.graph.chains[0].fills if c.var.is_constant or c.var.session_id is None]
    assert const_a[0].var is const_b[0].var  # one variable, one KV context, for both sessions
    assert const_a[0].var.session_id is None
    # lazy: nothing was scheduled, since nobody read the output and no output_criteria was given
    assert not core.scheduler.queue and not core.scheduler.running


def test_output_criteria_runs_without_a_get() -> None:
    core = make_core()
    s = core.create_session()
    core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}", output_criteria="latency",
                                              parameters=[SemanticCallParameter(name="a", is_output=True)]))
    assert len(core.scheduler.queue) == 1  # no engine yet: queued, with its criterion
    assert core.scheduler.queue[0].criterion == "latency"


def test_a_call_naming_models_runs_only_where_one_of_them_is_served() -> None:
    """`models` (the Parrot paper's semantic functions name theirs): a call naming one of the served model's
    names is taken; one naming none of them is a 404 when it arrives, with nothing created."""
    core = make_core(config=ServeConfig(served_model_names=("smol", "chat")))
    s = core.create_session()

    def call(models: list[str] | None) -> None:
        core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}", models=models,
                                                  output_criteria="latency",
                                                  parameters=[SemanticCallParameter(name="a", is_output=True)]))

    call(["other", "chat"])
    call(None)
    assert len(core.scheduler.queue) == 2
    with pytest.raises(NotFoundError, match="none of the call's models \\['tiny'\\].*'smol', 'chat'"):
        call(["tiny"])
    assert len(core.scheduler.queue) == 2 and len(s.requests) == 2
    assert make_core().served_model_names == ("tiny",)

# ---- engine errors by code: overload retried, failed generates freed, capacity from the engine ----------
class ScriptedEngine(EngineClient):
    """An in-memory engine whose generates fail as scripted (a list of exceptions, then success)."""

    def __init__(self, failures: list[Exception], max_batch_size: int | None = None) -> None:
        self.name, self.url, self.model, self.max_context_len = "fake", None, "tiny", 4096
        self.max_batch_size = max_batch_size
        self.failures = failures
        self.freed: list[str] = []
        self.generated: list[str] = []

    async def fill(self, req: FillRequest) -> FillResponse:
        return FillResponse(context_id=req.context_id, num_tokens=len(req.token_ids))

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        raise NotImplementedError

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        self.generated.append(req.context_id)
        yield StreamChunk(token_id=65, text="A")
        if self.failures:
            raise self.failures.pop(0)
        yield StreamChunk(token_id=66, text="B", finish_reason="length")

    async def free_context(self, context_id: str) -> FreeContextResponse:
        self.freed.append(context_id)
        return FreeContextResponse(context_id=context_id, freed_pages=1)

    async def ping(self) -> RuntimeInfo:
        return RuntimeInfo(model="tiny", max_context_len=4096, page_size=16, total_pages=8, free_pages=8,
                           num_contexts=0, num_cached_tokens=0, running=0, waiting=0, recent_step_ms=0.0, steps=0,
                           shape_misses=0, preemptions=0, evictions=0, cascade_steps=0)


def _run_one(engine: ScriptedEngine, **cfg: object) -> tuple[ParrotServeCore, str | None, str | None]:
    async def run() -> tuple[ParrotServeCore, str | None, str | None]:
        async with started_core(engine, overload_backoff_s=0.01, **cfg) as core:  # type: ignore[arg-type]
            s = core.create_session()
            out = core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}",
                                                            parameters=[SemanticCallParameter(name="a",
                                                                                              is_output=True)]))
            var = core.vars.get(out.param_info[0].var_id, s.session_id)
            try:
                return core, await core.get_var(s, var.id, "latency", 5), None
            except ParrotError as exc:
                return core, None, str(exc)
            finally:
                await asyncio.sleep(0.05)  # background frees

    return asyncio.run(run())


def test_overloaded_engine_is_retried_and_failed_generates_are_freed() -> None:
    engine = ScriptedEngine([KVCacheFullError("no page", "fake"), KVCacheFullError("no page", "fake")])
    core, text, err = _run_one(engine)
    assert err is None and text == "AB"
    assert core.overload_retries == 2 and len(engine.generated) == 3
    assert engine.freed[:2] == engine.generated[:2]  # each refused generate's context was freed
    # a generation that fails for good fails its variable, and its context is freed too
    engine = ScriptedEngine([GenerationFailedError("boom")])
    core, text, err = _run_one(engine)
    assert text is None and "boom" in (err or "")
    assert engine.freed == engine.generated
    # out of retries: the overload is the variable's error
    engine = ScriptedEngine([KVCacheFullError("no page", "fake")] * 3)
    core, text, err = _run_one(engine, overload_retries=2)
    assert text is None and "no page" in (err or "")


class FailingFillEngine(ScriptedEngine):
    """An ordered engine (fills pipelined ahead of the generates forking them) whose fills fail, their errors
    reaching the core only after the generate's: the generate finds no parent context first."""

    ordered = True

    def send_fill(self, req: FillRequest) -> asyncio.Future[FillResponse]:
        fut: asyncio.Future[FillResponse] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.2, fut.set_exception, InvalidRequestError(
            f"context {req.context_id!r} would exceed the model's maximum length"))
        return fut

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        self.generated.append(req.context_id)
        raise NotFoundError(f"parent context {req.parent_context_id!r} does not exist")
        yield StreamChunk()  # an async generator


def test_a_generate_without_its_parent_fails_with_the_failed_fills_reason() -> None:
    core, text, err = _run_one(FailingFillEngine([]))
    assert text is None and "maximum length" in (err or ""), err


def test_scheduler_capacity_is_the_engines_own() -> None:
    core = make_core()
    core.engines.register(ScriptedEngine([], max_batch_size=3))
    assert [v.max_batch for v in core._engine_views()] == [3]
    core = make_core(config=ServeConfig(model="tiny", default_max_batch=7))
    core.engines.register(ScriptedEngine([]))
    assert [v.max_batch for v in core._engine_views()] == [7]


def test_no_app_awareness_turns_off_app_hints_but_keeps_prefix_caching() -> None:
    """`parrot serve --no-app-awareness` (bench system baseline-apc): FCFS scheduling and one engine priority
    for every task, with automatic prefix caching and cache-aware placement still on."""
    from parrot.cli import build_parser, serve_config_from_args

    cfg = serve_config_from_args(build_parser().parse_args(["serve", "--no-app-awareness"]))
    assert cfg.app_aware is False and cfg.prefix_sharing is True
    apc = make_core(config=cfg)
    assert apc.scheduler.app_aware is False and apc.scheduler.cache_aware is True and apc.prefix_sharing
    assert apc._priority("throughput") == apc._priority("latency") == 0
    aware = make_core()
    assert aware.scheduler.app_aware is True and aware._priority("throughput") == 1


class RecordingEngine(ScriptedEngine):
    """Generates take `delay` seconds; every generate's `waited_s` is recorded."""

    def __init__(self, delay: float) -> None:
        super().__init__([])
        self.delay = delay
        self.waited: list[float] = []

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        self.waited.append(req.waited_s)
        await asyncio.sleep(self.delay)
        yield StreamChunk(token_id=66, text="B", finish_reason="length")


STEP_S = 0.3  # each generate's time: the bounds below are halves of it, wide of a slow machine's scheduling


def _chain_of_three(app_aware: bool) -> list[float]:
    async def run() -> list[float]:
        engine = RecordingEngine(STEP_S)
        async with started_core(engine, app_aware=app_aware) as core:
            s = core.create_session()
            var_id = None
            for i in range(3):  # step i reads step i-1's output: the server runs the chain
                params = [SemanticCallParameter(name="out", is_output=True)]
                if var_id is not None:
                    params.append(SemanticCallParameter(name="prev", var_id=var_id))
                template = f"Step {i}: {{{{prev}}}} {{{{out}}}}" if var_id else "Step 0: {{out}}"
                out = core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template=template,
                                                                parameters=params))
                var_id = next(p.var_id for p in out.param_info if p.name == "out")
            await core.get_var(s, var_id, "latency", 5)
            assert not core._app_started  # the app's run is over
            return engine.waited

    return asyncio.run(run())


def test_an_apps_later_steps_keep_its_place_in_the_engine_queue() -> None:
    """App-FIFO: a chain's later steps reach the engine as having waited since the app's run began (so
    they go ahead of work that arrived after it); without app awareness, since each step became ready."""
    aware = _chain_of_three(True)
    assert aware[0] < STEP_S / 2 and aware[1] >= STEP_S and aware[2] >= 2 * STEP_S, aware
    plain = _chain_of_three(False)
    assert max(plain) < STEP_S / 2, plain


class FillRecordingEngine(ScriptedEngine):
    """Records how many tokens each fill carried."""

    def __init__(self) -> None:
        super().__init__([])
        self.fills: list[int] = []

    async def fill(self, req: FillRequest) -> FillResponse:
        self.fills.append(len(req.token_ids))
        return await super().fill(req)


@pytest.mark.parametrize(("system", "least", "pieces"), [
    ("Sys: ", 32, 1),  # a short global text: filled with the rest of the prompt, one engine step
    ("Sys: ", 0, 2),  # no minimum: a context kept after it, a fill of its own
    ("You are a helpful assistant. " * 4, 32, 2),  # long enough to be worth a context of its own
])
def test_no_context_is_kept_inside_a_prompt_before_min_prefix_cut_tokens(system: str, least: int, pieces: int) -> None:
    engine = FillRecordingEngine()

    async def run() -> None:
        async with started_core(engine, min_prefix_cut_tokens=least) as core:
            s = core.create_session()
            out = core.semantic_call(s, SemanticCallRequest(
                session_id=s.session_id, template=system + "Q: {{q}} A: {{a}}",
                parameters=[SemanticCallParameter(name="q", value="hi"),
                            SemanticCallParameter(name="a", is_output=True)]))
            var_id = next(p.var_id for p in out.param_info if p.name == "a")
            assert await core.get_var(s, var_id, "latency", 5) == "AB"

    asyncio.run(run())
    assert len(engine.fills) == pieces
    if pieces == 2:  # the leading constant text (up to the first variable) had a context of its own
        assert engine.fills[0] == len(tiny_tokenizer().encode(system + "Q: "))


def test_a_short_piece_after_a_cached_prefix_is_filled_with_the_rest() -> None:
    """Two concurrent calls share a cached global text and then a short value (a few tokens): the short
    shared piece is not a fill (an engine step) of its own, so each call fills everything after the global
    text in one piece; with no minimum, the short piece is filled once and kept for both."""

    def fills(least: int) -> list[int]:
        engine = FillRecordingEngine()
        system = "You are a helpful assistant. " * 4

        async def run() -> None:
            async with started_core(engine, min_prefix_cut_tokens=least) as core:
                def call(s, q: str, r: str) -> str:  # noqa: ANN001
                    out = core.semantic_call(s, SemanticCallRequest(
                        session_id=s.session_id, template=system + "Q: {{q}} {{r}} A: {{a}}",
                        parameters=[SemanticCallParameter(name="q", value=q), SemanticCallParameter(name="r", value=r),
                                    SemanticCallParameter(name="a", is_output=True)]))
                    return next(p.var_id for p in out.param_info if p.name == "a")

                first = core.create_session()
                await core.get_var(first, call(first, "warm", "up"), "latency", 5)  # the global text is cached
                engine.fills.clear()
                s = core.create_session()
                a, b = call(s, "hi", "one two three four five six seven"), call(s, "hi", "eight nine ten eleven")
                both = await asyncio.gather(core.get_var(s, a, "latency", 5), core.get_var(s, b, "latency", 5))
                assert both == ["AB", "AB"]  # both needed at once: they run concurrently

        asyncio.run(run())
        return engine.fills

    short = len(tiny_tokenizer().encode(" hi"))
    assert len(fills(32)) == 2 and min(fills(32)) > short + 1  # one fill each, from the cached global text
    no_minimum = fills(0)
    assert len(no_minimum) == 3 and sorted(no_minimum)[0] <= short + 1  # the shared piece once, then each


def test_min_prefix_cut_tokens_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="min_prefix_cut_tokens"):
        ServeConfig(model="tiny", min_prefix_cut_tokens=-1)




class PipelinedEngine(ScriptedEngine):
    """An ordered engine whose fills take 0.1 s, each after the fill of the context it forks; a fill of more
    than `most` tokens in all fails (too long for its KV pool), and so does everything forked from it."""

    ordered = True

    def __init__(self, most: int) -> None:
        super().__init__([])
        self.most = most
        self.contexts: dict[str, asyncio.Future[int]] = {}  # context -> its token count once filled

    def send_fill(self, req: FillRequest) -> asyncio.Future[FillResponse]:
        parent = self.contexts.get(req.parent_context_id) if req.parent_context_id else None
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.contexts[req.context_id] = done

        async def fill() -> FillResponse:
            try:
                base = 0 if parent is None else await parent
                if req.parent_context_id and parent is None:
                    raise NotFoundError(f"parent context {req.parent_context_id!r} does not exist")
                base = base if req.parent_num_tokens is None else req.parent_num_tokens
                await asyncio.sleep(0.1)
                if base + len(req.token_ids) > self.most:
                    raise InvalidRequestError(f"context {req.context_id!r} needs {base + len(req.token_ids)} "
                                              f"tokens of KV; the whole cache holds {self.most}")
            except ParrotError as exc:
                done.set_exception(exc)
                del self.contexts[req.context_id]
                raise
            done.set_result(base + len(req.token_ids))
            return FillResponse(context_id=req.context_id, num_tokens=base + len(req.token_ids))

        return asyncio.ensure_future(fill())

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        parent = self.contexts.get(req.parent_context_id)
        if parent is None or parent.cancelled() or (parent.done() and parent.exception() is not None):
            raise NotFoundError(f"parent context {req.parent_context_id!r} does not exist")
        await parent
        yield StreamChunk(token_id=66, text="B", finish_reason="length")


def test_a_prompt_forking_a_longer_prompt_whose_fill_fails_runs_again() -> None:
    """A second prompt that shares a first one's blocks forks the first's context while it is still being filled
    (the radix view's holder). The first is too long for the KV pool and fails; the second, which fits, runs
    again and answers (it failed with the first's error)."""
    from parrot.protocol import SamplingParams
    from parrot.serve.core import CompletionResult

    async def last(queue: asyncio.Queue) -> object:
        while not isinstance(item := await queue.get(), CompletionResult | BaseException):
            pass
        return item

    async def run() -> tuple[object, object]:
        async with started_core(PipelinedEngine(most=288), overload_backoff_s=0.01) as core:
            shared = "".join(chr(97 + i % 26) for i in range(224))
            sp = SamplingParams(max_tokens=1)
            first = core.complete([shared + "x" * 80], sp)
            await asyncio.sleep(0.02)  # its fill is on its way
            second = core.complete([shared + "y" * 20], sp)
            return await asyncio.wait_for(last(first), 10), await asyncio.wait_for(last(second), 10)

    first, second = asyncio.run(run())
    assert isinstance(first, ParrotError) and "the whole cache holds 288" in str(first), first
    assert isinstance(second, CompletionResult) and second.text == "B", second


# ---- what must never hang: an empty prompt, an internal fault, a cycle through a native call, a shutdown ------
class _FaultyEngine(ScriptedEngine):
    """Its stream breaks with an error no engine client should raise (a fault of the serve layer's own code)."""

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        raise RuntimeError("boom")
        yield StreamChunk()  # an async generator


def _call(core: ParrotServeCore, s, template: str, **inputs: str):  # noqa: ANN001, ANN202
    params = [SemanticCallParameter(name=n, var_id=v) for n, v in inputs.items()]
    out = core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template=template, parameters=[
        *params, SemanticCallParameter(name="a", is_output=True)]))
    return next(p.var_id for p in out.param_info if p.is_output)


def _upper(core: ParrotServeCore, s, var_id: str) -> str:  # noqa: ANN001
    """A native `upper` call reading `var_id`; its output variable's id."""
    native = core.native_call(s, NativeCallRequest(session_id=s.session_id, transform="upper", params={},
                                                   inputs={"text": NativeInput(var_id=var_id)}, outputs=["output"]))
    return native.param_info[-1].var_id


def test_an_empty_prompt_or_an_internal_fault_fails_the_call_instead_of_hanging() -> None:
    async def run() -> None:
        for engine, want in ((ScriptedEngine([]), "the prompt is empty"),
                             (_FaultyEngine([]), "internal error: RuntimeError: boom")):
            async with started_core(engine) as core:
                s = core.create_session()
                q = core.create_var(s, "q", None)
                if want.startswith("the prompt"):
                    out = _call(core, s, "{{q}}{{a}}", q=q.id)
                    core.set_var(s, q.id, "")  # e.g. an earlier output that came back empty
                else:
                    out = _call(core, s, "Go {{q}} {{a}}", q=q.id)
                    core.set_var(s, q.id, "now")
                with pytest.raises(ParrotError, match=want):
                    await core.get_var(s, out, "latency", 10)
                assert s.pending_calls() == 0

    asyncio.run(run())


def test_a_cycle_through_a_native_call_is_refused() -> None:
    core = make_core()
    s = core.create_session()
    x = core.create_var(s, "x", None)
    u = _upper(core, s, x.id)
    with pytest.raises(InvalidRequestError, match="cycle"):  # x -> upper -> u -> this call -> x
        core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Say {{u}} {{x}}", parameters=[
            SemanticCallParameter(name="u", var_id=u), SemanticCallParameter(name="x", is_output=True, var_id=x.id)]))
    # the other order: a call y <- x first, the native u <- y, then a call x <- u closes the loop
    y = _call(core, s, "Go {{x}} {{a}}", x=x.id)
    uy = _upper(core, s, y)
    with pytest.raises(InvalidRequestError, match="cycle"):
        core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Say {{u}} {{x}}", parameters=[
            SemanticCallParameter(name="u", var_id=uy),
            SemanticCallParameter(name="x", is_output=True, var_id=x.id)]))
    # no cycle: a call writing a fresh variable from the native's output is taken
    _call(core, s, "Say {{u}} {{a}}", u=u)


def test_an_output_variable_already_set_is_a_conflict() -> None:
    core = make_core()
    s = core.create_session()
    done = core.create_var(s, "done", "text")
    with pytest.raises(ConflictError, match="already ready"):
        core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}", parameters=[
            SemanticCallParameter(name="a", is_output=True, var_id=done.id)]))


def test_drain_fails_what_nothing_can_set_and_lets_the_rest_finish() -> None:
    """A stopping server: variables no one can set any more fail, with what waits on them, so their readers are
    answered; calls whose inputs are all there still run."""
    async def run() -> None:
        async with started_core(ScriptedEngine([])) as core:
            s = core.create_session()
            later = core.create_var(s, "later", None)
            waiting = _call(core, s, "Go {{q}} {{a}}", q=later.id)
            ready = _call(core, s, "Go {{a}}")
            readers = [asyncio.ensure_future(core.get_var(s, v, "latency", 10)) for v in (waiting, ready)]
            await asyncio.sleep(0)
            assert core.drain() == 1
            with pytest.raises(ParrotError, match="shutting down"):
                await readers[0]
            assert await readers[1] == "AB"

    asyncio.run(run())


@pytest.mark.parametrize(("cfg", "said"), [({"max_tokens": 5000}, "leaves no room"),
                                           ({"logit_bias": {999: 1.0}}, "outside the vocabulary"),
                                           ({"stop_token_ids": [5, 10**6]}, "outside the vocabulary")])
def test_what_no_prompt_could_get_is_refused_when_the_call_arrives(cfg: dict, said: str) -> None:
    core = make_core()
    core.engines.register(ScriptedEngine([]))  # a context of 4,096 tokens; the tiny vocabulary has 260
    s = core.create_session()
    with pytest.raises(InvalidRequestError, match=said):
        core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}", parameters=[
            SemanticCallParameter(name="a", is_output=True, sampling_config=cfg)]))
    assert core.vars.session_variables(s.session_id) == []  # nothing was made


class _SeedEngine(ScriptedEngine):
    """Streams text made from the request's seed (as a sampled generation is); `dies_after` chunks, then its
    stream breaks as an engine's that died; `ignores_seed`: text of its own (an engine that computes otherwise)."""

    def __init__(self, name: str, dies_after: int | None = None, ignores_seed: bool = False) -> None:
        super().__init__([])
        self.name, self.dies_after, self.ignores_seed = name, dies_after, ignores_seed

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        seed = 7 if self.ignores_seed else req.sampling.seed
        assert seed is not None, "the core gives every sampled task a seed"
        for i in range(6):
            if self.dies_after is not None and i == self.dies_after:
                from parrot.errors import EngineUnavailableError

                raise EngineUnavailableError("the engine stopped", self.name)
            await asyncio.sleep(0.01)
            yield StreamChunk(token_id=i, text=f"{(seed + i) % 10}", finish_reason="length" if i == 5 else None)


@pytest.mark.parametrize("ignores_seed", [False, True])
def test_a_sampled_task_re_run_elsewhere_goes_on_where_it_stopped_or_fails(ignores_seed: bool) -> None:
    """Its engine dies mid-stream: the re-run on another engine samples from the seed the core gave the task, so
    the text goes on where it stopped; one that generates other text fails the task explicitly (it was cut short
    and spliced before: 'length', [DONE], and the text of neither run)."""
    async def run() -> tuple[str, object]:
        async with started_core(_SeedEngine("a", dies_after=2), seed=3) as core:
            queue = core.complete(["Go"], SamplingParams(max_tokens=6, temperature=1.0))
            first = await queue.get()
            core.engines.register(_SeedEngine("b", ignores_seed=ignores_seed))  # only now: "a" runs it first
            streamed = first
            while isinstance(item := await queue.get(), str):
                streamed += item
            assert core.engine_deaths == {"a": 1} and core.redispatched == 1  # parrot:engine_deaths_total, ...
            return streamed, item

    streamed, result = asyncio.run(run())
    if ignores_seed:
        assert isinstance(result, ParrotError) and "did not repeat" in str(result)
    else:
        assert streamed == result.text and len(result.text) == 6 and result.finish_reason == "length"


@pytest.mark.model
def test_a_prompt_of_no_token_is_refused(smollm) -> None:  # noqa: ANN001
    """SmolLM2's vocabulary has no token for some control characters (0x1d, 0x04, ...): a prompt of only those
    is a 400 when it arrives, not an internal error once it runs."""
    tokenizers = TokenizerManager()
    tokenizers.register("smollm2", smollm.tokenizer)
    core = ParrotServeCore(model="smollm2", tokenizers=tokenizers)
    for prompt in (["\x1d"], ["\x04\x06"], ["\x1d", "\x04"]):
        with pytest.raises(InvalidRequestError, match="no token in the model's vocabulary"):
            core.prompt_tokens(prompt)
    assert core.prompt_tokens(["\x1dhi"])[0]


# ---- needs that come before their producers; criteria raised while queued; app depth; refused calls ---------
def test_a_variable_read_before_its_producer_arrives_is_computed_once_it_does() -> None:
    """A reader may wait on a pending variable before the call computing it is submitted (or before the
    native call between): that call, and what it reads, are needed as soon as they arrive."""
    async def run() -> None:
        async with started_core(ScriptedEngine([])) as core:
            s = core.create_session()
            x = core.create_var(s, "x", None)
            reader = asyncio.ensure_future(core.get_var(s, x.id, "latency", 10))
            await asyncio.sleep(0.05)
            core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{x}}", parameters=[
                SemanticCallParameter(name="x", is_output=True, var_id=x.id)]))
            assert await reader == "AB"  # what ScriptedEngine generates
            # a consumer needed first (output_criteria), then the native call computing its input, then the
            # call computing the native's input
            y = core.create_var(s, "y", None)
            u = _upper(core, s, y.id)
            out = core.semantic_call(s, SemanticCallRequest(
                session_id=s.session_id, template="Say {{u}} {{a}}", output_criteria="throughput", parameters=[
                    SemanticCallParameter(name="u", var_id=u), SemanticCallParameter(name="a", is_output=True)]))
            a = next(p.var_id for p in out.param_info if p.name == "a")
            core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{y}}", parameters=[
                SemanticCallParameter(name="y", is_output=True, var_id=y.id)]))
            for v in (y.id, u, a):  # every step ran, no client having read any of them
                assert await asyncio.wait_for(core.vars.get(v, s.session_id).wait(None), 10) == {
                    y.id: "AB", u: "AB", a: "AB"}[v]

    asyncio.run(run())


def test_reading_a_queued_throughput_call_for_latency_raises_its_task() -> None:
    core = make_core()
    s = core.create_session()
    out = core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}",
                                                    output_criteria="throughput",
                                                    parameters=[SemanticCallParameter(name="a", is_output=True)]))
    task = core.scheduler.queue[0]  # no engine: queued
    assert task.criterion == "throughput" and task.payload.priority == 1
    core._need(s, core.vars.get(out.param_info[0].var_id, s.session_id), "latency")
    assert task.criterion == "latency" and task.payload.priority == 0


def test_an_apps_later_steps_are_deeper_after_the_earlier_ones_ended() -> None:
    """App-FIFO's depth counts the calls a step reads even once they have ended (and left the graph): a
    chain's third step is at depth 2, a step after a native call over the first at depth 1."""
    async def run() -> list[int]:
        core = make_core(config=ServeConfig(model="tiny"))
        core.engines.register(ScriptedEngine([]))
        await core.start()
        depths: list[int] = []
        real = core.scheduler.submit
        core.scheduler.submit = lambda task: (depths.append(task.depth), real(task))[1]  # type: ignore[method-assign]
        try:
            s = core.create_session()
            first = _call(core, s, "Step 0: {{a}}")
            await core.get_var(s, first, "latency", 10)
            second = _call(core, s, "Step 1: {{p}} {{a}}", p=first)
            await core.get_var(s, second, "latency", 10)
            third = _call(core, s, "Step 2: {{p}} {{a}}", p=second)
            await core.get_var(s, third, "latency", 10)
            after = _call(core, s, "Then {{u}} {{a}}", u=_upper(core, s, first))
            await core.get_var(s, after, "latency", 10)
            return depths
        finally:
            await core.stop()

    assert asyncio.run(run()) == [0, 1, 2, 1]


def test_a_variable_has_one_producer_and_a_refused_call_changes_nothing() -> None:
    core = make_core()
    s = core.create_session()
    x = core.create_var(s, "x", None)
    u = _upper(core, s, x.id)
    held = core.vars.count(s.session_id)
    params = [SemanticCallParameter(name="q", value="?"),
              SemanticCallParameter(name="u", var_id=u, is_output=True, sampling_config={"choice": ["y"]})]
    with pytest.raises(ConflictError, match="already has a producer \\(native call"):
        core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Shared text. {{q}} B {{u}}",
                                                  parameters=params))
    assert core.vars.count(s.session_id) == held  # no variable made for it is left, no constant held
    assert core.vars.get(u, s.session_id).type is None and len(s.requests) == 1
    with pytest.raises(ConflictError, match="computed by call"):  # a client does not set a computed variable
        core.set_var(s, u, "mine")
    a = _call(core, s, "Go {{a}}")
    with pytest.raises(ConflictError, match="computed by call"):
        core.set_var(s, a, "mine")
    core.set_var(s, x.id, "input")  # what nothing computes a client sets


def test_a_call_forking_the_blocks_of_a_longer_cached_prompt_says_which() -> None:
    """The radix view's fork (the blocks a longer cached context shares with a prompt) is named in the call's
    run as any other fork: `forked_from` / `forked_tokens` (the live view's `forked_by` reads them)."""
    async def run() -> tuple[dict, str]:
        async with started_core(ScriptedEngine([])) as core:
            shared = "".join(chr(97 + i % 26) for i in range(224))
            a, b = core.create_session(), core.create_session()
            first = _call(core, a, shared + "x" * 80 + " {{a}}")
            await core.get_var(a, first, "latency", 10)
            holder = next(c for c in core.contexts.contexts() if c.num_tokens > 300)
            second = _call(core, b, shared + "y" * 20 + " {{a}}")
            await core.get_var(b, second, "latency", 10)
            return b.executor.history[0].run, holder.context_id

    run_info, holder = asyncio.run(run())
    assert run_info["forked_from"] == holder and run_info["forked_tokens"] == 223, run_info


def test_a_running_native_calls_output_keeps_its_producer() -> None:
    """While a native call runs on its worker thread (its output still pending), a client cannot set that output
    and no semantic call can take it as its own."""
    async def run() -> str:
        async with started_core(ScriptedEngine([])) as core:
            s = core.create_session()
            x = core.create_var(s, "x", "hello")
            u = _upper(core, s, x.id)
            reader = asyncio.ensure_future(core.get_var(s, u, "latency", 5))
            await asyncio.sleep(0)  # the read made it run: handed to a worker thread, its output still pending
            with pytest.raises(ConflictError, match="computed by call n-"):
                core.set_var(s, u, "client value")
            with pytest.raises(ConflictError, match="already has a producer \\(native call n-"):
                core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{u}}", parameters=[
                    SemanticCallParameter(name="u", is_output=True, var_id=u)]))
            return await reader

    assert asyncio.run(run()) == "HELLO"


def test_api_keys_take_turns_at_a_full_engine() -> None:
    """One key's backlog of completions does not hold back another key's work: with the engine taking one at a
    time, key 1's session call (its chain carries the session's owner) runs next, before key 0's completions
    still waiting."""
    from parrot.protocol import SamplingParams
    from parrot.serve.core import CompletionResult

    async def run() -> tuple[list[str], int]:
        engine = ScriptedEngine([], max_batch_size=1)
        async with started_core(engine) as core:
            sp = SamplingParams(max_tokens=2)
            queues = [core.complete([f"a{i}"], sp, client=0) for i in range(6)]
            names = {core._completions[q].session_id: "key 0" for q in queues}
            s = core.create_session(owner=1)
            names[s.session_id] = "key 1"
            out = core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}",
                                                            parameters=[SemanticCallParameter(name="a",
                                                                                              is_output=True)]))
            # the read makes the call wanted (latency-critical, as completions are); its chain is queued
            reader = asyncio.ensure_future(core.get_var(s, out.param_info[0].var_id, "latency", 10))
            while not any(t.client == 1 for t in core.scheduler.queue):
                await asyncio.sleep(0)
            ordered = [t.client for t in core.scheduler._ordered()]
            waiting = ordered.count(0)
            assert ordered == [1] + [0] * waiting and waiting > 0
            for q in queues:
                while not isinstance(await asyncio.wait_for(q.get(), 10), CompletionResult):
                    pass
            assert await reader == "AB"
            return [names[cid.rsplit("-", 1)[0]] for cid in engine.generated], waiting

    order, waiting = asyncio.run(run())
    assert order[-waiting - 1:] == ["key 1"] + ["key 0"] * waiting


def test_each_api_keys_waiting_completions_are_bounded() -> None:
    """max_queued_completions_per_key: a key with that many completions waiting for an engine gets a 429 for the
    next; another key, and requests without one, still queue theirs. Sessions per key likewise
    (max_sessions_per_key), and a session opens only for the key that created it."""
    from parrot.protocol import SamplingParams
    from parrot.serve.core import CompletionResult

    async def run() -> None:
        async with started_core(ScriptedEngine([], max_batch_size=1), max_queued_completions_per_key=1,
                                max_sessions_per_key=1) as core:
            sp = SamplingParams(max_tokens=2)
            # the engine takes one at a time: the first runs, the second waits
            queues = [core.complete(["hi"], sp, client=0), core.complete(["hi"], sp, client=0)]
            with pytest.raises(RateLimitError, match="limit 1 a key"):
                core.complete(["hi"], sp, client=0)
            queues += [core.complete(["hi"], sp, client=1), core.complete(["hi"], sp)]
            for q in queues:  # each finishes: room for the key again
                while not isinstance(await asyncio.wait_for(q.get(), 10), CompletionResult):
                    pass
            core.complete(["hi"], sp, client=0)
            s = core.create_session(owner=0)
            with pytest.raises(RateLimitError, match="limit 1 a key"):
                core.create_session(owner=0)
            core.create_session(owner=1)
            assert core.get_session(s.session_id, s.token, owner=0) is s
            for other in (1, None):
                with pytest.raises(NotFoundError):
                    core.get_session(s.session_id, s.token, owner=other)

    asyncio.run(run())


class ClientRecordingEngine(ScriptedEngine):
    """Records the client each fill and generate names."""

    def __init__(self) -> None:
        super().__init__([], max_batch_size=4)
        self.clients: list[tuple[str, str | None]] = []

    async def fill(self, req: FillRequest) -> FillResponse:
        self.clients.append(("fill", req.client))
        return await super().fill(req)

    async def generate_stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        self.clients.append(("generate", req.client))
        async for chunk in super().generate_stream(req):
            yield chunk


@pytest.mark.parametrize("fair", [True, False])
def test_the_engines_are_told_whose_work_it_is_where_the_keys_take_turns(fair: bool) -> None:
    """Each primitive names its API key (`client`) to the engine, which gives each key its share of a full batch;
    a completion without a key, and every one without fair share, names none."""
    from parrot.protocol import SamplingParams
    from parrot.serve.core import CompletionResult

    async def run() -> list[tuple[str, str | None]]:
        engine = ClientRecordingEngine()
        async with started_core(engine, fair_share=fair) as core:
            sp = SamplingParams(max_tokens=2)
            for client in (0, 1, None):
                q = core.complete([f"Hello {client}"], sp, client=client)
                while not isinstance(await asyncio.wait_for(q.get(), 10), CompletionResult):
                    pass
                engine.clients.append(("done", None))
        return engine.clients

    per: list[set[str | None]] = []
    current: set[str | None] = set()
    for kind, client in asyncio.run(run()):
        if kind == "done":
            per.append(current)
            current = set()
        else:
            current.add(client)
    assert per == ([{"key-0"}, {"key-1"}, {None}] if fair else [{None}] * 3)
