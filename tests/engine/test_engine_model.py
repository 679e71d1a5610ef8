"""The engine on the real default model: batching and forking do not change results."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
from collections.abc import Callable

import pytest

from parrot.config import EngineConfig
from parrot.engine import kernels
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams
from tests.conftest import batch_invariant_mode

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Translate 'hello' to Spanish.",
    "What is the largest planet?", "Give me a synonym for happy.", "What does CPU stand for?",
    "How many legs does a spider have?", "What is the chemical symbol for gold?", "Name a famous painter.",
    "What is the square root of 81?", "Which ocean is the largest?", "What language is spoken in Brazil?",
    "What is photosynthesis?",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(smollm: LoadedModel):
    cfg = EngineConfig(compilation_cache_dir=None, kv_memory_mb=512, max_batch_size=16,
                       token_buckets=[16, 32, 64, 128], max_num_batched_tokens=128, bs_buckets=[1, 2, 4, 8, 16],
                       kv_buckets=[128, 256, 512], cascade_suffix_buckets=[64, 128], **batch_invariant_mode())
    eng = LLMEngine(smollm, cfg).start(precompile=False)
    yield eng
    eng.shutdown()


def _ids(smollm: LoadedModel, q: str) -> list[int]:
    tok = smollm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))


def _run(eng: LLMEngine, ctx: str, ids: list[int], parent: str | None = None) -> list[int]:
    eng.fill_future(FillRequest(context_id=ctx, parent_context_id=parent, token_ids=ids)).result(300)
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = eng.generate_future(GenerateRequest(context_id=ctx, sampling=sp)).result(300).token_ids
    eng.free_future(ctx).result(60)
    return out


def test_sixteen_concurrent_prompts_equal_each_alone(engine: LLMEngine, smollm: LoadedModel) -> None:
    prompts = [_ids(smollm, q) for q in QUESTIONS]
    alone = [_run(engine, f"alone{i}", p) for i, p in enumerate(prompts)]
    with cf.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(lambda a: _run(engine, f"conc{a[0]}", a[1]), enumerate(prompts)))
    assert together == alone
    assert "Paris" in smollm.tokenizer.decode(alone[0])


def test_forked_contexts_equal_unforked(engine: LLMEngine, smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    system = tok.encode("<|im_start|>system\nYou are a concise assistant. Answer in one short sentence.<|im_end|>\n")
    questions = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS[:6]]
    engine.fill_future(FillRequest(context_id="sys", token_ids=system)).result(300)
    with cf.ThreadPoolExecutor(6) as ex:
        forked = list(ex.map(lambda a: _run(engine, f"fork{a[0]}", a[1], parent="sys"), enumerate(questions)))
    engine.free_future("sys").result(60)
    flat = [_run(engine, f"flat{i}", system + q) for i, q in enumerate(questions)]
    assert forked == flat


def _mixed_run(eng: LLMEngine, smollm: LoadedModel, tag: str) -> list[list[float]]:
    """Three chats decode while a long prompt fills beside them (in chunks), and its answer decodes with theirs."""
    import threading

    chats = [_ids(smollm, q) for q in QUESTIONS[:3]]
    long = _ids(smollm, " ".join(QUESTIONS[:8]))  # ~80 tokens: one chunk beside the decodes
    started = threading.Event()
    futs = []
    for i, ids in enumerate(chats):
        eng.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=ids)).result(300)
        sp = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)  # the chosen tokens' logprobs: bit for bit
        futs.append(eng.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=sp),
                                        on_chunk=lambda c: started.set()))
    assert started.wait(300)
    fill = eng.fill_future(FillRequest(context_id=f"{tag}L", token_ids=long))
    fill.result(300)
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    futs.append(eng.generate_future(GenerateRequest(context_id=f"{tag}L", sampling=sp)))
    results = [f.result(300) for f in futs]
    out = [r.token_ids + [lp.logprob for lp in r.logprobs or []] for r in results]
    for c in [f"{tag}{i}" for i in range(3)] + [f"{tag}L"]:
        eng.free_future(c).result(60)
    return out


def test_mixed_steps_give_each_row_its_own_kind_of_steps_result(engine: LLMEngine, smollm: LoadedModel) -> None:
    """Decodes and prompt chunks in one pass over the weights (mixed steps) give the same tokens as two
    passes, and as each prompt alone."""
    if not engine.runner.mixed:
        pytest.skip("mixed steps need the native CPU kernels")
    before = engine.runner.mixed_steps
    mixed = _mixed_run(engine, smollm, "mix")
    assert engine.runner.mixed_steps > before
    engine.runner.mixed = False
    try:
        steps = engine.runner.mixed_steps
        two_passes = _mixed_run(engine, smollm, "two")
        assert engine.runner.mixed_steps == steps
    finally:
        engine.runner.mixed = True
    assert mixed == two_passes
    long = _ids(smollm, " ".join(QUESTIONS[:8]))
    assert mixed[3] == _run(engine, "aloneL", long)


def test_multi_step_decode_equals_one_step_a_call(engine: LLMEngine, smollm: LoadedModel) -> None:
    """Several decode steps per call (multi-step decode: tokens sampled and fed on the device) give the same
    tokens as one step a call, greedy and seeded."""
    if engine.runner.multi_step == 1:  # no multi-step shapes in its book: XLA's attention (as on a GPU) by default
        pytest.skip("this engine was built without multi-step decode (its default without in-place prefill attention)")
    prompts = [_ids(smollm, q) for q in QUESTIONS[:3]]

    def together(tag: str) -> list[list[int]]:
        futs = []
        for i, ids in enumerate(prompts):
            engine.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=ids)).result(300)
            sp = SamplingParams(max_tokens=21, ignore_eos=True, **(dict(temperature=0.9, seed=3) if i == 2 else {}))
            futs.append(engine.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=sp)))
        out = [f.result(300).token_ids for f in futs]
        for i in range(len(prompts)):
            engine.free_future(f"{tag}{i}").result(60)
        return out

    default = engine.runner.multi_step
    try:
        engine.runner.multi_step = 1
        one = together("one")
        engine.runner.multi_step = 4
        launches = engine.runner.multi_step_launches
        multi = together("multi")
        assert engine.runner.multi_step_launches > launches
    finally:
        engine.runner.multi_step = default
    assert multi == one


def test_the_tiled_weights_change_no_token(engine: LLMEngine, smollm: LoadedModel) -> None:
    """Where the CPU has the VNNI code, the decode products read the weights' tiled copies (models/llama.py
    `_tiled`); reading the GGUF rows instead gives the same tokens, alone and four at a time."""
    from parrot.engine import kernels

    w = engine.runner.weights
    if w.head.tiled is None:
        pytest.skip("no tiled copies: this CPU (or this build) has no VNNI code")
    assert all(layer["mlp"]["w_gate_up_t"] is not None for layer in w.layers)
    prompts = [_ids(smollm, q) for q in QUESTIONS[:4]]

    def together(tag: str) -> list[list[int]]:
        with cf.ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda a: _run(engine, f"{tag}{a[0]}", a[1]), enumerate(prompts)))

    try:
        kernels.use_tiled(False)
        rows = together("rows") + [_run(engine, "rows-alone", prompts[0])]
        kernels.use_tiled(True)
        tiled = together("tiled") + [_run(engine, "tiled-alone", prompts[0])]
    finally:
        kernels.use_tiled(True)
    assert tiled == rows


def _conversation(eng: LLMEngine, smollm: LoadedModel, tag: str, q: str,
                  pause: Callable[[], None] | None = None) -> list:
    """A question, a greedy reply, a follow-up and a second reply, each reply with its tokens' logprobs (bit for
    bit); `pause()` runs between the first reply and the follow-up (other work that may take this context's KV)."""
    tok = smollm.tokenizer
    out: list = []
    eng.fill_future(FillRequest(context_id=tag, token_ids=_ids(smollm, q))).result(300)
    for turn in range(2):
        sp = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
        r = eng.generate_future(GenerateRequest(context_id=tag, sampling=sp)).result(300)
        out += [r.token_ids, [(lp.logprob, [t.logprob for t in lp.top]) for lp in r.logprobs]]
        if turn == 0:
            if pause is not None:
                pause()
            follow = tok.encode("<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
            eng.fill_future(FillRequest(context_id=tag, token_ids=follow)).result(300)
    eng.free_future(tag).result(60)
    return out


def test_preempted_and_evicted_contexts_give_the_same_tokens_and_logprobs(engine: LLMEngine,
                                                                          smollm: LoadedModel) -> None:
    """In a pool too small for the work, running jobs are preempted and idle contexts evicted, and their KV is
    recomputed: each token fed again the way it was fed the first time (a prompt's in a prompt chunk, a generated
    one as a decode row), so every reply has the same tokens and the same logprobs, bit for bit, as with room."""
    questions = QUESTIONS[:6]
    alone = [_conversation(engine, smollm, f"roomy{i}", q) for i, q in enumerate(questions)]
    small_cfg = dataclasses.replace(engine.cfg, kv_memory_mb=None, kv_pages=1 + 12)  # 192 tokens: 6 x ~90 wanted
    small = LLMEngine(smollm, small_cfg).start(precompile=False)
    hogs = itertools.count()
    try:
        def hog() -> None:  # a long prompt through the pool while the conversations' contexts are idle
            ids = _ids(smollm, " ".join(QUESTIONS))
            small.fill_future(FillRequest(context_id=f"hog{next(hogs)}", token_ids=ids)).result(300)

        with cf.ThreadPoolExecutor(6) as ex:
            tight = list(ex.map(lambda a: _conversation(small, smollm, f"tight{a[0]}", a[1], pause=hog),
                                enumerate(questions)))
        ping = small.ping()
    finally:
        small.shutdown()
    assert ping.preemptions > 0 and ping.evictions > 0
    if not kernels.available():  # XLA's products sum a row by the batch's shape: its logprobs' last bits vary
        tight, alone = ([c[::2] for c in convs] for convs in (tight, alone))  # each conversation's tokens
    assert tight == alone
