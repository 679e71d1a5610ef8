"""Constrained decoding: a Generate's `json_schema`, `regex`, `choice` or `grammar` as an llguidance matcher.

`Grammars` (one per engine) builds the llguidance tokenizer from the engine's own tokenizer (the GGUF
vocabulary included) once, on first use, and compiles each request's constraint in a worker thread with
a time limit: an invalid or unsupported constraint, or one that takes too long, is an InvalidRequestError
carrying the matcher's message, raised when the request is submitted, before any engine work.

A `Constraint` is one job's matcher: it consumes each sampled token, says which tokens the grammar
forces next (fast-forward) and when the grammar is complete. `fill_masks` writes the allowed-token
bitmasks of a batch (packed 32 tokens per int32 word, `[batch, ceil(vocab / 32)]`, bit `t % 32` of word
`t // 32` set when token `t` is allowed) across threads; llguidance releases the GIL meanwhile.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from parrot import procinfo
from parrot.errors import GenerationFailedError, InvalidRequestError

if TYPE_CHECKING:
    import llguidance

    from parrot.engine.tokenizer import Tokenizer
    from parrot.protocol import SamplingParams

COMPILE_TIMEOUT_S = 10.0  # per constraint; a pathological schema gets a clear error instead of a hang
# JSON output layout: Python's json.dumps separators and no other whitespace, so keys and punctuation are
# forced (fast-forwarded) rather than sampled; a schema's own "x-guidance" options override these
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(GenerationFailedError):
    """The output could not continue its grammar (the matcher rejected a token): that generate fails alone."""


def mask_words(vocab_size: int) -> int:
    """int32 words per row of a packed token bitmask."""
    return (vocab_size + 31) // 32


def grammar_text(params: SamplingParams) -> str | None:
    """The llguidance grammar of a request's constraint, or None when it has none. A schema that is not a
    JSON object raises InvalidRequestError; the rest is checked when the matcher is built."""
    import llguidance

    if params.json_schema is not None:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(params.json_schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid json_schema: {exc}") from exc
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if params.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(params.grammar)
    return None


def matcher_error(error: str) -> str:
    """llguidance's error in a line: its reason without the matcher's state dump that follows it, the reason of
    a grammar no text satisfies (a regex of an empty class, a schema or rule defined only by itself) spelled out."""
    reason = error.strip().split("\n<state>", 1)[0].strip() or "the matcher failed"
    if reason == "NoExtensionBias":
        return "no output satisfies it"
    return reason


class Grammars:
    """Compiles constraints against one tokenizer and vocabulary (the model's logits width)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="parrot-grammar")
        self.mask_ms: collections.deque[float] = collections.deque(maxlen=4096)  # host time per batch mask
        self.compiles = 0
        self.masked_steps = 0  # batches with constraint work: masks computed, or greedy tokens checked
        self.unmasked_tokens = 0  # greedy tokens their grammar accepted without a mask (check_greedy)
        self.walked_tokens = 0  # rejected greedy rows whose masked argmax was found without a mask (next_allowed)

    def mask_stats(self) -> dict[str, float | None]:
        """Host time to compute a batch's masks over the recent steps: mean and p99, in ms."""
        ms = np.array(self.mask_ms)
        if not ms.size:
            return {"mask_ms_mean": None, "mask_ms_p99": None}
        return {"mask_ms_mean": float(ms.mean()), "mask_ms_p99": float(np.percentile(ms, 99))}

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance view of the engine's tokenizer (built once: about half a second)."""
        with self._lock:
            if self._ll is None:
                import llguidance

                eos = sorted(self.tokenizer.stop_token_ids)
                self._ll = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                                  eos_token=eos or None)
            return self._ll

    def compile(self, params: SamplingParams) -> Constraint | None:
        """The constraint of `params` (None when it has none), compiled in a worker thread within the time
        limit. Blocks the caller; call it off event loops (`LLMEngine` does)."""
        if params.constraint is None:
            return None
        try:
            _ = self.ll_tokenizer  # built once, outside the time limit of the grammar
        except Exception as exc:  # a tokenizer llguidance cannot read: no constraint rather than a crash
            raise InvalidRequestError(f"constraints are not available for this model's tokenizer: {exc}") from exc
        started = time.monotonic()
        fut = self._pool.submit(self._build, params)
        try:
            constraint = fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            constraint = None
        # A compiler that holds the GIL can finish before the waiting thread wakes: the clock decides.
        if constraint is None or time.monotonic() - started > self.timeout_s:
            raise InvalidRequestError(
                f"compiling the {params.constraint} constraint took longer than {self.timeout_s:g} s")
        return constraint

    def _build(self, params: SamplingParams) -> Constraint:
        import llguidance

        grammar = grammar_text(params)
        assert grammar is not None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        matcher.compute_bitmask()  # the first mask builds most lexer states: here, not in an engine step
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {params.constraint}: {matcher_error(matcher.get_error())}")
        self.compiles += 1
        return Constraint(matcher, self, grammar)


class Constraint:
    """One job's grammar state: consumes the tokens it outputs, in order."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars, grammar: str = "") -> None:
        self.matcher = matcher
        self.grammars = grammars
        self.grammar = grammar  # the grammar's text: with the tokens consumed, it fixes the matcher's state
        self.consumed: list[int] = []

    @property
    def forces_tokens(self) -> bool:
        """Whether llguidance's mask is the first forced token alone where the grammar forces bytes that
        tokenize to forced tokens (false for a grammar that asks for `no_forcing`: its mask then holds every
        token consistent with the forced bytes; an unknown grammar counts as asking)."""
        return bool(self.grammar) and "no_forcing" not in self.grammar

    def consume(self, token: int) -> None:
        """Advance by a sampled token; a token the grammar rejects raises ConstraintError."""
        if not self.matcher.consume_token(token):
            # llguidance's error is a line, then its state and the whole grammar: the line is the message
            reason = (self.matcher.get_error().strip().splitlines() or ["rejected"])[0]
            text = self.grammars.tokenizer.decode([token], skip_special_tokens=False)
            raise ConstraintError(f"the output left its grammar at token {token} ({text!r}): {reason}")
        self.consumed.append(token)

    def after(self, tokens: Sequence[int]) -> Constraint:
        """The state after `tokens` more (a speculative verify row's: the draft's tokens before it), as a copy that
        moves alone; this one, without tokens. A token the grammar refuses raises ConstraintError."""
        if not tokens:
            return self
        c = Constraint(self.matcher.deep_copy(), self.grammars, self.grammar)
        c.consumed = list(self.consumed)
        for t in tokens:
            c.consume(t)
        return c

    def takes(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from here (none is consumed)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    @property
    def state_key(self) -> tuple[str, tuple[int, ...]]:
        """Equal keys mean equal matcher states, hence equal masks (the grammar and the tokens consumed)."""
        return self.grammar, tuple(self.consumed)

    def accepts(self, token: int) -> bool:
        """Whether the mask would allow `token`, known without computing it: the grammar takes the token here,
        and where it forces bytes the token holds them all or is the first of their canonical tokens.
        (llguidance's mask leaves out other tokens that stop inside forced bytes when these tokenize to
        forced tokens, and holds them when they do not, which validating a token does not see: for those
        the answer is False and `next_allowed` applies the mask's rule. Checked against the masks over whole
        vocabularies in JSON-schema, regex and choice states: none accepted that a mask refused.)"""
        forced = self.matcher.compute_ff_bytes()
        if forced and not self.grammars.ll_tokenizer.decode_bytes([token]).startswith(bytes(forced)):
            return token in self.matcher.compute_ff_tokens()[:1]
        return self.matcher.validate_tokens([token]) == 1

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (none when it allows a choice)."""
        return list(self.matcher.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """The grammar is complete and accepts nothing more."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The tokens consumed so far are a whole output of the grammar (it may end here)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _llexecutor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            # llguidance's default is 80% of the CPUs: one thread on a 2-core machine, where a batch's masks
            # then took twice as long (16 JSON matchers: mean 2.7 -> 1.45 ms, p99 12.7 -> 6.7 ms with 2).
            # The masks run while the cores are free: before a step on a CPU, beside the device otherwise.
            _executor = llguidance.LLExecutor(num_threads=min(32, procinfo.usable_cores()))
        return _executor


def fill_masks(rows: list[tuple[Constraint, int]], bitmask: np.ndarray, record: bool = True) -> None:
    """Write each constraint's allowed tokens into row `index` of `bitmask` ([batch, words] int32,
    C-contiguous), the rows in parallel threads without the GIL. Other rows are left as they are. The time
    counts in `mask_ms` unless `record` is False (the caller counts it)."""
    if not rows:
        return
    import llguidance.numpy

    t0 = time.perf_counter()
    # rows in one state (the same grammar, the same tokens so far: e.g. every request of a schema at its
    # first value) share one computed mask
    first: dict[tuple[str, tuple[int, ...]], int] = {}
    copies: list[tuple[int, int]] = []
    unique: list[tuple[llguidance.LLMatcher, int]] = []
    for c, i in rows:
        j = first.setdefault(c.state_key, i)
        if j == i:
            unique.append((c.matcher, i))
        else:
            copies.append((i, j))
    llguidance.numpy.fill_next_token_bitmask_par(_llexecutor(), unique, bitmask)
    for i, j in copies:
        bitmask[i] = bitmask[j]
    if not record:
        return
    grammars = rows[0][0].grammars
    grammars.mask_ms.append((time.perf_counter() - t0) * 1e3)
    grammars.masked_steps += 1


WALK_TRIES = 8  # candidates a rejected greedy row tries, in logit order, before its mask is computed


def next_allowed(c: Constraint, row: np.ndarray, stops: frozenset[int], tries: int = WALK_TRIES) -> int | None:
    """The masked argmax of `row` found without computing the mask: the candidates in order of their logits
    (the first index among equal ones, as argmax orders them), the first one the mask holds. That is the
    masked argmax because every candidate before it is outside the mask. `accepts` never admits a token the
    mask refuses; the tokens it may refuse although the mask holds them are decided by llguidance's rules:
    * where the grammar forces bytes that tokenize to forced tokens, the mask is the first of them alone
      (unless the grammar asks for `no_forcing`: `Constraint.forces_tokens`);
    * where it forces bytes without forced tokens (token healing: `' "'` may go on as `' ""'` or `' ",'`), or
      without forcing, a token whose bytes stop inside the forced bytes is in the mask;
    * a stop token is in the mask exactly when the grammar is accepting (a complete match).
    A special token (no bytes), a token that is the forced bytes exactly, a non-finite logit, or `tries`
    refusals return None: the mask decides."""
    r = np.array(row, dtype=np.float32)
    forced = bytes(c.matcher.compute_ff_bytes())
    if forced and c.forces_tokens:
        ff = c.matcher.compute_ff_tokens()
        if ff:  # the mask holds this one token
            t = int(ff[0])
            return t if np.isfinite(r[t]) else None
    accepting: bool | None = None
    for _ in range(tries):
        t = int(np.argmax(r))
        if not np.isfinite(r[t]):
            return None
        if c.accepts(t):
            return t
        if t in stops:
            if accepting is None:
                accepting = c.matcher.is_accepting()
            if accepting:
                return t
            r[t] = -np.inf
            continue
        b = c.grammars.ll_tokenizer.decode_bytes([t])
        if not b:
            return None
        if forced and forced.startswith(b):
            if len(b) < len(forced):  # stops inside the forced bytes, which no forced token covers: held
                return t
            return None
        r[t] = -np.inf
    return None


def check_greedy(rows: list[tuple[Constraint, int]], tokens: np.ndarray, logits: Callable[[], np.ndarray],
                 vocab_size: int) -> None:
    """Greedy rows sampled without their masks (`sampling.lazily_constrained`; `tokens[i]` is row i's
    argmax): where the grammar accepts the token it stands, the argmax over the allowed tokens too. A row it
    refuses tries the next candidates by logit (`next_allowed`); the rows that still have no answer get their
    masks computed now (in parallel) and `tokens[i]` becomes the argmax of `logits()[i]` over their allowed
    tokens. The host time (checks, candidates, masks, argmaxes) counts in `mask_ms` as one batch's masks:
    most steps of a model that follows its prompt compute no mask at all."""
    if not rows:
        return
    t0 = time.perf_counter()
    redo = [(c, i) for c, i in rows if not c.accepts(int(tokens[i]))]
    grammars = rows[0][0].grammars
    if redo:
        host = logits()
        stops = grammars.tokenizer.stop_token_ids
        masked = []
        for c, i in redo:
            t = next_allowed(c, host[i], stops)
            if t is None:
                masked.append((c, i))
            else:
                tokens[i] = t
        grammars.walked_tokens += len(redo) - len(masked)
        if masked:
            masks = np.zeros((len(tokens), mask_words(vocab_size)), np.int32)
            fill_masks(masked, masks, record=False)
            for _, i in masked:
                allowed = np.unpackbits(masks[i].view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
                tokens[i] = int(np.argmax(np.where(allowed, host[i], -np.inf)))
    grammars.mask_ms.append((time.perf_counter() - t0) * 1e3)
    grammars.masked_steps += 1
    grammars.unmasked_tokens += len(rows) - len(redo)
