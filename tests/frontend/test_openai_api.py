"""The OpenAI-compatible API with the real `openai` client against a real uvicorn server on loopback:
the serve core and an embedded engine running a tiny random model (and, marked `model`, the default
SmolLM2 model)."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

import parrot
from parrot.config import EngineConfig, ServeConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.http_api import EngineServer
from parrot.errors import InvalidRequestError
from parrot.frontend.http_api import create_app
from parrot.frontend.openai_api import chat_pieces
from parrot.serve.engines import HttpEngineClient
from tests.conftest import batch_invariant_mode, grammar_rejects, tiny_engine_config, tiny_model, tiny_tokenizer
from tests.servers import free_port, make_core, running, serving_core

PROMPT = "The quick brown fox jumps over"
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    with serving_core(engine, "tiny", tiny_model().tokenizer) as (url, core):
        yield url, core
    engine.shutdown()


@pytest.fixture
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _stream_text(stream, chat: bool) -> tuple[str, str | None, object]:  # noqa: ANN001
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += (ch.delta.content or "") if chat else ch.text
            finish = ch.finish_reason or finish
    return text, finish, usage


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    card = client.models.retrieve("tiny")
    assert card.owned_by == "parrot" and card.model_extra["root"] == "tiny" and card.model_extra["parent"] is None
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    assert card.model_extra["max_model_len"] == httpx.post(f"{root}/tokenize", json={"prompt": "x"}).json()[
        "max_model_len"] > 0  # vLLM's card: the longest context
    assert httpx.get(f"{root}/version").json() == {"version": parrot.__version__}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_served_model_names(server) -> None:  # noqa: ANN001
    """vLLM's --served-model-name: the names /v1/models lists; an answer carries the name its request gave where
    it is one of them, else the first (any name is still taken)."""
    engine = server[1].engines.live_engines()[0].engine
    config = ServeConfig(model="tiny", served_model_names=("tiny-chat", "alias"))
    with serving_core(engine, "tiny", tiny_model().tokenizer, config=config) as (url, _), openai.OpenAI(
            base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list()] == ["tiny-chat", "alias"]
        assert client.models.retrieve("alias").model_extra["root"] == "tiny"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("tiny")
        for asked, answered in (("alias", "alias"), ("tiny-chat", "tiny-chat"), ("gpt-4", "tiny-chat")):
            assert client.completions.create(model=asked, prompt=PROMPT, max_tokens=1).model == answered
            assert client.chat.completions.create(model=asked, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=1).model == answered


def test_completion_stream_equals_non_stream(client: openai.OpenAI, server) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    prompt_tokens = len(server[1].tokenizers.encode("tiny", PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens, 8, prompt_tokens + 8)
    stream = client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    text, finish, usage = _stream_text(stream, chat=False)
    assert text == choice.text and finish == "length"
    assert usage.completion_tokens == 8 and usage.prompt_tokens == prompt_tokens


def test_default_max_tokens_and_prompt_list(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=["Hello there", "General Kenobi"], temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 2 * 16  # the OpenAI default for completions


def test_token_id_prompts(client: openai.OpenAI, server) -> None:
    """Token ids go to the engine as given: the same greedy completion as the text they encode, one set of n
    choices per prompt of a list, usage counting the ids, and the prefix cache shared with the text."""
    ids = server[1].tokenizers.encode("tiny", PROMPT)
    text = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    r = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    assert r.choices[0].text == text.choices[0].text and r.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16  # the text's prompt, cached: the same tokens
    other = server[1].tokenizers.encode("tiny", "Hello there")
    r = client.completions.create(model="tiny", prompt=[ids, other], n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == text.choices[0].text
    alone = client.completions.create(model="tiny", prompt="Hello there", **GREEDY).choices[0].text
    assert r.choices[2].text == r.choices[3].text == alone
    assert r.usage.prompt_tokens == len(ids) + len(other) and r.usage.completion_tokens == 4 * 8
    stream = client.completions.create(model="tiny", prompt=ids, stream=True, echo=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    streamed, finish, usage = _stream_text(stream, chat=False)
    assert streamed == PROMPT + text.choices[0].text and usage.prompt_tokens == len(ids)


def test_core_prompt_tokens(server) -> None:
    """The serve core's plain completion prompt: text pieces are tokenized together, token-id pieces kept."""
    core = server[1]
    assert core.prompt_tokens(["ab", "c"]) == core.tokenizers.encode_pieces("tiny", ["ab", "c"])
    assert core.prompt_tokens([[7, 8], [], [9]]) == [[7, 8], [], [9]]
    for pieces in (["a", [1]], [[1], [2, 260]], [[-1]], [[], []], [""]):
        with pytest.raises(InvalidRequestError):
            core.prompt_tokens(pieces)


def test_a_prompt_is_tokenized_once(client: openai.OpenAI, server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The context-length check and the `n` choices share one tokenization of each prompt."""
    tokenizers = server[1].tokenizers
    calls: list[str] = []
    for name in ("encode", "encode_pieces"):
        original = getattr(tokenizers, name)
        monkeypatch.setattr(tokenizers, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    r = client.completions.create(model="tiny", prompt=PROMPT, n=3, **GREEDY)
    assert len(r.choices) == 3 and calls == ["encode_pieces"]
    calls.clear()
    client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": PROMPT}], n=2, **GREEDY)
    assert calls == ["encode_pieces"]


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    r = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # seeded sampling (richer text than the tiny model's greedy output): the same in both modes too
    kw = dict(model="tiny", messages=messages, temperature=1.0, seed=11, max_tokens=12, extra_body={"ignore_eos": True})
    sampled = client.chat.completions.create(**kw).choices[0].message.content
    assert sampled and _stream_text(client.chat.completions.create(stream=True, **kw), chat=True)[0] == sampled


def test_n_with_seed(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt=PROMPT, n=2, seed=7, temperature=1.0, max_tokens=12,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # choice i uses seed + i
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == b.usage.prompt_tokens
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                            seed=3, max_tokens=4, stream=True, extra_body={"ignore_eos": True})
    indices = {ch.index for chunk in stream for ch in chunk.choices}
    assert indices == {0, 1}


def test_stop(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 1) if full[i:i + 2].strip() and
                "\ufffd" not in full[i:i + 2])
    r = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16, stop=[stop, "@@@"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop  # vLLM's field
    # what stopped it, whole and streamed: the stop string, a stop token id (the first token generated), nothing
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    first_id = httpx.post(f"{root}/tokenize", json={"prompt": full[0]}).json()["tokens"][0]
    for extra, text, reason in (({"stop": [stop, "@@@"]}, full[:full.index(stop)], stop),
                                ({"extra_body": {"ignore_eos": True, "stop_token_ids": [first_id]}}, "", first_id),
                                ({}, full, None)):
        for stream in (False, True):
            kw = {"extra_body": {"ignore_eos": True}, **extra}
            got = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16, stream=stream,
                                            **kw)
            last = list(got)[-1].choices[0] if stream else got.choices[0]
            assert last.model_extra["stop_reason"] == reason and (stream or last.text == text), (extra, stream)
    # the model's EOS (257 for the tiny tokenizer) is the model's own end: no stop_reason, even where the request
    # names it among stop_token_ids (as vLLM checks EOS first); with ignore_eos only the request's id stops it
    eos = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "logit_bias": {"257": 100}}
    for extra, reason in (({"stop_token_ids": [257]}, None), ({"stop_token_ids": [257], "ignore_eos": True}, 257)):
        got = client.completions.create(**eos, extra_body=extra).choices[0]
        assert (got.finish_reason, got.model_extra["stop_reason"]) == ("stop", reason), extra
    a = httpx.post(f"{root}/tokenize", json={"prompt": "A"}).json()["tokens"][0]
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8,
           "logit_bias": {str(a): 100}}  # "AAAAAAAA"
    for stream in (False, True):
        for extra, reason in (({"stop": ["AAA"]}, "AAA"), ({"extra_body": {"stop_token_ids": [a]}}, a), ({}, None)):
            got = client.chat.completions.create(**ask, **extra, stream=stream)
            last = list(got)[-1].choices[0] if stream else got.choices[0]
            assert last.model_extra["stop_reason"] == reason, (extra, stream)
            assert last.finish_reason == ("length" if reason is None else "stop")


def test_repeated_system_prompt_is_cached(client: openai.OpenAI) -> None:
    system = "You are a pirate who answers every question about the sea in rhyme. " * 2
    usages = []
    for q in ("How deep is the ocean?", "Why is the sea salty?"):
        r = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])
        usages.append(r.usage)
    # the first finds at most the template's opening block, cached by earlier tests' chats (radix view)
    assert usages[0].prompt_tokens_details.cached_tokens < 16
    assert usages[1].prompt_tokens_details.cached_tokens >= len(system)  # byte-level tokenizer


def test_chat_pieces_split_at_messages() -> None:
    tok = tiny_tokenizer()

    def render(msgs, gen):  # noqa: ANN001, ANN202
        return tok.apply_chat_template(msgs, add_generation_prompt=gen)

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    pieces, shared = chat_pieces(render, msgs)
    assert "".join(pieces) == render(msgs, True) and len(pieces) == 4 and shared == 1
    assert pieces[0] == "<|im_start|>system\nS<|im_end|>\n"
    pieces, shared = chat_pieces(render, msgs[1:])  # no system message: the template's preamble is shared
    assert pieces[0] == "<|im_start|>user\n" and shared == 1 and "".join(pieces) == render(msgs[1:], True)

    def odd(msgs, gen):  # noqa: ANN001, ANN202 - prefixes do not line up: one piece
        return f"{len(msgs)}:" + "".join(m["content"] for m in msgs)

    assert chat_pieces(odd, msgs) == (["4:SUAV"], 0)


def test_bad_input(client: openai.OpenAI, server) -> None:
    def bad(exc_type, fn, **kw) -> openai.APIStatusError:  # noqa: ANN001
        with pytest.raises(exc_type) as info:
            fn(**kw)
        assert info.value.type == "invalid_request_error" and info.value.message
        return info.value

    chat, comp = client.chat.completions.create, client.completions.create
    e = bad(openai.BadRequestError, chat, model="tiny", messages=[])
    assert e.param == "messages"
    e = bad(openai.BadRequestError, comp, model="tiny", prompt=PROMPT, max_tokens=0)
    assert e.param == "max_tokens" and "echo" in e.message
    e = bad(openai.BadRequestError, comp, model="tiny", prompt=PROMPT, logprobs=21)
    assert e.param == "logprobs"
    bad(openai.BadRequestError, chat, model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True,
        top_logprobs=21)
    bad(openai.BadRequestError, comp, model="tiny", prompt="")
    bad(openai.BadRequestError, comp, model="tiny", prompt=PROMPT, temperature=5)
    bad(openai.BadRequestError, comp, model="tiny", prompt=PROMPT, n=0)
    bad(openai.BadRequestError, chat, model="tiny", messages=[{"role": "tool", "content": "x"}])
    bad(openai.BadRequestError, chat, model="tiny", messages=[{"role": "user", "content": "x"}], stop=[""])
    e = bad(openai.BadRequestError, comp, model="tiny", prompt="x" * 600, max_tokens=4, stream=True)
    assert e.code == "context_length_exceeded" and e.param == "prompt" and "512" in e.message
    e = bad(openai.BadRequestError, chat, model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=600)
    assert e.code == "context_length_exceeded" and e.param == "max_tokens"
    # an unknown model name is accepted: one model is served and named in the answer
    r = comp(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=1)
    assert r.model == "tiny"
    # malformed JSON and wrong types: 400 in the OpenAI error shape too
    r = httpx.post(f"{server[0]}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{server[0]}/v1/completions", json={"prompt": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # token-id prompts: empty, outside the vocabulary (260 tokens), mixed with text, too long
    for prompt, says in (([], "empty"), ([[]], "empty"), ([[5, 6], []], "prompt 1 is an empty"),
                         ([-1, 5], "vocabulary"), ([5, 260], "vocabulary"), ([[5], [10**12]], "vocabulary"),
                         ([5, "x"], "token ids"), (["x", [5]], "token ids"), ([[5, "x"]], "token ids"),
                         ([5, True], "token ids"), ([5, 1.5], "token ids")):
        for stream in (False, True):
            r = httpx.post(f"{server[0]}/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream})
            assert r.status_code == 400, (prompt, r.text)
            error = r.json()["error"]
            assert error["param"] == "prompt" and says in error["message"], (prompt, error)
            assert error["type"] == "invalid_request_error"
    e = bad(openai.BadRequestError, comp, model="tiny", prompt=[65] * 600, max_tokens=4)
    assert e.code == "context_length_exceeded" and e.param == "prompt" and "600 tokens" in e.message
    e = bad(openai.BadRequestError, comp, model="tiny", prompt=[[65], [65] * 510], max_tokens=4, stream=True)
    assert e.code == "context_length_exceeded" and e.param == "max_tokens"
    # no max_tokens named: the default (16 for completions; a chat's is the rest of the context, as OpenAI's and
    # vLLM's) is capped at what the context leaves, as vLLM does
    r = comp(model="tiny", prompt=[65] * 509, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    for size in (440, 40):
        r = chat(model="tiny", messages=[{"role": "user", "content": "x" * size}], extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 512 and r.choices[0].finish_reason == "length"
    e = bad(openai.BadRequestError, comp, model="tiny", prompt=[65] * 512)  # no room for one token
    assert e.code == "context_length_exceeded" and e.param == "prompt"


def test_a_chats_default_length_fits_the_smallest_kv_pool() -> None:
    """Where the KV pool holds fewer tokens than the context, a chat that names no max_tokens gets what the pool
    leaves (not a refusal as larger than the cache)."""
    engine = LLMEngine(tiny_model(), tiny_engine_config(kv_pages=1 + 12)).start(precompile=False)  # 192 tokens
    try:
        with serving_core(engine, "tiny", tiny_model().tokenizer) as (url, core), openai.OpenAI(
                base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            core.engines.live_engines()  # the runtime info comes with the first ping, at registration
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 40}],
                                               extra_body={"ignore_eos": True})
            assert r.usage.prompt_tokens + r.usage.completion_tokens == 192 and r.choices[0].finish_reason == "length"
            assert client.models.retrieve("tiny").model_extra["max_model_len"] == 192  # what a sequence may hold
            # past the pool, within the context: the same 400 as past the context, naming the pool
            for kw, param in (({"messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
                              ({"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 300}, "max_tokens"),
                              ({"messages": [{"role": "user", "content": "x" * 40}], "extra_body": {
                                  "min_tokens": 180}}, "messages")):
                with pytest.raises(openai.BadRequestError) as info:
                    client.chat.completions.create(model="tiny", **kw)
                e = info.value
                assert e.code == "context_length_exceeded" and e.param == param, (kw, e.message)
                assert "the KV cache holds 192" in e.message and "max_tokens is 512" not in e.message, e.message
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model="tiny", prompt=[65] * 100, max_tokens=150)
            assert info.value.param == "max_tokens" and "KV cache holds 192" in info.value.message
    finally:
        engine.shutdown()


# ---- the real default model -----------------------------------------------------------------------
def _smollm_config(**kw: object) -> EngineConfig:
    """Small shapes for SmolLM2 behind a server, batch-invariant (the app and plain calls batch differently)."""
    return EngineConfig(compilation_cache_dir=None, kv_memory_mb=256, max_batch_size=4, bs_buckets=[1, 2, 4],
                        token_buckets=[16, 32, 64], max_num_batched_tokens=64, prefill_bs_buckets=[1],
                        kv_buckets=[64, 128, 256], cascade_suffix_buckets=[64, 128], precompile=False,
                        **batch_invariant_mode(), **kw)


@pytest.fixture(scope="module")
def smollm_server(smollm):  # noqa: ANN001
    engine = LLMEngine(smollm, _smollm_config()).start(precompile=False)
    with serving_core(engine, "smollm2", smollm.tokenizer) as (url, _):
        yield url
    engine.shutdown()


@pytest.mark.model
def test_smollm_knows_the_capital_of_france(smollm_server: str) -> None:
    with openai.OpenAI(base_url=f"{smollm_server}/v1", api_key="x", max_retries=0, timeout=300) as c:
        r = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=10,
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


@pytest.mark.model
def test_smollm_token_id_prompt_equals_its_text(smollm_server: str, smollm) -> None:  # noqa: ANN001
    """A BPE vocabulary: the ids of a text (the server's tokenizer) complete as the text does, and score the
    same when echoed with logprobs (lm-eval-harness's loglikelihood request)."""
    text = "The capital of France is"
    ids = smollm.tokenizer.encode(text)
    with openai.OpenAI(base_url=f"{smollm_server}/v1", api_key="x", max_retries=0, timeout=300) as c:
        def run(prompt: str | list[int], **kw):  # noqa: ANN202
            return c.completions.create(model="smollm2", prompt=prompt, temperature=0, **kw)

        by_text, by_ids = run(text, max_tokens=6), run(ids, max_tokens=6)
        assert by_ids.choices[0].text == by_text.choices[0].text and "Paris" in by_ids.choices[0].text
        assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
        scored_text, scored = run(text, echo=True, logprobs=1, max_tokens=0), run(ids, echo=True, logprobs=1,
                                                                                   max_tokens=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == text and len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(scored_text.choices[0].logprobs.token_logprobs[1:], abs=1e-4)


@pytest.mark.model
def test_smollm_speculative_answers_equal_plain_ones(smollm_server: str, smollm) -> None:  # noqa: ANN001
    """A server whose engine drafts by prompt lookup (`speculative_tokens`) answers JSON-schema, JSON-object and
    logprobs requests through the `openai` client exactly as the plain one does, the drafts confirmed."""
    engine = LLMEngine(smollm, _smollm_config(speculative_tokens=4)).start(precompile=False)
    text = "Parrot serves LLM applications: prompts are templates bound to semantic variables, and the server sees it."
    messages = [{"role": "user", "content": f"Repeat this text exactly, as the JSON field text:\n\n{text}"}]
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
              "additionalProperties": False}
    asks = [{"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
             "logprobs": True, "top_logprobs": 2},
            {"response_format": {"type": "json_object"}, "temperature": 0.7, "seed": 3}]

    def answers(url: str) -> list[tuple[str, list | None]]:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300) as c:
            out = []
            for kw in asks:
                r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=60,
                                              **{"temperature": 0, **kw})
                ch = r.choices[0]
                lp = ch.logprobs and [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                      for t in ch.logprobs.content]
                out.append((ch.message.content, lp))
            return out

    try:
        with serving_core(engine, "smollm2", smollm.tokenizer) as (url, _):
            drafted = answers(url)
        assert drafted == answers(smollm_server)
        assert drafted[0][0].startswith('{"text": "Parrot serves LLM applications') and drafted[1][1]
        assert engine.ping().spec_accepted_tokens >= 20
    finally:
        engine.shutdown()


CHUNKS = [
    "The Apache License grants every contributor's users a perpetual, worldwide, royalty-free copyright license.",
    "Redistribution requires keeping the license text and any NOTICE file with the distributed work.",
    "The work is provided as is, without warranties or conditions of any kind, express or implied.",
]
STEP = "Summarize the text in one sentence.\nPrevious summary: {prev}\nText: {chunk}\nSummary:"
MAP = "Summarize the text in one sentence.\nText: {chunk}\nSummary:"
REDUCE = "Combine these summaries into one sentence.\n{parts}\nCombined summary:"


@pytest.mark.model
def test_parrot_app_equals_plain_openai_calls(smollm_server: str) -> None:
    """The same chain and map-reduce apps, run server-side from semantic variables and client-side with
    plain OpenAI completions, give identical greedy outputs: the DAG changes speed, not results."""
    sampling = {"max_tokens": 20, "temperature": 0.0}
    with openai.OpenAI(base_url=f"{smollm_server}/v1", api_key="x", max_retries=0, timeout=300) as oa, \
            httpx.Client(base_url=smollm_server, timeout=300) as c:
        def complete(prompt: str) -> str:
            return oa.completions.create(model="smollm2", prompt=prompt, **sampling).choices[0].text

        # baseline: the app's control flow in the client
        prev, chain_base = "(none)", []
        for chunk in CHUNKS:
            prev = complete(STEP.format(prev=prev, chunk=chunk))
            chain_base.append(prev)
        maps_base = [complete(MAP.format(chunk=chunk)) for chunk in CHUNKS]
        reduce_base = complete(REDUCE.format(parts="\n".join(maps_base)))

        # Parrot: the whole app as semantic calls; one read at the end runs the DAG server-side
        body = c.post("/v1/session", json={}).json()
        sid, auth = body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}

        def call(template: str, inputs: dict[str, dict]) -> str:
            params = [{"name": k, "is_output": False, **v} for k, v in inputs.items()]
            params.append({"name": "out", "is_output": True, "sampling_config": sampling})
            r = c.post("/v1/semantic_call", headers=auth,
                       json={"session_id": sid, "template": template, "parameters": params})
            assert r.status_code == 201, r.text
            return next(p["var_id"] for p in r.json()["param_info"] if p["is_output"])

        def get(var_id: str) -> str:
            r = c.get(f"/v1/semantic_var/{var_id}", params={"session_id": sid, "timeout": 300}, headers=auth)
            assert r.status_code == 200, r.text
            return r.json()["content"]

        step_t = STEP.replace("{prev}", "{{prev}}").replace("{chunk}", "{{chunk}}") + "{{out}}"
        prev_in: dict = {"value": "(none)"}
        chain_vars = []
        for chunk in CHUNKS:
            v = call(step_t, {"prev": prev_in, "chunk": {"value": chunk}})
            chain_vars.append(v)
            prev_in = {"var_id": v}
        map_vars = [call(MAP.replace("{chunk}", "{{chunk}}") + "{{out}}", {"chunk": {"value": ch}}) for ch in CHUNKS]
        parts = "\n".join(f"{{{{m{i}}}}}" for i in range(len(CHUNKS)))
        reduce_var = call(REDUCE.replace("{parts}", parts) + "{{out}}",
                          {f"m{i}": {"var_id": v} for i, v in enumerate(map_vars)})
        assert get(chain_vars[-1]) == chain_base[-1]
        assert [get(v) for v in chain_vars] == chain_base
        assert get(reduce_var) == reduce_base
        assert [get(v) for v in map_vars] == maps_base


def test_baseline_mode_shares_no_prefix() -> None:
    """With prefix sharing switched off (the benchmarks' baseline), a repeated system prompt is
    prefilled again every time and nothing stays cached."""
    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    try:
        with serving_core(engine, "tiny", model.tokenizer, prefix_sharing=False, app_aware=False) as (url, core), \
                openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as c:
            messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "hi"}]
            for _ in range(2):
                r = c.chat.completions.create(model="tiny", messages=messages, **GREEDY)
                assert r.usage.prompt_tokens_details.cached_tokens == 0
            _wait_until(lambda: engine.ping().num_contexts == 0)
            assert engine.ping().num_contexts == 0 and not core.contexts.contexts()
    finally:
        engine.shutdown()


def _wait_until(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    import time

    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def http_engine_server():
    """The serve core with the tiny engine behind its own HTTP server (as `parrot serve --engines N` runs them)."""
    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    srv = EngineServer(engine, "127.0.0.1", free_port(), log_level="warning").start_in_thread()
    core = make_core(None, "tiny", tiny_tokenizer())
    core.engines.register(HttpEngineClient("remote", srv.url, "tiny", 512))
    with running(create_app(core)) as url:
        yield url, core
    srv.stop()
    engine.shutdown()


@pytest.mark.parametrize("at", [0, 2])
def test_a_grammar_failure_fails_that_request_alone(http_engine_server, monkeypatch: pytest.MonkeyPatch,
                                                    at: int) -> None:
    """A constrained request whose grammar rejects its token (the first, or a later one) gets a 400
    `generation_failed` with the matcher's reason; a request beside it completes; the engine stays live
    (before, the engine answered 500 and the serve core took it for dead). Greedy, and a grammar that
    cannot end before the rejected token, so the generation always reaches it."""
    url, core = http_engine_server
    grammar_rejects(monkeypatch, at)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(client.completions.create, model="tiny", prompt=PROMPT, temperature=0, max_tokens=24,
                             extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"regex": "[a-y]{8}"})
        assert info.value.code == "generation_failed"
        assert "left its grammar at token" in info.value.message and "<state>" not in info.value.message
        assert beside.result(60).usage.completion_tokens == 24
        assert [e.name for e in core.engines.live_engines()] == ["remote"]
        # streamed: a failure before the first token is the response's status, a later one the stream's last event
        with pytest.raises(openai.BadRequestError if at == 0 else openai.APIError) as info:
            list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], stream=True,
                                                max_tokens=8, temperature=0, extra_body={"regex": "[a-y]{8}"}))
        assert "left its grammar at token" in info.value.message
        monkeypatch.undo()
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"regex": "[a-y]{8}"})
        assert r.choices[0].text and set(r.choices[0].text) <= set("abcdefghijklmnopqrstuvwxy")
