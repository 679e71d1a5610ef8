"""Tokenizer: byte-level BPE (Hugging Face `tokenizers`) plus the model's chat template (jinja2)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from parrot.engine.model_files import gguf_field, open_gguf, resolve_model_path
from parrot.errors import InvalidRequestError, ModelLoadError

# GGUF token types (llama.cpp `llama_token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


BYTE_LEVEL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Tokenizer:
    """Encodes text to ids, decodes ids to text and renders chat messages with the model's template."""

    def __init__(
        self,
        backend: HFTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool = False,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        stops = {eos_token_id} if eos_token_id is not None else set()
        self.stop_token_ids: frozenset[int] = frozenset(stops | set(extra_stop_ids))
        self._template: jinja2.Template | None = None
        self._texts: dict[int, str] = {}  # decode_one's: each id's text alone, as decode gives it

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(
        cls,
        tokens: list[str],
        merges: list[str],
        token_types: list[int] | None,
        pre: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool = False,
        extra_stop_ids: Sequence[int] = (),
    ) -> Tokenizer:
        """Build a byte-level BPE tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file."""
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        if token_types is not None:
            special = [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(token_types)
                if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
            ]
            backend.add_special_tokens(special)
        return cls(backend, bos_token_id, eos_token_id, chat_template, add_bos_token, extra_stop_ids)

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json` for the chat template and special ids)."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises bare Exceptions on corrupt JSON
            raise ModelLoadError(f"cannot read {tok_file}: {exc}") from exc
        cfg: dict = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            chat_template=cfg.get("chat_template"),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """A tokenizer of no model's: the 256 byte-level symbols (one token per byte, no merges) and ChatML's
        three special tokens after them, with a ChatML template. Random-weight models use it where the
        default model is not installed."""
        symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
        n = len(symbols)  # then <|endoftext|> (n, the end of text), <|im_start|>, <|im_end|> (n + 2, a stop)
        return cls.from_gguf_metadata(symbols + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [],
                                      [1] * n + [_GGUF_CONTROL] * 3, None, bos_token_id=None, eos_token_id=n,
                                      chat_template=BYTE_LEVEL_CHAT_TEMPLATE, extra_stop_ids=[n + 2])

    # ---- use ----------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(encodable(text), add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer rendering chats with `template` instead of the model's own (`--chat-template`)."""
        other = copy.copy(self)
        other.chat_template, other._template = template, None
        return other

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int) -> str:
        """`decode([token_id])`, kept once decoded (the incremental detokenizer asks for the last token's text
        alone at every token)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.decode([token_id])
        return text

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **template_kwargs: object) -> str:
        """Render chat messages into the prompt text the model was trained on (`template_kwargs`: more of the
        template's variables, as Hugging Face's apply_chat_template passes them)."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a plain completion")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise InvalidRequestError(f"chat template: {message}")

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        vocab = self.backend
        bos = vocab.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = vocab.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        return self._template.render(
            **template_kwargs, messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
            eos_token=eos
        )

    def to_json(self) -> str:
        return self.backend.to_str()


def load_tokenizer(model: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a model ('smollm2' / None: the default model; a GGUF file: its metadata only;
    a Hugging Face directory: its tokenizer.json), without loading weights or importing JAX."""
    path = resolve_model_path(model)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    return gguf_tokenizer(open_gguf(path), path)


def gguf_tokenizer(reader: Any, path: Path) -> Tokenizer:
    """The tokenizer described by the `tokenizer.*` metadata of an open GGUF file."""
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{path}: unsupported tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
    return Tokenizer.from_gguf_metadata(
        tokens=list(tokens),
        merges=list(gguf_field(reader, "tokenizer.ggml.merges", [])),
        token_types=list(gguf_field(reader, "tokenizer.ggml.token_type", []) or []) or None,
        pre=gguf_field(reader, "tokenizer.ggml.pre"),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
        add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """Byte-level pre-tokenization; models whose GGUF `pre` is smollm split digits one by one first."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        return pre_tokenizers.Sequence([digits, byte_level])
    return byte_level


_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """`text` with each lone UTF-16 surrogate (e.g. from a JSON "\\ud800" escape; a Python str holds no
    pairs) replaced by U+FFFD, one character for one, so offsets stay valid; `tokenizers` refuses them."""
    return _SURROGATE.sub("\ufffd", text)


class StopMatcher:
    """Where one stop string shows up in a text fed piece by piece: the longest prefix of it that ends the text
    so far (the characters to hold back), and the end of its first whole occurrence. Knuth-Morris-Pratt, so a
    piece costs its own length whatever the stop string's: a long stop string cannot stall the engine's loop
    (holding back by testing every prefix of it against the text took its length squared each token)."""

    def __init__(self, stop: str) -> None:
        if not stop:
            raise ValueError("a stop string must not be empty")
        self.stop = stop
        self.fail = fail = [0] * len(stop)  # fail[i]: the longest proper prefix of stop[: i + 1] that ends it
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self.matched = 0  # characters of the stop string that end the text fed so far

    def feed(self, piece: str, report: bool = True) -> int | None:
        """Advance over `piece`: the index in it just past the stop string's first whole occurrence, or None
        (`report` False: none counts, the whole piece is read; what of the stop string ends it is kept)."""
        k, stop, fail = self.matched, self.stop, self.fail
        for j, ch in enumerate(piece):
            if k == len(stop):  # an occurrence that did not count: go on from its longest border
                k = fail[k - 1]
            while k and ch != stop[k]:
                k = fail[k - 1]
            if ch == stop[k]:
                k += 1
                if k == len(stop) and report:
                    self.matched = k
                    return j + 1
        self.matched = fail[k - 1] if k == len(stop) else k  # a whole occurrence that did not count: not held
        return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters,
    and finds stop strings as they appear. Text that could be the start of a stop string is held back
    until it is resolved, so the streamed deltas always concatenate to the final text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        """`min_tokens`: a stop string counts only where it ends in the text of a token after that many (vLLM's
        min_tokens holds stop strings back as it holds EOS). `include_stop`: the text is cut just after the stop
        string found, not before it (vLLM's include_stop_str_in_output)."""
        self.tokenizer = tokenizer
        self.matchers = [StopMatcher(s) for s in stop]
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.text = ""  # decoded text so far (cut before a stop string once one is found)
        self.emitted = 0  # characters of `text` already handed out as deltas
        self.cut = False  # a stop string was found: `text` ends before it
        self.dropped = 0  # characters decoded after the stop string (or `include_stop`: after its end) left out
        self.stop_hit: str | None = None  # ... that one
        self._prefix = 0  # ids before this index are already reflected in `text`
        self._read = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one id; returns (text safe to emit now, hit a stop string)."""
        self.ids.append(token_id)
        prefix_text, full = self._decoded()
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return "", False  # incomplete UTF-8 sequence (or a U+FFFD of its own: `flush` tells) or nothing yet
        return self._take(full[len(prefix_text) :])

    def _decoded(self) -> tuple[str, str]:
        """(text of the ids already reflected since `_prefix`, text of every id since `_prefix`)."""
        ids, start, read = self.ids, self._prefix, self._read
        before = (self.tokenizer.decode_one(ids[start]) if read - start == 1
                  else self.tokenizer.decode(ids[start:read]) if read > start else "")
        return before, self.tokenizer.decode(ids[start:])

    def _take(self, piece: str) -> tuple[str, bool]:
        """`piece`, the text of the ids not yet reflected, joins the text; returns what `add` does."""
        old_len = len(self.text)
        self.text += piece
        self._prefix, self._read = self._read, len(self.ids)
        if not self.matchers:  # nothing held back
            delta = self.text[self.emitted :]
            self.emitted = len(self.text)
            return delta, False
        # a stop string may straddle deltas (each matcher carries what of it ended the text); earliest wins
        counts = len(self.ids) > self.min_tokens
        hits = [(old_len + end - len(m.stop), m.stop) for m in self.matchers
                if (end := m.feed(piece, counts)) is not None]
        if hits:
            at, self.stop_hit = min(hits)
            end = at + len(self.stop_hit) if self.include_stop else at
            self.dropped = len(self.text) - end
            self.text = self.text[:end]
            self.cut = True
            return self.flush(), True
        held = max((m.matched for m in self.matchers), default=0)
        end = len(self.text) - held
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta, False

    def flush(self) -> str:
        """Everything not yet emitted (call when the generation ends). Ids still held back as the start of a
        character are decoded now: a U+FFFD the model generated (or the rest of a character max_tokens cut,
        decoded as U+FFFD) ends the text, as a decode of all the ids has it."""
        start = self.emitted
        if not self.cut and self._read < len(self.ids):
            prefix_text, full = self._decoded()
            if len(full) > len(prefix_text):
                self._take(full[len(prefix_text) :])  # (a stop string it completes cuts the text there)
        delta = self.text[start:]
        self.emitted = len(self.text)
        return delta
