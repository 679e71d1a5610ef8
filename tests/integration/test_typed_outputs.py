"""Typed outputs through a real server with the default model (SmolLM2-135M-Instruct), driven by the real
clients app builders use: the `openai` client's `chat.completions.parse` with a pydantic model, a named
`tool_choice`, `top_logprobs` and completion `logprobs`; LangChain's `with_structured_output` (its default
method, json_schema, json_mode and function_calling) and `bind_tools`; the Parrot SDK's typed outputs."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

import parrot as P
from parrot.config import EngineConfig
from parrot.engine.engine import LLMEngine
from tests.servers import serving_core

pytestmark = pytest.mark.model


class Capital(BaseModel):
    country: str = Field(max_length=16)
    capital: str = Field(max_length=16)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=16, description="the city")
    unit: Literal["celsius", "fahrenheit"]


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def url(smollm):  # noqa: ANN001
    cfg = EngineConfig(compilation_cache_dir=None, kv_memory_mb=256, max_batch_size=4, bs_buckets=[1, 2, 4],
                       token_buckets=[16, 32, 64, 128], max_num_batched_tokens=128, prefill_bs_buckets=[1],
                       kv_buckets=[128, 256, 512, 1024], cascade_suffix_buckets=[64, 128], precompile=False)
    engine = LLMEngine(smollm, cfg).start(precompile=False)
    with serving_core(engine, "smollm2", smollm.tokenizer) as (base, _):
        yield base
    engine.shutdown()


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


def test_openai_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model="smollm2", messages=QUESTION, response_format=Capital, max_tokens=40,
                                      temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.capital and parsed.country
    assert "Paris" in parsed.capital


def test_named_tool_choice_returns_a_valid_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What's the weather like in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and args["city"]


def test_logprobs_in_the_openai_shape(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, logprobs=True, top_logprobs=5,
                                       max_tokens=6, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 5 and t.top_logprobs[0].token == t.token for t in content)  # greedy
    assert bytes(b for t in content for b in t.bytes).decode() == r.choices[0].message.content
    c = client.completions.create(model="smollm2", prompt="The capital of France is", logprobs=3, max_tokens=4,
                                  temperature=0)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(top) == 3 and max(top.values()) <= 0 and tok in top for top, tok in zip(lp.top_logprobs, lp.tokens,
                                                                                          strict=True))  # greedy
    assert lp.text_offset[0] == 0 and lp.tokens[0].strip() == "Paris"


def test_langchain_structured_output_and_tools(url: str) -> None:
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (pip install -e '.[test]')")
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="x", model="smollm2", max_tokens=48, temperature=0,
                     max_retries=0, timeout=300)
    for method in (None, "json_schema", "json_mode", "function_calling"):
        kw = {} if method is None else {"method": method}
        question = "Give the capital of France as JSON with keys country and capital." if method == "json_mode" else \
            "What is the capital of France?"
        out = llm.with_structured_output(Capital, **kw).invoke(question)
        assert isinstance(out, Capital) and out.capital, method
    forced = llm.bind_tools([Weather], tool_choice="Weather").invoke("What's the weather in Paris?")
    assert isinstance(forced, AIMessage) and forced.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(forced.tool_calls[0]["args"])
    free = llm.bind_tools([Weather]).invoke("Hello!")  # auto: the model may answer in prose
    assert isinstance(free, AIMessage) and (free.content or free.tool_calls)


def test_sdk_typed_outputs(url: str) -> None:
    @P.semantic_function
    def capital(country: P.Input, answer: P.Output(max_tokens=40, schema=Capital)):
        """<|im_start|>user
        What is the capital of {{country}}? Answer in JSON.<|im_end|>
        <|im_start|>assistant
        {{answer}}"""

    @P.semantic_function
    def yes_no(question: P.Input, answer: P.Output(max_tokens=4, choices=["yes", "no"])):
        """<|im_start|>user
        {{question}} Answer yes or no.<|im_end|>
        <|im_start|>assistant
        {{answer}}"""

    with P.VirtualMachine(url, timeout=300) as vm:
        c = capital("France")
        city = P.transform("json_field", {"path": "capital"}, text=c)  # routed on the server
        a = yes_no("Is Paris in France?")
        got = c.get()
        assert isinstance(got, Capital) and got.capital == city.get()
        assert a.get() in ("yes", "no")
        types = {v["id"]: v.get("type") for v in vm.inspect()["variables"]}
        assert types[a.id] == {"choice": ["yes", "no"]} and "json_schema" in types[c.id]
