"""OpenAI request bodies -> SamplingParams: defaults, extensions, constraints and their refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from parrot.frontend.openai_errors import OpenAIError
from parrot.frontend.openai_requests import ChatCompletionRequest, CompletionRequest
from parrot.frontend.strict_schema import strict_schema
from parrot.serve.sampling_defaults import LLAMA_CPP, SamplingDefaults

DEFAULTS = SamplingDefaults()


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def _params(req, max_tokens: int = 16, vocab: int | None = 1000):  # noqa: ANN001, ANN202
    return req.sampling(req.sampling_fields(max_tokens, DEFAULTS, vocab), 0)


def test_defaults_fill_what_the_request_leaves_out() -> None:
    p = _params(_chat())
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (LLAMA_CPP["temperature"], LLAMA_CPP["top_k"],
                                                          LLAMA_CPP["top_p"], LLAMA_CPP["min_p"])
    p = _params(_chat(temperature=0, top_k=-1, min_p=0))
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.0, 0, LLAMA_CPP["top_p"], 0.0)  # request values win
    own = SamplingDefaults({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1})
    req = _chat()
    p = req.sampling(req.sampling_fields(8, own, None), 0)
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0.6, 20, 1.1)


def test_penalties_bias_and_extensions_pass_through() -> None:
    p = _params(_chat(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=3,
                      logit_bias={"5": -100, "7": 2.5}, stop_token_ids=[9], seed=4, ignore_eos=True))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -0.5, 1.2, 3)
    assert p.logit_bias == {5: -100.0, 7: 2.5} and p.stop_token_ids == [9] and p.seed == 4 and p.ignore_eos
    assert _chat(seed=4).sampling({"max_tokens": 1}, 2).seed == 6  # choice i: seed + i


@pytest.mark.parametrize(("kw", "param"), [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"min_tokens": 17}, "min_tokens"),
    ({"regex": "a", "choice": ["a"]}, "choice"), ({"json_schema": "{no"}, "json_schema"),
    ({"guided_choice": []}, "guided_choice"), ({"response_format": {"type": "json_schema"}},
                                               "response_format.json_schema"),
    ({"response_format": {"type": "grammar"}}, "response_format"), ({"ebnf": "root ::= x"}, "ebnf"),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs"), ({"store": True}, "store"),
    ({"use_beam_search": True}, "use_beam_search"), ({"service_tier": "flex"}, "service_tier"),
    ({"skip_special_tokens": False}, "skip_special_tokens"), ({"length_penalty": 0.5}, "length_penalty"),
    ({"typical_p": 0.2}, "typical_p"), ({"mirostat": 2}, "mirostat"), ({"prompt_logprobs": 2}, "prompt_logprobs"),
    ({"return_token_ids": True}, "return_token_ids"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_refused(kw, param) -> None:  # noqa: ANN001
    with pytest.raises(OpenAIError) as info:
        req = _chat(**kw)
        req.check()
        _params(req)
    assert info.value.status == 400 and info.value.param == param and info.value.message


@pytest.mark.parametrize(("kw", "field", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_schema", {"type": "object"}),
    ({"guided_json": {"type": "integer"}}, "json_schema", {"type": "integer"}),
    ({"json_schema": '{"type": "string"}'}, "json_schema", {"type": "string"}),  # SGLang: JSON text
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"), ({"regex": "a|b"}, "regex", "a|b"),
    ({"guided_choice": ["x", "y"]}, "choice", ["x", "y"]), ({"choice": ["z"]}, "choice", ["z"]),
    ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"'), ({"grammar": 'start: "b"'}, "grammar", 'start: "b"'),
    ({"structured_outputs": {"regex": "q"}}, "regex", "q"),
    ({"structured_outputs": {"json_object": True}}, "json_schema", {"type": "object"}),
])
def test_constraint_spellings(kw, field, value) -> None:  # noqa: ANN001
    p = _params(_chat(**kw))
    assert getattr(p, field) == value and p.constraint == field
    comp = CompletionRequest.model_validate({"prompt": "x", **kw})  # completions take them too
    assert getattr(_params(comp), field) == value


def test_strict_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"type": "object"}}},
              "$defs": {"D": {"type": "object", "additionalProperties": True}}}
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert strict["properties"]["c"]["items"]["additionalProperties"] is False
    assert strict["$defs"]["D"]["additionalProperties"] is True  # said otherwise: kept
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert _params(_chat(response_format=rf)).json_schema == strict
    rf["json_schema"]["strict"] = False
    assert _params(_chat(response_format=rf)).json_schema == schema


def test_logprob_fields() -> None:
    assert _chat(logprobs=True, top_logprobs=3).logprob_fields() == {"logprobs": 3}
    assert _chat(logprobs=True).logprob_fields() == {"logprobs": 0}
    assert _chat().logprob_fields() == {}
    with pytest.raises(OpenAIError):
        _chat(top_logprobs=2).check()  # without logprobs: true
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 2}).logprob_fields() == {"logprobs": 2}
    echo = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2, "echo": True, "max_tokens": 0})
    echo.check()
    assert echo.prompt_logprobs == 2 and echo.logprob_fields() == {"logprobs": 2}
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 2}).prompt_logprobs is None
    with pytest.raises(OpenAIError) as info:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0}).check()  # nothing to answer
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([5, 6, 7], [[5, 6, 7]]), ([[5], [6, 7]], [[5], [6, 7]]),
    ([0, 999], [[0, 999]]),
])
def test_prompt_shapes(prompt, prompts) -> None:  # noqa: ANN001
    """A string, strings, one prompt of token ids, or several: each is one prompt, token ids kept as given."""
    assert CompletionRequest.model_validate({"prompt": prompt}).check(vocab_size=1000) == prompts


@pytest.mark.parametrize("prompt, says", [
    ([], "empty list"), ([[]], "empty list of token ids"), ([[1], []], "prompt 1 is an empty list"), ([""], "empty"),
    ([1000], "outside the vocabulary"), ([-1, 2], "outside the vocabulary"), ([[1], [2, 10**12]], "outside"),
])
def test_bad_prompts_are_refused_by_check(prompt, says: str) -> None:  # noqa: ANN001
    with pytest.raises(OpenAIError) as info:
        CompletionRequest.model_validate({"prompt": prompt}).check(vocab_size=1000)
    assert info.value.status == 400 and info.value.param == "prompt" and says in info.value.message


@pytest.mark.parametrize("prompt", [[1, "a"], ["a", [1]], [[1], 2], [[1, "a"]], [True, 1], [1.5], [None], 3])
def test_mixed_or_malformed_prompts_are_invalid(prompt) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="prompt"):
        CompletionRequest.model_validate({"prompt": prompt})


def test_vllm_fields_at_their_defaults_and_nulls_are_taken() -> None:
    """What vLLM's clients send with every request: other servers' fields at the value that changes nothing, and
    `null` for fields OpenAI marks nullable."""
    neutral = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "length_penalty": 1,
               "use_beam_search": False, "include_stop_str_in_output": False, "bad_words": [],
               "logits_processors": None, "truncate_prompt_tokens": None, "add_generation_prompt": True,
               "continue_final_message": False, "chat_template_kwargs": {}, "typical_p": 1.0, "mirostat": 0,
               "return_token_ids": False, "prompt_logprobs": None}
    req = _chat(n=None, stream=None, ignore_eos=None, **neutral)
    req.check()
    assert (req.n, req.stream, req.ignore_eos) == (1, False, False)
    completion = CompletionRequest.model_validate({"prompt": "x", "echo": None, "n": None})
    completion.check()
    assert (completion.echo, completion.n) == (False, 1)


def test_seeds_are_64_bit_integers() -> None:
    assert _chat(seed=-1).sampling({"max_tokens": 1}, 0).seed == 2**64 - 1
    assert _chat(seed=2**63 - 1).sampling({"max_tokens": 1}, 1).seed == 2**63
    assert _chat(seed=2**32).sampling({"max_tokens": 1}, 0).seed == 2**32  # not folded onto seed 0
    for bad in (2**63, -2**63 - 1):  # vLLM's range: a signed 64-bit integer
        with pytest.raises(ValidationError, match="seed"):
            _chat(seed=bad)
