"""Engine token logprobs (`parrot.protocol.TokenLogprob`) -> OpenAI's logprobs shapes.

Chat: `choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}], "refusal": null}`. Completions: `choice.logprobs = {"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}`, offsets counted in the choice's text. With `echo` the
prompt's tokens come first; the first has no logprob (`null` in `token_logprobs` and `top_logprobs`, as
OpenAI and vLLM answer).

The logprobs are the model's raw distribution (log-softmax of the logits), taken before temperature,
penalties, logit_bias and constraint masks, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from parrot.protocol import TokenLogprob, token_offsets


def chat_content(items: Sequence[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes), "top_logprobs": [
        {"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in t.top[:top_n]]} for t in items]


def chat_logprobs(items: Sequence[TokenLogprob], top_n: int) -> dict[str, Any]:
    return {"content": chat_content(items, top_n), "refusal": None}


def completion_logprobs(items: Sequence[TokenLogprob], top_n: int, offset: int = 0) -> dict[str, Any]:
    """`top_logprobs`: each token's `top_n` most likely alternatives and the token itself (OpenAI: "the API
    will always return the logprob of the sampled token, so there may be up to logprobs+1 elements"; vLLM
    the same, also for echoed prompt tokens). `text_offset`: each token's offset in characters of the text (a
    token holding part of a character starts where that character does)."""
    def top(t: TokenLogprob) -> dict[str, float] | None:
        if t.logprob is None:
            return None
        out = {a.token: a.logprob for a in t.top[:top_n]}
        out.setdefault(t.token, t.logprob)
        return out

    tops = [top(t) for t in items]
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items], "top_logprobs": tops,
            "text_offset": token_offsets(items, offset)}
