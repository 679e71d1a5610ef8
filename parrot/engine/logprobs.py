"""Log probabilities as the API returns them: a sampled token's raw logprob and its most likely alternatives,
with each token's text and bytes; and the prompt logprobs of a fill's tokens (`token_logprobs`, on the
device, from the hidden states of the positions before them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import pre_tokenizers

from parrot.engine import kernels
from parrot.engine.sampling import native_sampler
from parrot.engine.tokenizer import Tokenizer
from parrot.protocol import MAX_LOGPROBS, TokenLogprob, TopLogprob


@dataclass
class SampledLogprob:
    """What the sampler returned for one sequence: the chosen token's raw logprob and the top tokens."""

    logprob: float
    top_ids: np.ndarray  # [MAX_LOGPROBS] int32, most likely first
    top_logprobs: np.ndarray  # [MAX_LOGPROBS] float32


def token_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [R, V] (each row: the position before a target token), targets [R] -> (the targets' raw
    logprobs [R], the MAX_LOGPROBS most likely tokens [R, K] and their logprobs [R, K]). On a CPU with the
    native kernels, a row at a time while it is in the cache (`kernels.logprobs`)."""
    if native_sampler():  # the native kernels' logprobs go with their sampler
        return kernels.logprobs(logits, targets, jnp.ones(logits.shape[0], bool), MAX_LOGPROBS)
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(raw, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(raw, MAX_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_lp


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode) back to bytes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in table]
    chars = {**{chr(b): b for b in table}, **{chr(256 + n): b for n, b in enumerate(extra)}}
    assert set(chars) == set(alphabet)
    return chars


class TokenTexts:
    """Each token's bytes and printable text (a token that is not whole UTF-8 reads "bytes:\\xNN...")."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special = set(tokenizer.backend.get_added_tokens_decoder())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.backend.id_to_token(token_id)
        if piece is None:
            return b""
        decoder = _byte_level_decoder()
        if token_id not in self._special and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def logprob(self, token_id: int, sampled: SampledLogprob, top: int) -> TokenLogprob:
        """`token_id`'s TokenLogprob with its `top` most likely alternatives."""
        text, raw = self.piece(token_id)
        alts = []
        for t, lp in zip(sampled.top_ids[:top].tolist(), sampled.top_logprobs[:top].tolist(), strict=True):
            t_text, t_raw = self.piece(t)
            alts.append(TopLogprob(token_id=t, token=t_text, bytes=t_raw, logprob=lp))
        return TokenLogprob(token_id=token_id, token=text, bytes=raw, logprob=sampled.logprob, top=alts)

    def unpredicted(self, token_id: int) -> TokenLogprob:
        """A context's first token: its text, no logprob (nothing before it predicts it)."""
        text, raw = self.piece(token_id)
        return TokenLogprob(token_id=token_id, token=text, bytes=raw, logprob=None)
