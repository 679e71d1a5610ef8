"""Automatic prefix caching: every request reuses the longest cached prefix of its tokens, matched block by
block, through real loopback servers (OpenAI client) and the serve core over a tiny random-weight engine."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import openai
import pytest

import parrot as P
from parrot.config import ServeConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.engine.models.llama import random_weights
from parrot.protocol import SamplingParams
from parrot.serve.core import CompletionResult
from tests.conftest import TINY, tiny_engine_config, tiny_model, tiny_tokenizer
from tests.servers import make_core, serving_core

_rng = random.Random(12)
PREFIX = "".join(_rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(330))  # 330 tokens (bytes)
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    yield engine
    engine.shutdown()


def _run(url: str, prompts: list[str]) -> list[tuple[str, int, int]]:
    """(text, prompt tokens, cached tokens) of each prompt, sent one after the other."""
    out = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        for p in prompts:
            r = c.completions.create(model="tiny", prompt=p, **GREEDY)
            out.append((r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
    return out


def test_completions_share_prefixes_and_greedy_outputs_are_unchanged(engine: LLMEngine) -> None:
    prompts = [PREFIX + " first question?",
               PREFIX + " first question? and a follow-up",  # extends the first prompt
               PREFIX + " another one",  # diverges after the prefix
               PREFIX + " a third thing",  # diverges too: the second divergent request
               PREFIX + " first question?"]  # the same prompt again
    model = tiny_model()
    with serving_core(engine, "tiny", model.tokenizer) as (url, core):
        cached = _run(url, prompts)
        metrics = openai.OpenAI(base_url=url, api_key="x")._client.get(f"{url}/metrics").text
    with serving_core(engine, "tiny", model.tokenizer, prefix_sharing=False) as (url, _):
        plain = _run(url, prompts)
    assert [t for t, _, _ in cached] == [t for t, _, _ in plain]  # greedy: the cache changes no output
    assert [c for _, _, c in plain] == [0] * len(prompts)  # --no-prefix-sharing
    (_, n0, c0), (_, n1, c1), (_, n2, c2), (_, n3, c3), (_, n4, c4) = cached
    assert c0 == 0
    assert c1 >= 0.9 * n1 and c1 == n0  # the whole first prompt was cached
    # the prefix's last full block, forked out of the longer first prompt's context (the radix view); its
    # last token is fed again (a fill needs one token), so 319 of those 320 count as cached
    assert c2 == len(PREFIX) // 16 * 16 - 1
    assert c3 >= 0.9 * n3 and c3 == len(PREFIX) // 16 * 16  # the prefix's last full block, kept by the 3rd
    assert c4 == n4
    hit = next(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("parrot:prefix_cache_hit_rate"))
    assert hit == pytest.approx(core.contexts.hit_rate) and hit > 0.5



def test_cache_salt_keeps_tenants_caches_apart(engine: LLMEngine) -> None:
    """vLLM's cache_salt: a prompt finds cached only what requests of its own salt computed (cached_tokens 0
    under another salt or none, all of it under the same one), and greedy outputs are the same either way; an
    empty salt is a 400 naming it."""
    prompt = PREFIX + " salted question?"
    with serving_core(engine, "tiny", tiny_model().tokenizer) as (url, _):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)

        def ask(salt: str | None) -> tuple[str, int]:
            extra = dict(GREEDY["extra_body"], **({"cache_salt": salt} if salt is not None else {}))
            r = c.completions.create(model="tiny", prompt=prompt, **{**GREEDY, "extra_body": extra})
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

        runs = [ask("tenant-a"), ask("tenant-b"), ask(None), ask("tenant-a"), ask(None), ask("tenant-b")]
        with pytest.raises(openai.BadRequestError) as err:
            ask("")
    assert [cached for _, cached in runs[:3]] == [0, 0, 0]  # each salt (and none) computes it afresh
    n = len(prompt) + 1  # bytes and BOS
    assert all(cached >= n - 16 for _, cached in runs[3:])  # then finds its own
    assert len({text for text, _ in runs}) == 1
    assert "cache_salt" in str(err.value)


def test_a_second_prompt_diverging_near_the_end_finds_most_of_it_cached() -> None:
    """A long document and a question, then the same document and another question: the second forks the
    blocks it shares with the first out of the first's context (the radix view)."""
    config = dataclasses.replace(TINY, max_position=2048)
    model = LoadedModel(config, random_weights(config, seed=1), tiny_tokenizer(), "tiny-long")
    engine = LLMEngine(model, tiny_engine_config(kv_buckets=[256, 512, 1024, 2048])).start(precompile=False)
    doc = "".join(random.Random(5).choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(1000))
    try:
        with serving_core(engine, "tiny", model.tokenizer) as (url, _):
            (_, _, c0), (_, n1, c1) = _run(url, [doc + "\nQuestion: what is it about?\nAnswer:",
                                                 doc + "\nQuestion: who wrote it?\nAnswer:"])
    finally:
        engine.shutdown()
    assert c0 == 0 and c1 >= 0.9 * n1


def _complete_all(core, prompts: list[str]) -> list[CompletionResult]:  # noqa: ANN001
    async def run() -> list[CompletionResult]:
        await core.start()
        try:
            sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            queues = [core.complete([p], sampling) for p in prompts]  # all queued before any runs
            results = []
            for q in queues:
                while not isinstance(item := await q.get(), CompletionResult):
                    assert not isinstance(item, BaseException), item
                results.append(item)
            for _ in range(200):  # let the contexts' frees reach the engine before stopping
                if len(core._background) <= 1:  # the dispatch tick
                    break
                await asyncio.sleep(0.02)
            return results
        finally:
            await core.stop()

    return asyncio.run(run())


def _count_fills(core) -> list[int]:  # noqa: ANN001
    client = core.engines.get("local")
    filled: list[int] = []
    fill = client.fill

    async def counting(req):  # noqa: ANN001, ANN202
        filled.append(len(req.token_ids))
        return await fill(req)

    client.fill = counting
    send = client.send_fill  # pipelined fills (an in-process engine) are sent without `fill`

    def sending(req):  # noqa: ANN001, ANN202
        filled.append(len(req.token_ids))
        return send(req)

    client.send_fill = sending
    return filled


def test_concurrent_requests_fill_a_shared_prefix_once(engine: LLMEngine) -> None:
    model = tiny_model()
    core = make_core(engine, "tiny", model.tokenizer)
    filled = _count_fills(core)
    suffixes = [" alpha", " beta beta", " gamma gamma gamma", " delta"]
    results = _complete_all(core, [PREFIX + s for s in suffixes])
    block_prefix = len(PREFIX) // 16 * 16
    # the prefix's full blocks once, then each prompt's own rest
    assert sum(filled) == block_prefix + sum(len(PREFIX) - block_prefix + len(s) for s in suffixes)
    assert sum(r.cached_tokens for r in results) == 3 * block_prefix
    assert all(r.cached_tokens in (0, block_prefix) for r in results)


def test_cached_contexts_are_bounded_and_freed(engine: LLMEngine) -> None:
    model = tiny_model()
    before = engine.ping().num_contexts
    core = make_core(engine, "tiny", model.tokenizer,
                     config=ServeConfig(max_cached_contexts=6, max_global_contexts=2))
    prompts = [f"{i} " + PREFIX[:200] + f" {i}" * 3 for i in range(8)]  # nothing shared between them
    _complete_all(core, prompts)
    assert core.contexts.num_globals() <= 6
    assert not [c for c in core.contexts.contexts() if c.session_id is not None]  # generated contexts freed
    deadline = time.time() + 10
    while engine.ping().num_contexts - before > 6 and time.time() < deadline:
        time.sleep(0.05)
    assert engine.ping().num_contexts - before <= 6


@P.semantic_function(template="{{doc}} another one{{out}}")
def ask(doc: P.Input, out: P.Output(max_tokens=4, ignore_eos=True, temperature=0.0)): ...


@P.semantic_function(template="{{doc}} a third thing{{out}}")
def ask_again(doc: P.Input, out: P.Output(max_tokens=4, ignore_eos=True, temperature=0.0)): ...


def test_semantic_calls_share_prefixes_with_completions_and_other_sessions(engine: LLMEngine) -> None:
    """One cache for every path: a session's call whose (session-local) input repeats an earlier completion's
    document forks its full blocks, and another session's call forks the block prefix the first call kept
    (a context in session text lives as long as its session)."""
    model = tiny_model()
    with serving_core(engine, "tiny", model.tokenizer) as (url, _):
        _run(url, [PREFIX + " first question?"])
        cached = []
        vms = [P.VirtualMachine(url, timeout=60), P.VirtualMachine(url, timeout=60)]
        try:
            for fn, vm in zip((ask, ask_again), vms, strict=True):
                vm.open()
                vm.activate()
                try:
                    fn(PREFIX).get(timeout=60)
                finally:
                    vm.deactivate()
                [gen] = vm.inspect()["generations"]
                cached.append(gen["cached_tokens"])
        finally:
            for vm in vms:
                vm.close()
    # the prefix's full blocks forked out of the completion's context (its last token fed again); then the
    # context the first call kept at that block boundary
    assert cached == [len(PREFIX) // 16 * 16 - 1, len(PREFIX) // 16 * 16]
