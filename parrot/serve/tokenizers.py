"""TokenizerManager: one tokenizer per model, loaded once (metadata only, no weights, no JAX).

The serve layer tokenizes prompts itself and sends token ids to the engines. A rendered prompt is a
sequence of pieces (constant text, variable values) that live in different KV contexts, yet the ids of
the whole must be exactly those a plain completion of the same text gets: `encode_pieces` tokenizes the
concatenation once and splits the ids back at the piece boundaries.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

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
    ends: list[int] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    enc = tok.backend.encode(encodable("".join(pieces)), add_special_tokens=False)
    last = len(pieces) - 1
    current = 0
    for token_id, (start, end) in zip(enc.ids, enc.offsets, strict=True):
        # the first piece whose end lies beyond the token's last character (offsets are in characters)
        at = bisect.bisect_right(ends, end - 1 if end > start else start)
        current = max(current, min(at, last))  # never back: the pieces stay a split of one id list
        out[current].append(token_id)
    if (tok.add_bos_token if add_bos is None else add_bos) and tok.bos_token_id is not None:
        out[0].insert(0, tok.bos_token_id)  # as Tokenizer.encode does
    return out
