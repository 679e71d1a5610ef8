"""The differential run's comparison: what counts as a difference between a job's run in a mix and alone."""

from __future__ import annotations

from benchmarks.differential import difference
from parrot.protocol import GenerateResponse, TokenLogprob, TopLogprob


def _reply(tokens: list[int], logprob: float = -0.5, finish: str = "length") -> GenerateResponse:
    lps = [TokenLogprob(token_id=t, token="x", bytes=[120], logprob=logprob,
                        top=[TopLogprob(token_id=t, token="x", bytes=[120], logprob=logprob)]) for t in tokens]
    return GenerateResponse(context_id="c", token_ids=tokens, text="", finish_reason=finish,
                            num_tokens=len(tokens), logprobs=lps)


def test_the_same_replies_agree() -> None:
    assert difference([_reply([1, 2, 3])], [_reply([1, 2, 3])], exact=True) is None
    assert difference("NotFoundError('x')", "NotFoundError('x')", exact=True) is None


def test_tokens_finish_and_errors_differ() -> None:
    assert difference([_reply([1, 2, 3])], [_reply([1, 5, 3])], exact=True) == (
        "reply 0: tokens differ from token 1 (3 / 3 tokens)")
    shorter = difference([_reply([1, 2])], [_reply([1, 2, 3])], exact=False)
    assert shorter == "reply 0: tokens differ from token 2 (2 / 3 tokens)"
    assert difference([_reply([1], finish="stop")], [_reply([1])], exact=True) == "reply 0: finish stop / length"
    assert difference([_reply([1])], "AbortedError('gone')", exact=True).startswith("errors:")


def test_logprobs_bit_for_bit_where_exact_within_a_tolerance_elsewhere() -> None:
    a, b = [_reply([7, 8]), _reply([9])], [_reply([7, 8]), _reply([9], logprob=-0.5 + 5e-7)]
    assert difference(a, b, exact=True) == "reply 1: logprobs differ at token 0 (by 5e-07)"
    assert difference(a, b, exact=False) is None
    far = [_reply([7, 8]), _reply([9], logprob=-0.4)]
    assert difference(a, far, exact=False) == "reply 1: logprobs differ at token 0 (by 0.1)"
