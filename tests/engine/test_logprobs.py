"""TokenTexts: each token's bytes and printable text, and TokenLogprob from the sampler's output."""

from __future__ import annotations

import numpy as np

from parrot.engine.logprobs import SampledLogprob, TokenTexts
from tests.conftest import tiny_tokenizer


def test_token_bytes_and_text() -> None:
    tok = tiny_tokenizer()
    texts = TokenTexts(tok)
    a, = tok.encode("a")
    e_acute = tok.encode("é")  # two byte tokens, neither whole UTF-8
    assert texts.piece(a) == ("a", [97])
    assert [texts.piece(t) for t in e_acute] == [("bytes:\\xc3", [0xC3]), ("bytes:\\xa9", [0xA9])]
    assert texts.piece(257) == ("<|im_end|>", list(b"<|im_end|>"))  # a control token: its literal text


def test_token_logprob_with_alternatives() -> None:
    tok = tiny_tokenizer()
    texts = TokenTexts(tok)
    a, b, c = tok.encode("abc")
    sampled = SampledLogprob(-0.25, np.array([b, a, c], np.int32), np.array([-0.25, -1.5, -3.0], np.float32))
    lp = texts.logprob(b, sampled, 2)
    assert (lp.token_id, lp.token, lp.bytes, lp.logprob) == (b, "b", [98], -0.25)
    assert [(t.token_id, t.token, t.logprob) for t in lp.top] == [(b, "b", -0.25), (a, "a", -1.5)]
    assert texts.logprob(b, sampled, 0).top == []
