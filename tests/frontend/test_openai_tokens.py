"""vLLM's `/tokenize` and `/detokenize` (and under `/v1/`) against a real uvicorn server on loopback: the
ids are those the completion routes count in `usage.prompt_tokens`, detokenize inverts tokenize, and bad
input is a 400 in the OpenAI error shape. A tiny random model serves the completions; the default model's
byte-level BPE tokenizer (with no engine: these routes need none) checks the round trip on a real
vocabulary."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from parrot.config import ServeConfig
from parrot.engine.tokenizer import Tokenizer, load_tokenizer
from parrot.errors import ModelLoadError
from parrot.frontend.http_api import create_app
from parrot.serve.core import ParrotServeCore
from tests.conftest import tiny_tokenizer
from tests.servers import make_core, running, tiny_serving_core

PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL = {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}
TEXTS = ["Hello, world!", "  leading spaces\n\ttabs and\r\nnewlines  ", "Héllo wörld, 東京 🦜 naïve café",
         "<|im_start|>user\nspecial tokens as text<|im_end|>\n", "digits 1234567890 and 3.14159", "x"]
KEYS = {"count", "max_model_len", "tokens", "token_strs"}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ParrotServeCore]]:
    with tiny_serving_core() as (url, core):
        yield url, core


@pytest.fixture
def http(server: tuple[str, ParrotServeCore]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


@pytest.fixture
def client(server: tuple[str, ParrotServeCore]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@contextmanager
def tokens_only(model: str, tokenizer: Tokenizer, **config: Any) -> Iterator[str]:
    """The Parrot app over a core with `tokenizer` and no engine, on loopback: its URL."""
    core = make_core(None, model, tokenizer, config=ServeConfig(model=model, **config))
    with running(create_app(core)) as url:
        yield url


def ok(http: httpx.Client, path: str, body: dict, headers: dict | None = None) -> dict:
    r = http.post(path, json=body, headers=headers)
    assert r.status_code == 200, (path, body, r.text)
    return r.json()


def chat_prompt_tokens(client: openai.OpenAI, **kw: Any) -> int:
    """The prompt tokens /v1/chat/completions counts: its usage, or where the prompt does not fit the tiny
    model's context (the default tool prompt alone is ~500 bytes) the count its context-length error names."""
    try:
        return client.chat.completions.create(model="tiny", max_tokens=1, temperature=0, **kw).usage.prompt_tokens
    except openai.BadRequestError as exc:
        found = re.search(r"the messages has (\d+) tokens", exc.message)
        assert exc.code == "context_length_exceeded" and found, exc.message
        return int(found.group(1))


def flat(pieces: list[list[int]]) -> list[int]:
    return [t for piece in pieces for t in piece]


def test_tokenize_counts_what_a_completion_reports(http: httpx.Client, client: openai.OpenAI,
                                                   server: tuple[str, ParrotServeCore]) -> None:
    core = server[1]
    limit = min(e.max_context_len for e in core.engines.live_engines())
    for text in [PROMPT, *TEXTS]:
        out = ok(http, "/tokenize", {"model": "tiny", "prompt": text})
        assert set(out) == KEYS and out["token_strs"] is None and out["max_model_len"] == limit
        assert out["tokens"] == flat(core.prompt_tokens([text])) and out["count"] == len(out["tokens"])
        assert ok(http, "/v1/tokenize", {"model": "tiny", "prompt": text}) == out
    for text in (PROMPT, TEXTS[2]):
        count = ok(http, "/tokenize", {"model": "tiny", "prompt": text})["count"]
        r = client.completions.create(model="tiny", prompt=text, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == count > 0
    # an unknown model name is accepted, as on the completion routes
    assert ok(http, "/tokenize", {"model": "gpt-4", "prompt": PROMPT})["count"] == len(PROMPT)
    assert ok(http, "/tokenize", {"prompt": ""})["tokens"] == []  # counted, not refused (vLLM)


def test_chat_tokenize_counts_what_a_chat_completion_reports(http: httpx.Client, client: openai.OpenAI,
                                                             server: tuple[str, ParrotServeCore]) -> None:
    tok = server[1].tokenizers.get("tiny")
    ask = [{"role": "user", "content": "Oslo?"}]
    named = {"type": "function", "function": {"name": "w"}}
    for messages, extra in ((CHAT, {}), (ask, {"tools": [TOOL]}), (CHAT, {"tools": [TOOL], "tool_choice": "none"}),
                            (ask, {"tools": [TOOL], "tool_choice": named}), (ask, {"functions": [TOOL["function"]]})):
        out = ok(http, "/tokenize", {"model": "tiny", "messages": messages, **extra})
        assert chat_prompt_tokens(client, messages=messages, **extra) == out["count"] == len(out["tokens"]), extra
        text = ok(http, "/detokenize", {"model": "tiny", "tokens": out["tokens"]})["prompt"]
        if extra.get("tool_choice") == named:  # the prompt ends inside the forced call, as the engine sees it
            assert text.endswith('<tool_call>\n{"name": "w", "arguments": ')
        elif extra.get("tool_choice") == "none" or not extra:
            assert text == tok.apply_chat_template(messages, add_generation_prompt=True)
        else:
            assert "<tools>" in text
    bare = ok(http, "/v1/tokenize", {"model": "tiny", "messages": CHAT, "add_generation_prompt": False})
    assert ok(http, "/v1/detokenize", {"tokens": bare["tokens"]})["prompt"] == tok.apply_chat_template(
        CHAT, add_generation_prompt=False)
    # a prompt over the context is counted (as vLLM does), as the chat route counts it
    long = ok(http, "/tokenize", {"messages": CHAT, "tools": [WEATHER]})
    assert long["count"] > long["max_model_len"] and chat_prompt_tokens(client, messages=CHAT, tools=[WEATHER]) == (
        long["count"])


def test_chat_template_options(http: httpx.Client, client: openai.OpenAI, server: tuple[str, ParrotServeCore]) -> None:
    """vLLM's continue_final_message (the prompt ends with the final message's text, the model goes on with it)
    and add_generation_prompt, counted alike by /tokenize and /v1/chat/completions."""
    tok = server[1].tokenizers.get("tiny")
    prefilled = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    opts = {"add_generation_prompt": False, "continue_final_message": True}
    out = ok(http, "/tokenize", {"messages": prefilled, **opts})
    text = ok(http, "/detokenize", {"tokens": out["tokens"]})["prompt"]
    whole = tok.apply_chat_template(prefilled, add_generation_prompt=False)
    assert text.endswith("The answer is") and whole.startswith(text) and len(whole) > len(text)
    assert chat_prompt_tokens(client, messages=prefilled, extra_body=opts) == out["count"]
    bare = {"add_generation_prompt": False}
    assert chat_prompt_tokens(client, messages=CHAT, extra_body=bare) == ok(
        http, "/tokenize", {"messages": CHAT, **bare})["count"]


def test_chat_template_kwargs_reach_the_template() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ flavour | default('plain') }}"
    with tokens_only("tiny", tok) as url, httpx.Client(base_url=url, timeout=60) as http:
        for kwargs, ends in (({"flavour": "mint"}, "mint"), ({}, "plain"), (None, "plain")):
            body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
            out = ok(http, "/tokenize", body)
            assert ok(http, "/detokenize", {"tokens": out["tokens"]})["prompt"] == "hi" + ends


def test_detokenize_inverts_tokenize(http: httpx.Client, server: tuple[str, ParrotServeCore]) -> None:
    vocab = server[1].tokenizers.get("tiny").backend
    for text in TEXTS:
        for prefix in ("", "/v1"):
            out = ok(http, f"{prefix}/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
            assert out["token_strs"] == [vocab.id_to_token(t) for t in out["tokens"]]
            assert ok(http, f"{prefix}/detokenize", {"model": "tiny", "tokens": out["tokens"]}) == {"prompt": text}
    assert ok(http, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_the_default_models_vocabulary_round_trips() -> None:
    try:
        tok = load_tokenizer()
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")
    with tokens_only("smollm2", tok) as url, httpx.Client(base_url=url, timeout=60) as http:
        for text in TEXTS:
            out = ok(http, "/tokenize", {"model": "smollm2", "prompt": text, "return_token_strs": True})
            assert out["tokens"] == tok.encode(text) and out["max_model_len"] is None  # no engine
            assert out["token_strs"] == [tok.backend.id_to_token(t) for t in out["tokens"]]
            assert ok(http, "/detokenize", {"model": "smollm2", "tokens": out["tokens"]})["prompt"] == text
        assert len(ok(http, "/tokenize", {"prompt": "Hello world"})["tokens"]) == 2  # merges, not bytes
        chat = ok(http, "/tokenize", {"messages": CHAT[1:]})["tokens"]
        assert ok(http, "/detokenize", {"tokens": chat})["prompt"] == tok.apply_chat_template(CHAT[1:])


def test_add_special_tokens() -> None:
    tok = tiny_tokenizer()
    tok.add_bos_token = True  # id 256
    with tokens_only("bos", tok) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert ok(http, "/tokenize", {"prompt": "hi"})["tokens"] == [256, *tok.encode("hi", add_bos=False)]
        assert ok(http, "/tokenize", {"prompt": "hi", "add_special_tokens": True})["tokens"][0] == 256
        assert ok(http, "/tokenize", {"prompt": "hi", "add_special_tokens": False})["tokens"] == tok.encode(
            "hi", add_bos=False)
        assert ok(http, "/tokenize", {"prompt": ""})["tokens"] == [256]
        assert ok(http, "/tokenize", {"prompt": "", "add_special_tokens": False})["count"] == 0
        # chat: as /v1/chat/completions tokenizes the rendered prompt (the tokenizer's BOS) unless told not to
        chat = ok(http, "/tokenize", {"messages": CHAT})["tokens"]
        assert chat == tok.encode(tok.apply_chat_template(CHAT)) and chat[0] == 256
        assert ok(http, "/tokenize", {"messages": CHAT, "add_special_tokens": False})["tokens"] == chat[1:]


def test_bad_input(http: httpx.Client) -> None:
    msg = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, Any, str | None, str]] = [
        ("/detokenize", {"tokens": [5, 260]}, "tokens", "outside the vocabulary"),
        ("/v1/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
        ("/detokenize", {"tokens": [10**12]}, "tokens", "outside the vocabulary"),
        ("/detokenize", {"tokens": [5, 1.5]}, "tokens.1", "integer"),
        ("/detokenize", {"tokens": [5, True]}, "tokens.1", "integer"),
        ("/detokenize", {"tokens": ["5"]}, "tokens.0", "integer"),
        ("/detokenize", {"tokens": "hello"}, "tokens", "list"),
        ("/detokenize", {"model": "tiny"}, "tokens", "required"),
        ("/tokenize", {"model": "tiny"}, "prompt", "prompt"),
        ("/v1/tokenize", {"prompt": "hi", "messages": msg}, "messages", "not both"),
        ("/tokenize", {"prompt": 3}, "prompt", "string"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "string"),
        ("/tokenize", {"messages": []}, "messages", "at least 1"),
        ("/tokenize", {"messages": "hi"}, "messages", "list"),
        ("/tokenize", {"messages": ["hi"]}, "messages.0", "object with a role"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", "not supported"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "tool_call_id"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content",
         "text only"),
        ("/tokenize", {"messages": msg, "tools": [{"type": "function"}]}, "tools.0", "tools"),
        ("/tokenize", {"messages": msg, "tool_choice": "required"}, "tool_choice", "tool"),
        ("/tokenize", {"messages": msg, "continue_final_message": True}, "continue_final_message",
         "cannot both be true"),
        ("/tokenize", {"messages": [{"role": "user", "content": " "}], "continue_final_message": True,
                       "add_generation_prompt": False},
         "continue_final_message", "final message with text"),
        ("/tokenize", {"messages": msg, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
         "cannot set messages"),
        ("/tokenize", {"messages": msg, "tools": [WEATHER], "tool_choice": "required", "add_generation_prompt": False},
         "tool_choice", "needs the generation prompt"),  # as the chat route refuses it
        ("/tokenize", {"prompt": "hi", "continue_final_message": True}, "continue_final_message", "chat field"),
        ("/tokenize", {"messages": msg, "chat_template": "{{ x }}"}, "chat_template", "not supported"),
        ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt", "chat field"),
        ("/tokenize", {"prompt": "hi", "tools": [WEATHER]}, "tools", "chat field"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": "maybe"}, "return_token_strs", "boolean"),
        ("/tokenize", [1, 2], None, "object"),
    ]
    for path, body, param, says in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param and says in error["message"], (body, error)
    r = http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_api_key() -> None:
    key = "sekret-key"
    with tokens_only("tiny", tiny_tokenizer(), api_key=key) as url, httpx.Client(base_url=url, timeout=60) as http:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/v1/tokenize", {"prompt": "hi"}),
                           ("/detokenize", {"tokens": [104]}), ("/v1/detokenize", {"tokens": [104]})):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = http.post(path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            ok(http, path, body, headers={"Authorization": f"Bearer {key}"})
