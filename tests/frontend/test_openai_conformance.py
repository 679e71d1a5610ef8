"""OpenAI conformance: every request parameter of /v1/chat/completions and /v1/completions (as the real
`openai` client names them, plus the extensions we take) is honoured, with its effect checked, or refused
with a 400 naming it. Never silently ignored. A real uvicorn server on loopback, the serve core and an
embedded engine running a tiny random model (byte-level tokenizer: token 32 is "A", 257 is EOS)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import httpx
import openai
import pytest

from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.engine.models.llama import random_weights
from tests.conftest import TINY, tiny_engine_config, tiny_tokenizer
from tests.servers import serving_core

A, EOS = 32, 257
PROMPT = "The quick brown fox"
MSGS = [{"role": "user", "content": "Say something."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server():
    # 2048 positions: a tool prompt in a byte-level vocabulary is long
    cfg = dataclasses.replace(TINY, max_position=2048)
    model = LoadedModel(cfg, random_weights(cfg, seed=0), tiny_tokenizer(), "tiny-random")
    engine = LLMEngine(model, tiny_engine_config(kv_memory_mb=16, kv_buckets=[64, 128, 256, 512, 1024, 2048])
                       ).start(precompile=False)
    with serving_core(engine, "tiny", model.tokenizer) as (url, core):
        yield url, core
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def chat(client: openai.OpenAI, **kw):  # noqa: ANN201
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    kw.setdefault("model", "tiny")
    return client.chat.completions.create(**kw)


def comp(client: openai.OpenAI, extra: dict | None = None, **kw):  # noqa: ANN201
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    kw.setdefault("model", "tiny")
    return client.completions.create(extra_body={"ignore_eos": True, **(extra or {})}, **kw)


def refused(fn, param: str, **kw) -> openai.BadRequestError:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as info:
        fn(**kw)
    assert info.value.status_code == 400 and info.value.param == param, (info.value.param, info.value.message)
    assert info.value.message
    return info.value


# ---- the parameter tables: each name appears in exactly one test below --------------------------------
CHAT_COVERED = {
    "messages", "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "user", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "service_tier", "store", "metadata", "modalities", "audio",
    "prediction", "reasoning_effort", "web_search_options", "verbosity", "moderation", "prompt_cache_options",
    "functions", "function_call",
}
COMPLETION_COVERED = {
    "prompt", "model", "best_of", "echo", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
}
CLIENT_ONLY = {"extra_headers", "extra_query", "extra_body", "timeout"}


def test_every_client_parameter_is_covered() -> None:
    c = openai.OpenAI(api_key="x")
    chat_params = set(inspect.signature(c.chat.completions.create).parameters) - CLIENT_ONLY
    comp_params = set(inspect.signature(c.completions.create).parameters) - CLIENT_ONLY
    assert chat_params <= CHAT_COVERED, f"chat parameters without a conformance test: {chat_params - CHAT_COVERED}"
    assert comp_params <= COMPLETION_COVERED, f"completion parameters untested: {comp_params - COMPLETION_COVERED}"


# ---- honoured: sampling ------------------------------------------------------------------------------
def test_temperature_seed_top_p_and_extensions_top_k_min_p(client: openai.OpenAI) -> None:
    greedy = comp(client).choices[0].text
    assert comp(client).choices[0].text == greedy  # temperature 0: deterministic
    sampled = comp(client, temperature=1.0, seed=5).choices[0].text
    assert sampled != greedy and comp(client, temperature=1.0, seed=5).choices[0].text == sampled  # seed
    # each cut-off alone leaves only the most likely token: greedy again at temperature 1
    assert comp(client, temperature=1.0, seed=5, top_p=1e-6).choices[0].text == greedy
    assert comp(client, {"top_k": 1}, temperature=1.0, seed=5).choices[0].text == greedy
    assert comp(client, {"min_p": 1.0}, temperature=1.0, seed=5).choices[0].text == greedy
    # a top_k past the vocabulary keeps all of it, however large (it once took the engine down)
    whole = comp(client, {"top_k": 0}, temperature=1.0, seed=5).choices[0].text
    for k in (10**6, 10**30):
        assert comp(client, {"top_k": k}, temperature=1.0, seed=5).choices[0].text == whole
    assert chat(client, temperature=1.0, seed=5, top_p=1e-6).choices[0].message.content == \
        chat(client).choices[0].message.content
    refused(comp, "temperature", client=client, temperature=2.5)
    refused(comp, "top_p", client=client, top_p=0)


def test_penalties(client: openai.OpenAI) -> None:
    greedy = comp(client).choices[0].text
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        assert comp(client, **kw).choices[0].text != greedy, kw
        assert chat(client, **kw).choices[0].message.content is not None
    assert comp(client, {"repetition_penalty": 2.0}).choices[0].text != greedy
    # frequency grows with each repeat, presence does not: a +5 bias on "A" beats presence but not frequency
    assert comp(client, logit_bias={str(A): 5}, presence_penalty=2.0).choices[0].text == "A" * 12
    assert comp(client, logit_bias={str(A): 5}, frequency_penalty=2.0).choices[0].text.startswith("AAA")
    assert comp(client, logit_bias={str(A): 5}, frequency_penalty=2.0).choices[0].text != "A" * 12
    refused(comp, "presence_penalty", client=client, presence_penalty=3)
    refused(comp, "frequency_penalty", client=client, frequency_penalty=-2.5)


def test_logit_bias(client: openai.OpenAI) -> None:
    assert comp(client, logit_bias={str(A): 100}).choices[0].text == "A" * 12
    assert chat(client, logit_bias={str(A): 100}, max_tokens=4).choices[0].message.content == "AAAA"
    r = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0, logit_bias={str(EOS): 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 0
    refused(comp, "logit_bias", client=client, logit_bias={"99999": 1})
    refused(comp, "logit_bias", client=client, logit_bias={"token": 1})
    refused(comp, "logit_bias", client=client, logit_bias={str(A): 150})


def test_extensions_min_tokens_ignore_eos_stop_token_ids(client: openai.OpenAI) -> None:
    eos = {"logit_bias": {str(EOS): 100}, "max_tokens": 8, "temperature": 0}
    r = client.completions.create(model="tiny", prompt="x", extra_body={"min_tokens": 4}, **eos)
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="x", extra_body={"ignore_eos": True}, **eos)
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0, logit_bias={str(A): 100},
                                  extra_body={"stop_token_ids": [A]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    refused(comp, "min_tokens", client=client, max_tokens=2, extra={"min_tokens": 5})


def test_extension_include_stop_str_in_output(client: openai.OpenAI) -> None:
    """vLLM's include_stop_str_in_output: the stop string ends the text (its tokens' logprobs with it), and a
    stop_token_ids token counts as generated, its text kept."""
    regex = {"guided_regex": "AABAAAAA", "include_stop_str_in_output": True}
    r = comp(client, extra=regex, logprobs=0, max_tokens=8, stop=["BA"])
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == ("AABA", "stop", "BA")
    assert c.logprobs.tokens == ["A", "A", "B", "A"]
    streamed = list(comp(client, extra=regex, max_tokens=8, stop=["BA"], stream=True))
    assert "".join(k.choices[0].text for k in streamed) == "AABA"
    m = chat(client, max_tokens=8, stop=["ABA"], extra_body=regex).choices[0]
    assert m.message.content == "AABA" and m.finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0, logit_bias={str(A): 100},
                                  extra_body={"stop_token_ids": [A], "include_stop_str_in_output": True})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("A", "stop", 1)
    assert r.choices[0].model_extra["stop_reason"] == A
    r = comp(client, extra={**regex, "include_stop_str_in_output": None}, max_tokens=8, stop=["BA"])
    assert r.choices[0].text == "AA"  # null: the default


def test_max_tokens_n_stop_and_model(client: openai.OpenAI) -> None:
    r = comp(client, max_tokens=5, n=3, temperature=1.0, seed=1, model="any-name")
    assert r.model == "tiny" and [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 15
    r = chat(client, max_completion_tokens=3, logit_bias={str(A): 100}, extra_body={"ignore_eos": True}, n=2)
    assert [c.message.content for c in r.choices] == ["AAA", "AAA"] and r.usage.completion_tokens == 6
    r = comp(client, logit_bias={str(A): 100}, stop=["AAA"])
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    r = comp(client, logit_bias={str(A): 100}, best_of=1, n=1, user="u-1", stop="AAAA")
    assert r.choices[0].finish_reason == "stop"
    refused(comp, "best_of", client=client, best_of=3, n=1)
    refused(comp, "n", client=client, n=0)
    refused(comp, "stop", client=client, stop=[""])
    refused(comp, "stop", client=client, stop="x" * 4097)  # at most 4,096 characters


def test_stream_and_stream_options(client: openai.OpenAI) -> None:
    chunks = list(comp(client, logit_bias={str(A): 100}, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "A" * 12
    assert chunks[-1].usage.completion_tokens == 12
    chunks = list(chat(client, logit_bias={str(A): 100}, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "A" * 8
    assert all(c.usage is None for c in chunks)
    refused(comp, "stream_options", client=client, stream_options={"include_usage": True})


def test_stream_options_continuous_usage_stats(client: openai.OpenAI) -> None:
    """vLLM's continuous usage statistics: every chunk carries its choice's usage so far; the last chunk the
    request's."""
    live = {"include_usage": True, "continuous_usage_stats": True}
    for create, text_of in ((comp, lambda k: k.choices[0].text), (chat, lambda k: k.choices[0].delta.content or "")):
        chunks = list(create(client, logit_bias={str(A): 100}, stream=True, stream_options=live, max_tokens=6))
        *each, total = chunks
        assert all(k.choices and k.usage is not None for k in each) and not total.choices
        assert {k.usage.prompt_tokens for k in each} == {total.usage.prompt_tokens} and total.usage.prompt_tokens > 0
        done = [k.usage.completion_tokens for k in each]
        assert done == sorted(done) and done[-1] == total.usage.completion_tokens == 6
        assert all(k.usage.total_tokens == k.usage.prompt_tokens + k.usage.completion_tokens for k in chunks)
        assert "".join(map(text_of, each)) == "A" * 6
    # without include_usage it has no effect (as in vLLM)
    chunks = list(comp(client, stream=True, stream_options={"continuous_usage_stats": True}, max_tokens=3))
    assert all(k.usage is None for k in chunks)


def test_accepted_without_effect_on_the_output(client: openai.OpenAI) -> None:
    """Identifiers and cache hints: they cannot change the text, so they are accepted (docs say so)."""
    r = chat(client, user="u", safety_identifier="s", prompt_cache_key="k", prompt_cache_retention="in_memory",
             service_tier="auto", store=False, modalities=["text"], parallel_tool_calls=True,
             logit_bias={str(A): 100}, max_tokens=2)
    assert r.choices[0].message.content == "AA"


@pytest.mark.parametrize(("param", "value"), [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high"),
    ("web_search_options", {}), ("verbosity", "low"), ("moderation", {"type": "auto"}),
    ("prompt_cache_options", {"x": 1}), ("prompt_cache_retention", "24h"), ("service_tier", "flex"),
    ("store", True), ("metadata", {"k": "v"}),
])
def test_chat_refused(client: openai.OpenAI, param: str, value: object) -> None:
    refused(chat, param, client=client, **{param: value})


def test_completion_refused(client: openai.OpenAI) -> None:
    refused(comp, "suffix", client=client, suffix="end")
    refused(comp, "prompt", client=client, prompt=[EOS + 3])  # token ids outside the vocabulary
    refused(comp, "max_tokens", client=client, max_tokens=0)  # without echo there is nothing to answer


@pytest.mark.parametrize("name", ["ebnf", "guided_decoding_backend", "use_beam_search", "bad_words",
                                  "allowed_token_ids", "chat_template"])
def test_unimplemented_extensions_refused(client: openai.OpenAI, name: str) -> None:
    refused(comp, name, client=client, extra={name: "x"})


# ---- honoured: echo, logprobs -----------------------------------------------------------------------
def test_echo(client: openai.OpenAI) -> None:
    r = comp(client, echo=True, logit_bias={str(A): 100}, max_tokens=3)
    assert r.choices[0].text == PROMPT + "AAA"
    chunks = list(comp(client, echo=True, logit_bias={str(A): 100}, max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + "AAA"


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI) -> None:
    """What loglikelihood evaluations send (lm-eval-harness: echo, logprobs, max_tokens 0 or 1): the prompt's
    tokens with their logprobs (the first has none), then the generated ones. The prompt's are computed by
    the engine's Fill, the generated ones by the sampler: a generated continuation, echoed back as prompt,
    gets the logprobs it was generated with."""
    gen = comp(client, logprobs=2, max_tokens=3, logit_bias={str(A): 100}).choices[0]  # raw logprobs of "AAA"
    assert gen.text == "AAA"
    r = comp(client, prompt=PROMPT + gen.text, echo=True, logprobs=2, max_tokens=0)
    choice, n = r.choices[0], len(PROMPT + gen.text)  # byte-level tokens: one per character
    assert choice.text == PROMPT + gen.text and choice.finish_reason == "length"
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and lp.text_offset == list(range(n))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # the two most likely and the prompt's own token (OpenAI: "up to logprobs+1 elements"), at its logprob
    assert all(len(t) in (2, 3) and t[tok] == x for t, tok, x in zip(lp.top_logprobs[1:], lp.tokens[1:],
                                                                      lp.token_logprobs[1:], strict=True))
    assert lp.tokens[-3:] == gen.logprobs.tokens
    assert lp.token_logprobs[-3:] == pytest.approx(gen.logprobs.token_logprobs, abs=1e-4)
    assert [sorted(t) for t in lp.top_logprobs[-3:]] == [sorted(t) for t in gen.logprobs.top_logprobs]
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 0
    # with max_tokens: the prompt's logprobs, then the generated tokens' (offsets after the prompt)
    r = comp(client, echo=True, logprobs=1, max_tokens=3, logit_bias={str(A): 100})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT + gen.text and "".join(lp.tokens) == PROMPT + gen.text
    assert lp.text_offset == list(range(n)) and lp.token_logprobs[-3:] == pytest.approx(
        gen.logprobs.token_logprobs, abs=1e-4)
    assert r.usage.completion_tokens == 3
    # streamed: the prompt with its logprobs first
    chunks = [c.choices[0] for c in comp(client, echo=True, logprobs=1, max_tokens=3, stream=True,
                                         logit_bias={str(A): 100})]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.token_logprobs[0] is None
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    streamed = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    chunks = [c.choices[0] for c in comp(client, echo=True, logprobs=1, max_tokens=0, stream=True)]
    assert "".join(c.text for c in chunks) == PROMPT and chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.logprobs.tokens] == list(PROMPT)


def test_token_id_prompts_echo_and_score(client: openai.OpenAI, server) -> None:
    """`prompt` as token ids (lm-eval-harness's local-completions sends them): the ids go to the engine as
    given; echo shows their text, and with logprobs (max_tokens 0) the same prompt logprobs as the text."""
    ids = server[1].tokenizers.encode("tiny", PROMPT)
    by_text = comp(client, echo=True, logprobs=2, max_tokens=0)
    by_ids = comp(client, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    choice, lp = by_ids.choices[0], by_ids.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length" and len(lp.tokens) == len(ids)
    assert lp.tokens == by_text.choices[0].logprobs.tokens and lp.text_offset == list(range(len(ids)))
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(by_text.choices[0].logprobs.token_logprobs[1:], abs=1e-4)
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.usage.completion_tokens == 0
    # several prompts of ids, streamed: each echoed with its own logprobs
    two = [ids, ids[:5]]
    chunks = [c.choices[0] for c in comp(client, prompt=two, echo=True, logprobs=0, max_tokens=0, stream=True)]
    for i, p in enumerate(two):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == PROMPT[:len(p)]
        assert len([t for c in mine for t in c.logprobs.tokens]) == len(p)


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    r = chat(client, logprobs=True, top_logprobs=3, max_tokens=4, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for t in content:
        assert t.logprob <= 0 and isinstance(t.token, str) and all(0 <= b < 256 for b in t.bytes)
        assert len(t.top_logprobs) == 3 and [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].logprob >= t.logprob  # greedy: the chosen token is the most likely
    assert chat(client, logprobs=True, max_tokens=2).choices[0].logprobs.content[0].top_logprobs == []
    assert chat(client, max_tokens=2).choices[0].logprobs is None
    streamed = [t for c in chat(client, logprobs=True, top_logprobs=2, max_tokens=4, stream=True,
                                 extra_body={"ignore_eos": True})
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    refused(chat, "top_logprobs", client=client, logprobs=True, top_logprobs=21)
    refused(chat, "top_logprobs", client=client, top_logprobs=2)


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    r = comp(client, logprobs=2, max_tokens=4, logit_bias={str(A): 100})
    lp = r.choices[0].logprobs
    assert lp.tokens == ["A"] * 4 and lp.text_offset == [0, 1, 2, 3]
    assert len(lp.token_logprobs) == 4 and all(x <= 0 for x in lp.token_logprobs)
    # the raw distribution, before the bias: the two most likely, and the sampled token with its own logprob
    assert all(len(top) in (2, 3) and top["A"] == x for top, x in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    zero = comp(client, logprobs=0, max_tokens=2, logit_bias={str(A): 100}).choices[0].logprobs
    assert zero.top_logprobs == [{"A": x} for x in zero.token_logprobs]  # logprobs 0: the sampled token alone
    streamed = [t for c in comp(client, logprobs=2, max_tokens=4, logit_bias={str(A): 100}, stream=True)
                for t in c.choices[0].logprobs.tokens]
    assert streamed == ["A"] * 4
    refused(comp, "logprobs", client=client, logprobs=21)


def test_logprobs_end_where_a_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    """The tokens a stop string cut off have no logprobs (OpenAI's answers: the tokens make up the text),
    streamed or not; the token the cut falls in keeps its own."""
    regex = {"guided_regex": "AABAAAAA"}
    r = comp(client, extra=regex, logprobs=1, max_tokens=8, stop=["BA"])
    assert r.choices[0].text == "AA" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].logprobs.tokens == ["A", "A"] and r.choices[0].logprobs.text_offset == [0, 1]
    streamed = [c.choices[0] for c in comp(client, extra=regex, logprobs=1, max_tokens=8, stop=["BA"], stream=True)]
    assert "".join(c.text for c in streamed) == "AA"
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == ["A", "A"]
    c = chat(client, logprobs=True, max_tokens=8, stop=["ABA"], extra_body={"guided_regex": "AABAAAAA"})
    assert c.choices[0].message.content == "A" and [t.token for t in c.choices[0].logprobs.content] == ["A"]
    streamed = [t.token for k in chat(client, logprobs=True, max_tokens=8, stop=["ABA"], stream=True,
                                      extra_body={"guided_regex": "AABAAAAA"})
                if k.choices and k.choices[0].logprobs for t in k.choices[0].logprobs.content]
    assert streamed == ["A"]
    # no stop string: every token keeps its logprob, the last one's text held back until the end included
    r = comp(client, extra=regex, logprobs=1, max_tokens=8, stop=["BB"])
    assert r.choices[0].text == "AABAAAAA" and len(r.choices[0].logprobs.tokens) == 8


# ---- honoured: output constraints --------------------------------------------------------------------
def test_response_format(client: openai.OpenAI) -> None:
    text = chat(client, response_format={"type": "text"}).choices[0].message.content
    assert isinstance(text, str)
    r = chat(client, response_format={"type": "json_object"}, max_tokens=40)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "num", "schema": schema, "strict": True}}
    obj = json.loads(chat(client, response_format=fmt, max_tokens=40).choices[0].message.content)
    assert set(obj) == {"n"} and 0 <= obj["n"] <= 9
    stream = chat(client, response_format=fmt, max_tokens=40, stream=True)
    assert set(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices))) == {"n"}
    refused(chat, "response_format", client=client, response_format={"type": "xml"})
    refused(chat, "response_format.type", client=client, response_format={"json_schema": fmt["json_schema"]})


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
     lambda t: isinstance(json.loads(t), list)),
    ({"json_schema": '{"type": "integer"}'}, lambda t: isinstance(json.loads(t), int)),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    ({"regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'start: "x" "y"+'}, lambda t: t.startswith("xy") and set(t[1:]) == {"y"}),
    ({"grammar": 'start: ("ab" | "cd") "!"'}, lambda t: t in ("ab!", "cd!")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
])
def test_constraint_extensions(client: openai.OpenAI, extra: dict, check) -> None:  # noqa: ANN001
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=2,
                                  extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text
    r = chat(client, max_tokens=16, temperature=1.0, seed=3, extra_body=extra)
    assert check(r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize(("extra", "words"), [
    ({"guided_json": {"type": "nope"}}, "json_schema"), ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: foo("}, "grammar"), ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}}}, "json_schema"),
])
def test_invalid_constraints_are_400_with_the_matchers_message(client: openai.OpenAI, server, extra: dict,
                                                               words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert words in info.value.message
    for stream in (False, True):  # a stream too: the status, not an event after a 200
        r = httpx.post(f"{server[0]}/v1/chat/completions", timeout=60,
                       json={"messages": MSGS, "max_tokens": 4, "stream": stream, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"]
    refused(comp, "choice", client=client, extra={"regex": "a", "choice": ["a"]})  # one constraint at a time


def test_constrained_output_cut_by_max_tokens(client: openai.OpenAI) -> None:
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 50}}, "required": ["text"]}}},
        max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith('{')


# ---- honoured: tools ---------------------------------------------------------------------------------
def test_named_tool_choice_gives_a_valid_call(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=40, temperature=1.0, seed=1)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    [call] = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    stream = list(chat(client, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=40, temperature=1.0, seed=1,
                       stream=True))
    deltas = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id == deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert stream[-1].choices[0].finish_reason == "tool_calls"


def test_required_none_auto_and_parallel(client: openai.OpenAI) -> None:
    one = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 100, "temperature": 1.0, "seed": 4,
           "parallel_tool_calls": False}
    r = chat(client, **one)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    stream = list(chat(client, **one, stream=True))
    deltas = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == call.function.name and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # parallel calls (the default): one or more, each in its block, the same whole and streamed
    counts = []
    for seed in (4, 1):
        many = {**one, "parallel_tool_calls": True, "seed": seed, "max_tokens": 160}
        r = chat(client, **many)
        calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
        whole = calls if finish == "tool_calls" else calls[:-1]  # max_tokens may cut the last one
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in whole)
        stream = list(chat(client, **many, stream=True))
        deltas = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name) for d in deltas if d.id] == [(i, c.function.name)
                                                                        for i, c in enumerate(calls)]
        assert ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in range(len(calls))] == [
            c.function.arguments for c in calls]
        assert stream[-1].choices[0].finish_reason == finish
        counts.append(len(calls))
    assert counts == [1, 2]  # these seeds' answers: one call, and two
    r = chat(client, tools=[WEATHER], tool_choice="none", logit_bias={str(A): 100}, max_tokens=3)
    assert r.choices[0].message.content == "AAA" and not r.choices[0].message.tool_calls
    r = chat(client, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False, logit_bias={str(A): 100},
             max_tokens=3)
    assert r.choices[0].message.content == "AAA" and r.choices[0].finish_reason == "length"


def test_auto_parses_the_models_tool_calls(client: openai.OpenAI) -> None:
    """"auto": a call the model writes (forced here by a regex, as the tiny model writes none) comes back as a
    tool call, whole and streamed; the text around it is content."""
    said = 'Checking. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    regex = said.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")
    kw = {"tools": [WEATHER, TIME], "max_tokens": 80, "extra_body": {"regex": regex}}
    r = chat(client, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_time", {})]
    stream = list(chat(client, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    calls = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "Checking." and [(c.index, c.function.name) for c in calls] == [(0, "get_time")]
    assert stream[-1].choices[0].finish_reason == "tool_calls"


def literal(text: str) -> str:
    """A regular expression (llguidance's Rust syntax) matching exactly `text`."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text).replace("\n", "\\n")


@pytest.mark.parametrize("said", [
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
    '```json\n[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]\n```',
])
def test_auto_reads_other_tool_call_formats(client: openai.OpenAI, said: str) -> None:
    """Mistral's `[TOOL_CALLS]`, Llama 3.1's `<|python_tag|>` (";"-separated, "parameters"), a JSON list of
    calls, a fenced one: the same two calls, whole and streamed (the stream holds such an answer to its end)."""
    kw = {"tools": [WEATHER, TIME], "max_tokens": 160, "extra_body": {"regex": literal(said)}}
    r = chat(client, **kw)
    msg = r.choices[0].message
    want = [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == want
    stream = list(chat(client, stream=True, **kw))
    calls = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (i, n, a) for i, (n, a) in enumerate(want)]
    assert not "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert stream[-1].choices[0].finish_reason == "tool_calls"


# ---- honoured: legacy functions ------------------------------------------------------------------------
def test_legacy_functions_and_function_call(client: openai.OpenAI) -> None:
    """`functions` / `function_call` (deprecated, still in OpenAI's API): the tools machinery underneath, the
    answer as `message.function_call` with finish_reason "function_call"; history with `function_call` and
    `role: "function"` turns."""
    functions = [WEATHER["function"], TIME["function"]]
    r = chat(client, functions=functions, function_call={"name": "get_weather"}, max_tokens=40, temperature=1.0,
             seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    assert set(json.loads(choice.message.function_call.arguments)) == {"city"}
    stream = list(chat(client, functions=functions, function_call={"name": "get_weather"}, max_tokens=40,
                       temperature=1.0, seed=1, stream=True))
    deltas = [c.choices[0].delta.function_call for c in stream if c.choices and c.choices[0].delta.function_call]
    assert deltas[0].name == "get_weather"
    assert "".join(d.arguments or "" for d in deltas) == choice.message.function_call.arguments
    assert stream[-1].choices[0].finish_reason == "function_call"
    r = chat(client, functions=functions, function_call="none", logit_bias={str(A): 100}, max_tokens=3)
    assert r.choices[0].message.content == "AAA" and r.choices[0].message.function_call is None
    said = '{"name": "get_time", "arguments": {}}'  # "auto" (the default): the model's call is read
    r = chat(client, functions=functions, max_tokens=60, extra_body={"regex": literal(said)})
    assert r.choices[0].finish_reason == "function_call" and r.choices[0].message.function_call.name == "get_time"
    history = [*MSGS, {"role": "assistant", "content": None,
                       "function_call": {"name": "get_time", "arguments": "{}"}},
               {"role": "function", "name": "get_time", "content": "12:00"}]
    assert chat(client, messages=history, functions=functions).choices[0].message.role == "assistant"
    refused(chat, "function_call", client=client, functions=functions, function_call={"name": "nope"})
    refused(chat, "functions", client=client, functions=functions, tools=[WEATHER])
    refused(chat, "function_call", client=client, function_call="auto")
    refused(chat, "functions.0.name", client=client, functions=[{"name": "has space"}])
    refused(chat, "messages.1.role", client=client, functions=functions,
            messages=[*MSGS, {"role": "function", "name": "get_time", "content": "12:00"}])


def test_tool_history_is_accepted(client: openai.OpenAI) -> None:
    messages = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    assert chat(client, messages=messages, tools=[TIME]).choices[0].message.role == "assistant"


@pytest.mark.parametrize(("kw", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400(client: openai.OpenAI, kw: dict, param: str) -> None:
    refused(chat, param, client=client, **kw)


def test_models_show_sampling_defaults(client: openai.OpenAI) -> None:
    card = client.models.retrieve("tiny").model_extra["sampling_defaults"]
    assert card == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "source": "llama.cpp defaults"}


def test_malformed_messages_and_constraints_name_their_parameter(client: openai.OpenAI, server) -> None:
    url = server[0]
    post = lambda body, **kw: httpx.post(f"{url}/v1/chat/completions", timeout=60, **kw,  # noqa: E731
                                         **({"json": body} if isinstance(body, dict) else {"content": body}))
    r = post(b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None and "not valid JSON" in r.text
    r = post(b'{"model": "x", "messages": []}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    cases = [({"messages": [{"content": "hi"}]}, "messages.0.role", "is required"),
             ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "needs"),
             ({"messages": MSGS, "guided_regex": "("}, "guided_regex", "regex"),
             # constraints no output satisfies: refused up front, naming the field, in a line
             ({"messages": MSGS, "guided_regex": "a[^\\s\\S]b"}, "guided_regex", "no output satisfies it"),
             ({"messages": MSGS, "structured_outputs": {"grammar": "start: start"}}, "structured_outputs.grammar",
              "no output satisfies it"),
             ({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
                 "name": "a", "schema": {"$ref": "#"}}}}, "response_format", "no output satisfies it"),
             ({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
                 "name": "a", "schema": {"type": "string", "format": "bogusformat"}}}}, "response_format", "format"),
             ({"messages": [*MSGS, {"role": "tool", "tool_call_id": "call_zzz", "content": "5"}]},
              "messages.1.tool_call_id", "answers no tool call"),
             ({"messages": MSGS, "echo": True}, "echo", "echo")]
    for body, param, says in cases:
        r = post({"model": "tiny", "max_tokens": 2, **body})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and says in error["message"], (body, error)
        assert "pydantic" not in error["message"], error
    # an assistant's refusal part in the history is its text; a tool message answering a call is taken
    history = [*MSGS, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
               {"role": "user", "content": "Why?"}]
    assert chat(client, messages=history, max_tokens=2).choices[0].finish_reason in ("stop", "length")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert chat(client, messages=history, tools=[WEATHER], max_tokens=2).choices[0].finish_reason in (
        "stop", "length")
