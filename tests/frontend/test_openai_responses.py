"""POST /v1/responses (OpenAI's Responses API) through the real `openai` client against a real uvicorn server on
loopback: the serve core and an embedded engine running a tiny random model (byte-level tokenizer: token 32 is
"A", 257 is EOS). Every parameter of `client.responses.create` is honoured or refused with a 400 naming it."""

from __future__ import annotations

import dataclasses
import inspect
import json

import openai
import pytest
from pydantic import BaseModel, Field

from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.engine.models.llama import random_weights
from parrot.frontend.openai_responses import REFUSED
from tests.conftest import TINY, tiny_engine_config, tiny_tokenizer
from tests.servers import serving_core

A = 32
ALL_A = {"logit_bias": {str(A): 100}, "ignore_eos": True}  # vLLM's extensions, passed on to the chat route
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
HONOURED = {"input", "instructions", "max_output_tokens", "model", "parallel_tool_calls", "stream", "stream_options",
            "temperature", "text", "tool_choice", "tools", "top_p", "metadata", "store", "user", "safety_identifier",
            "prompt_cache_key", "prompt_cache_retention", "service_tier", "include", "top_logprobs"}
CLIENT_ONLY = {"extra_headers", "extra_query", "extra_body", "timeout"}


@pytest.fixture(scope="module")
def client():
    cfg = dataclasses.replace(TINY, max_position=2048)  # a tool prompt in a byte-level vocabulary is long
    model = LoadedModel(cfg, random_weights(cfg, seed=0), tiny_tokenizer(), "tiny-random")
    engine = LLMEngine(model, tiny_engine_config(kv_memory_mb=16, kv_buckets=[64, 128, 256, 512, 1024, 2048])
                       ).start(precompile=False)
    with serving_core(engine, "tiny", model.tokenizer) as (url, _), \
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c
    engine.shutdown()


def test_every_client_parameter_is_covered() -> None:
    params = set(inspect.signature(openai.OpenAI(api_key="x").responses.create).parameters) - CLIENT_ONLY
    assert params <= HONOURED | set(REFUSED), f"untested parameters: {params - HONOURED - set(REFUSED)}"


def test_text_answer_equals_the_chat_answer(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Say something.", max_output_tokens=6,
                                temperature=0, metadata={"k": "v"})
    chat = client.chat.completions.create(model="tiny", max_completion_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny" and r.metadata == {"k": "v"}
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"


def test_an_empty_answer_is_an_empty_message(client: openai.OpenAI) -> None:
    eos = {"logit_bias": {"257": 100}}
    r = client.responses.create(model="tiny", input="x", max_output_tokens=4, temperature=0, extra_body=eos)
    assert r.status == "completed" and [i.type for i in r.output] == ["message"] and r.output_text == ""
    events = list(client.responses.create(model="tiny", input="x", max_output_tokens=4, temperature=0,
                                          extra_body=eos, stream=True))
    assert [i.type for i in events[-1].response.output] == ["message"] and events[-1].type == "response.completed"
    assert not [e for e in events if e.type == "response.output_text.delta"]


def test_max_output_tokens_leaves_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="x", max_output_tokens=4, temperature=0, extra_body=ALL_A)
    assert r.output_text == "AAAA" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 4


def test_streamed_events(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "something."}]}],
        max_output_tokens=5, temperature=0, stream=True, extra_body=ALL_A))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == "AAAAA" and final.usage.output_tokens == 5
    assert events[0].response.status == "in_progress" and final.status == "incomplete"


def test_function_calls_and_their_results(client: openai.OpenAI) -> None:
    """A forced call comes back as a function_call item (streamed: its arguments in deltas); given back as input
    with its output, the model answers in text."""
    forced = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice=forced,
                                max_output_tokens=60, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice=forced, max_output_tokens=60, temperature=0, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert streamed == done.arguments == call.arguments and events[-1].response.output[0].arguments == call.arguments
    again = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], extra_body=ALL_A)
    assert again.output_text == "AAAAA"


def test_structured_output(client: openai.OpenAI) -> None:
    class City(BaseModel):
        name: str = Field(max_length=8)  # the random model's strings end there

    r = client.responses.parse(model="tiny", input="A city?", text_format=City, max_output_tokens=80, temperature=0)
    assert isinstance(r.output_parsed, City)


@pytest.mark.parametrize(("kw", "param"), [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"), ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include.1"),
    ({"truncation": "auto"}, "truncation"), ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"), ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"), ({"top_logprobs": 21}, "top_logprobs"),
])
def test_refused(client: openai.OpenAI, kw: dict, param: str) -> None:
    kw = {"model": "tiny", "input": "x", **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kw)
    assert info.value.status_code == 400 and info.value.param == param, (info.value.param, info.value.message)


def test_neutral_values_are_taken(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False, include=[], background=False,
                                truncation="disabled", temperature=0, extra_body=ALL_A)
    assert r.output_text == "AA" and r.store is False


def test_malformed_bodies_are_400s_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny")  # no input
    assert info.value.param == "input"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input=[{"type": "function_call", "call_id": "c", "name": "f"}])
    assert info.value.param == "input.0.arguments"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", max_output_tokens=0)
    assert info.value.param == "max_output_tokens"


def test_logprobs_are_the_chat_routes(client: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: each token's logprob and alternatives on
    the output_text part, as the chat route gives them; streamed, on the deltas, adding up to the part's."""
    kw = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
    r = client.responses.create(input="Say something.", include=["message.output_text.logprobs"], top_logprobs=2,
                                **kw)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Say something."}], logprobs=True,
                                          top_logprobs=2, max_completion_tokens=4, temperature=0, model="tiny")
    part = r.output[0].content[0]
    def seen(logprobs: list) -> list[tuple]:
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in logprobs]

    want = seen(chat.choices[0].logprobs.content)
    assert seen(part.logprobs) == want
    assert len(want) == 4 and all(len(alts) == 2 for _, _, alts in want)
    events = list(client.responses.create(input="Say something.", top_logprobs=2, stream=True, **kw))
    deltas = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == [lp.token for lp in done.logprobs] == [t for t, _, _ in want]
    plain = client.responses.create(input="Say something.", **kw)
    assert plain.output[0].content[0].logprobs == []  # not asked for: none


def test_an_item_cut_short_is_incomplete(client: openai.OpenAI) -> None:
    """max_output_tokens ends the answer inside an item: that item's status is "incomplete" (a function call's
    arguments are not whole JSON then), streamed or not."""
    forced = {"type": "function", "name": "get_weather"}
    for stream in (False, True):
        got = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice=forced,
                                      max_output_tokens=3, temperature=0, stream=stream)
        r = list(got)[-1].response if stream else got
        assert r.status == "incomplete" and [(i.type, i.status) for i in r.output] == [("function_call", "incomplete")]
        got = client.responses.create(model="tiny", input="x", max_output_tokens=2, temperature=0, extra_body=ALL_A,
                                      stream=stream)
        r = list(got)[-1].response if stream else got
        assert [(i.type, i.status) for i in r.output] == [("message", "incomplete")]
    whole = client.responses.create(model="tiny", input="x", max_output_tokens=4, temperature=0,
                                    extra_body={"logit_bias": {"257": 100}})
    assert [(i.type, i.status) for i in whole.output] == [("message", "completed")]


def test_a_stream_of_any_text_is_whole(client: openai.OpenAI) -> None:
    """Text holding U+2028, U+2029 or U+0085 (line breaks to str.splitlines, not to SSE) streams to its end."""
    odd = "\u2028\u2029\u0085"
    events = list(client.responses.create(model="tiny", input="x", max_output_tokens=9, temperature=0, stream=True,
                                          extra_body={"guided_regex": f"[{odd}]{{3}}", "ignore_eos": True}))
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and len(text) == 3 and set(text) <= set(odd)


def test_defaults_echoed_back_are_taken(client: openai.OpenAI) -> None:
    """A Response's settings sent back as they came (tool_choice "auto" with no tools: the default)."""
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2, temperature=0, extra_body=ALL_A)
    assert r.tool_choice == "auto" and r.tools == [] and r.text.format.type == "text"
    again = client.responses.create(model="tiny", input="x", max_output_tokens=2, temperature=0, extra_body=ALL_A,
                                    tool_choice=r.tool_choice, tools=r.tools, text={"verbosity": "medium"})
    assert again.output_text == "AA" and again.text.format.type == "text" and again.text.verbosity == "medium"


@pytest.mark.parametrize(("kw", "param"), [
    ({"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"},
                                             {"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input.1.call_id"),  # message 2 of the chat completion it became: the instructions are message 0
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
])
def test_errors_name_the_responses_fields(client: openai.OpenAI, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", **kw)
    e = info.value
    assert e.param == param, (e.param, e.message)
    assert not any(w in e.message for w in ("messages", "max_tokens", "response_format", "tool_call_id")), e.message
