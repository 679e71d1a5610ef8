"""TokenizerManager: one tokenizer per model, loaded once (metadata only, no weights, no JAX).

The serve layer tokenizes prompts itself and sends token ids to the engines. A rendered prompt is a
sequence of pieces (constant text, variable values) that live in different KV contexts, yet the ids of
the whole must be exactly those a plain completion of the same text gets: `encode_pieces` tokenizes the
concatenation once and splits the ids back at the piece boundaries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from parrot.engine.model_files import DEFAULT_MODEL
from parrot.engine.tokenizer import Tokenizer, encodable, load_tokenizer

Loader = Callable[[str | Path | None], Tokenizer]


class TokenizerManager:
    """Tokenizers by model name. A name is looked up in `models` (name -> GGUF file or Hugging Face
    directory), else given to `load_tokenizer` as is: 'smollm2' (or None) is the default model, anything
    else a path. `register` adds a tokenizer (or a location) under a name, e.g. when an engine registers."""

    def __init__(self, models: Mapping[str, str | Path] | None = None, loader: Loader = load_tokenizer) -> None:
        self._locations: dict[str, str | Path] = dict(models or {})
        self._loader = loader
        self._tokenizers: dict[str, Tokenizer] = {}
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}

    def register(self, model: str, tokenizer: Tokenizer | str | Path) -> None:
        """Name a tokenizer, or the location to load it from on first use."""
        with self._lock:
            if isinstance(tokenizer, Tokenizer):
                self._tokenizers[model] = tokenizer
            else:
                self._tokenizers.pop(model, None)
                self._locations[model] = tokenizer

    def get(self, model: str | None = None) -> Tokenizer:
        """The model's tokenizer, loaded on first use (concurrent first uses load it once). Raises
        ModelLoadError if it cannot be found or read; a failed load is retried on the next call."""
        name = DEFAULT_MODEL if model is None else model
        tok = self._tokenizers.get(name)
        if tok is not None:
            return tok
        with self._lock:
            lock = self._loading.setdefault(name, threading.Lock())
        with lock:
            tok = self._tokenizers.get(name)
            if tok is None:
                tok = self._loader(self._locations.get(name, name))
                with self._lock:
                    self._tokenizers[name] = tok
        return tok

    def encode(self, model: str | None, text: str, add_bos: bool | None = None) -> list[int]:
        return self.get(model).encode(text, add_bos=add_bos)

    def decode(self, model: str | None, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.get(model).decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, model: str | None, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.get(model).apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def encode_pieces(self, model: str | None, pieces: Sequence[str], add_bos: bool | None = None) -> list[list[int]]:
        """Token ids of each piece such that their concatenation is exactly `encode("".join(pieces))`.

        The text is tokenized once; each token goes to the piece holding its last character, so a token
        that straddles a boundary (e.g. " wor" + "ld" -> " world") belongs to the later piece, and an empty
        piece, or one whose text is wholly inside such a token, gets no ids. A BOS token, when the
        tokenizer adds one, goes to the first piece.

        Known limit: characters the vocabulary cannot represent are dropped by `tokenizers`, which then
        reports the offsets of the rest of that pre-token word too early, so a token next to such a
        character can land in the piece before its own. The concatenation is exact regardless."""
        return split_at_pieces(self.get(model), pieces, add_bos)


def split_at_pieces(tok: Tokenizer, pieces: Sequence[str], add_bos: bool | None = None) -> list[list[int]]:
    """`TokenizerManager.encode_pieces` for a given tokenizer."""
    out: list[list[int]] = [[] for _ in pieces]
    if not pieces:
        return out
    # encode_batch, not encode: the same ids and offsets, but it lets go of the GIL while it works (`encode`
    # holds it: a megabyte prompt tokenized on a worker thread would still stop the event loop for seconds)
    enc = tok.backend.encode_batch([encodable("".join(pieces))], add_special_tokens=False)[0]
    ids = enc.ids
    if len(pieces) == 1:
        out[0] = ids
    elif ids:
        # each token's piece: the first piece whose end lies beyond the token's last character (offsets are
        # in characters), never back (the pieces stay a split of one id list); vectorized, as prompts run
        # to thousands of tokens and this is on the path of every task to its first primitive
        ends = np.cumsum([len(piece) for piece in pieces])
        off = np.asarray(enc.offsets, dtype=np.int64)
        last_char = np.where(off[:, 1] > off[:, 0], off[:, 1] - 1, off[:, 0])
        at = np.maximum.accumulate(np.minimum(np.searchsorted(ends, last_char, side="right"), len(pieces) - 1))
        cuts = np.searchsorted(at, np.arange(len(pieces) + 1)).tolist()
        out = [ids[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    if (tok.add_bos_token if add_bos is None else add_bos) and tok.bos_token_id is not None:
        out[0].insert(0, tok.bos_token_id)  # as Tokenizer.encode does
    return out
