"""The serve differential run's comparison: answers put together from the openai client's objects (streamed and
not), and what counts as a difference between a request's answer in a mix and alone. No model, no server."""

from __future__ import annotations

import random
from typing import Any

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from benchmarks.serve_differential import (
    KINDS,
    SYSTEM,
    Case,
    case_report,
    chat_choices,
    chat_stream_choices,
    compare,
    completion_choices,
    completion_stream_choices,
    describe_request,
    engines_of,
    first_divergence,
    judge,
    logprob_gap,
    make_case,
)


def _choice(text: str = "Hello there", finish: str = "length", logprobs: list | None = None,
            tools: list | None = None, index: int = 0) -> dict[str, Any]:
    return {"index": index, "text": text, "finish": finish, "tools": tools, "logprobs": logprobs}


def _answer(*choices: dict[str, Any]) -> dict[str, Any]:
    return {"choices": list(choices), "seconds": 0.1}


def _lps(*values: float) -> list[list[Any]]:
    return [[f"t{k}", v, [[f"t{k}", v], ["x", v - 1.0]]] for k, v in enumerate(values)]


def test_first_divergence() -> None:
    assert first_divergence("abcdef", "abcxef") == 3
    assert first_divergence("abc", "abcdef") == 3
    assert first_divergence("", "a") == 0
    assert first_divergence("same", "same") == 4


def test_the_same_answers_agree() -> None:
    a = _answer(_choice(logprobs=_lps(-0.5, -1.25)), _choice("Hi", "stop", index=1))
    b = _answer(_choice(logprobs=_lps(-0.5, -1.25)), _choice("Hi", "stop", index=1))
    assert compare(a, b) == (None, 0.0)


def test_text_finish_tools_and_choices_differ() -> None:
    where, _ = compare(_answer(_choice("The sea is blue")), _answer(_choice("The sea is green")))
    assert where == "choice 0: text differs from char 11 (15 / 16 chars): 'The sea is blue' / 'The sea is green'"
    assert compare(_answer(_choice(finish="stop")), _answer(_choice()))[0] == "choice 0: finish stop / length"
    tools = compare(_answer(_choice(tools=[["get_time", '{"city": "Oslo"}']])),
                    _answer(_choice(tools=[["get_time", '{"city": "Lima"}']])))[0]
    assert tools is not None and tools.startswith("choice 0: tool calls")
    assert compare(_answer(_choice()), _answer(_choice(), _choice(index=1)))[0] == "1 / 2 choices"


def test_an_error_on_either_side_is_a_difference() -> None:
    err = {"error": "APITimeoutError: Request timed out.", "seconds": 300.0}
    assert compare(err, _answer(_choice()))[0] == "error: APITimeoutError: Request timed out. / ok"
    assert compare(err, err)[0] is not None  # the same error twice is still a failure


def test_a_request_larger_than_the_pool_refused_on_both_sides_agrees() -> None:
    """The refusals that depend on the request alone (a pool or a model length smaller than it); any other error
    twice, or such a refusal on one side only, is still a difference."""
    big = {"error": "BadRequestError: Error code: 400 - context 'completion-1' needs 292 tokens of KV; the whole "
                    "cache holds 288", "seconds": 0.1}
    other = {"error": big["error"].replace("completion-1", "s-2"), "seconds": 0.2}
    assert compare(big, other) == (None, 0.0)
    assert compare(big, _answer(_choice()))[0] is not None
    long = {"error": "BadRequestError: Error code: 400 - this model's maximum context length is 256 tokens; the "
                     "messages has 252 tokens and max_tokens is 40", "seconds": 0.1}
    assert compare(long, long) == (None, 0.0)
    var = {"error": "VariableFailedError: semantic variable 'author' (var-a) failed: context 's-1' would exceed the "
                    "model's maximum length 256: it holds 247 tokens, max_tokens adds 47", "seconds": 0.1}
    assert compare(var, dict(var, error=var["error"].replace("var-a", "var-b"))) == (None, 0.0)
    assert compare(long, _answer(_choice()))[0] is not None
    full = {"error": "BadRequestError: Error code: 400 - KV cache is full: 1 page(s) needed", "seconds": 1.0}
    assert compare(full, full)[0] is not None


def test_logprobs_bit_for_bit_unless_a_tolerance_is_given() -> None:
    a, b = _answer(_choice(logprobs=_lps(-0.5, -1.0))), _answer(_choice(logprobs=_lps(-0.5, -1.0 + 3e-7)))
    where, gap = compare(a, b)
    assert where == "logprobs differ by up to 3e-07" and 2e-7 < gap < 4e-7
    assert compare(a, b, tolerance=1e-6)[0] is None
    # where the texts differ, the text is reported first, and the gap is still measured
    where, gap = compare(_answer(_choice("ab", logprobs=_lps(-0.5))), _answer(_choice("ac", logprobs=_lps(-0.25))))
    assert where is not None and where.startswith("choice 0: text differs from char 1") and gap == 0.25


def test_logprob_tokens_lengths_and_nulls() -> None:
    other = [["t0", -0.5, [["t0", -0.5], ["y", -1.5]]]]
    assert logprob_gap(_lps(-0.5), other)[0] == "top_logprobs tokens differ at token 0 (['t0', 'x'] / ['t0', 'y'])"
    assert logprob_gap(_lps(-0.5), [["u", -0.5, []]])[0] == "logprob tokens differ at token 0 ('t0' / 'u')"
    assert logprob_gap(_lps(-0.5), _lps(-0.5, -1.0))[0] == "1 / 2 logprob tokens"
    assert logprob_gap(None, _lps(-0.5))[0] == "logprobs missing / present"
    echo = [["Here", None, []], ["is", -2.0, [["is", -2.0]]]]  # an echoed prompt's first token has none
    assert logprob_gap(echo, echo) == (None, 0.0)
    assert logprob_gap(echo, [["Here", -1.0, []], echo[1]])[0] == "logprob None / -1.0 at token 0"
    assert logprob_gap(None, None) == (None, 0.0)


def test_judge_checks_the_stream_alone_against_the_unstreamed_answer() -> None:
    case = Case("chat", {"model": "smollm2"}, stream=True)
    case.outcomes = {"mix": _answer(_choice("A B")), "alone": _answer(_choice("A B")),
                     "alone_unstreamed": _answer(_choice("A C"))}
    verdict = judge(case)
    assert verdict.mix is None and verdict.stream is not None and verdict.differed
    assert case_report(3, case, verdict)["outcomes"] == case.outcomes  # every answer of a case that differed
    case.outcomes["alone_unstreamed"] = _answer(_choice("A B"))
    verdict = judge(case)
    assert not verdict.differed
    report = case_report(3, case, verdict)
    assert report["texts"] == ["A B"] and "outcomes" not in report and report["mix_vs_alone"] is None


def _chat(content: str | None, finish: str, tool_calls: list | None = None, logprobs: list | None = None) -> dict:
    return {"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": content,
                                                             "tool_calls": tool_calls},
            "logprobs": None if logprobs is None else {"content": logprobs}}


def _token(token: str, logprob: float) -> dict:
    return {"token": token, "bytes": list(token.encode()), "logprob": logprob,
            "top_logprobs": [{"token": token, "bytes": list(token.encode()), "logprob": logprob}]}


def _chunk(index: int, delta: dict, finish: str | None = None, logprobs: list | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                     "logprobs": None if logprobs is None else {"content": logprobs}}]})


def test_a_chat_stream_put_together_equals_the_whole_answer() -> None:
    whole = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [_chat("The sea", "length", logprobs=[_token("The", -0.1), _token(" sea", -0.2)]),
                    dict(_chat("A", "stop", logprobs=[_token("A", -0.3)]), index=1)]})
    chunks = [_chunk(0, {"role": "assistant", "content": ""}), _chunk(1, {"role": "assistant", "content": ""}),
              _chunk(0, {"content": "The"}, logprobs=[_token("The", -0.1)]),
              _chunk(1, {"content": "A"}, logprobs=[_token("A", -0.3)]), _chunk(1, {}, "stop"),
              _chunk(0, {"content": " sea"}, logprobs=[_token(" sea", -0.2)]), _chunk(0, {}, "length")]
    assert chat_stream_choices(chunks, True) == chat_choices(whole, True)
    assert chat_choices(whole, True)[1] == _choice("A", "stop", [["A", -0.3, [["A", -0.3]]]], index=1)
    assert chat_choices(whole, False)[0]["logprobs"] is None


def test_a_streamed_tool_call_put_together_equals_the_whole_one() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}
    whole = ChatCompletion.model_validate({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                           "choices": [_chat(None, "tool_calls", tool_calls=[call])]})
    chunks = [_chunk(0, {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                         "function": {"name": "get_time", "arguments": ""}}]}),
              _chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
              _chunk(0, {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
              _chunk(0, {}, "tool_calls")]
    assert chat_stream_choices(chunks, False) == chat_choices(whole, False)
    assert chat_choices(whole, False)[0]["tools"] == [["get_time", '{"city": "Oslo"}']]  # the id is not compared


def test_a_completion_stream_put_together_equals_the_whole_answer() -> None:
    def completion(text: str, tokens: list[str], values: list[float], finish: str | None) -> Completion:
        tops = [{t: v} for t, v in zip(tokens, values, strict=True)]
        return Completion.model_validate({
            "id": "x", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish or "length",
                         "logprobs": {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                                      "text_offset": [0] * len(tokens)}}]})

    whole = completion("Q: A B", ["Q:", " A", " B"], [-2.0, -0.5, -0.25], "stop")
    parts = [completion("Q:", ["Q:"], [-2.0], None), completion(" A", [" A"], [-0.5], None),
             completion(" B", [" B"], [-0.25], "stop")]
    for part in parts[:2]:
        part.choices[0].finish_reason = None  # type: ignore[assignment]
    assert completion_stream_choices(parts, True) == completion_choices(whole, True)
    assert completion_choices(whole, True)[0]["logprobs"][0] == ["Q:", -2.0, [["Q:", -2.0]]]
    assert completion_choices(whole, False)[0]["logprobs"] is None


def test_requests_are_reproducible_and_never_sample_unseeded() -> None:
    a = [make_case(random.Random(7)) for _ in range(3)]
    assert [c.body for c in a] == [make_case(random.Random(7)).body for _ in range(3)]
    seen = set()
    rng = random.Random(0)
    for _ in range(400):
        case = make_case(rng)
        seen.add(case.kind)
        if case.api == "rest":
            for sampling in (case.body["first"], case.body["second"]):
                assert sampling.get("temperature", 0.0) == 0.0 or "seed" in sampling
                assert 1 <= sampling["max_tokens"] <= 48
        else:
            assert case.body["temperature"] == 0.0 or "seed" in case.body
            assert 1 <= case.body["max_tokens"] <= 48
    assert seen == set(KINDS)
    assert {make_case(random.Random(s), ["chat_tools"]).kind for s in range(5)} == {"chat_tools"}


def test_sampling_options_are_valid_requests_with_extensions_in_extra_body() -> None:
    rng = random.Random(3)
    seen: set[str] = set()
    for _ in range(200):
        body = make_case(rng, ["chat_sampling", "completion_sampling"]).body
        extra = body.get("extra_body", {})
        seen |= set(extra) | {k for k in body if k.endswith("penalty") or k == "logit_bias"}
        assert set(extra) <= {"repetition_penalty", "top_k", "min_p", "min_tokens", "stop_token_ids"}
        assert extra.get("min_tokens", 0) <= body["max_tokens"]
        assert all(-2.0 <= body.get(k, 0.0) <= 2.0 for k in ("frequency_penalty", "presence_penalty"))
        assert all(-100 <= b <= 100 for b in body.get("logit_bias", {}).values())
        assert body["temperature"] == 0.0 or "seed" in body
    assert seen == {"frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "top_k", "min_p",
                    "min_tokens", "stop_token_ids"}


def test_the_shared_system_prompt_is_elided_in_the_report() -> None:
    case = Case("chat_system", {"model": "smollm2", "messages": [{"role": "system", "content": SYSTEM}]}, stream=True)
    line = describe_request(case)
    assert line.startswith("chat_system stream ") and "<SYSTEM>" in line and SYSTEM[:40] not in line


def test_engines_of_reads_the_serve_arguments() -> None:
    assert engines_of(["--kv-memory-mb", "7"]) == 1
    assert engines_of(["--engines", "2"]) == 2 and engines_of(["--engines=3", "--no-overlap"]) == 3
