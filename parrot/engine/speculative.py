"""Speculative decoding by prompt lookup (n-gram drafts): the draft for a sequence's next tokens is what followed
the latest earlier occurrence of its last `n` tokens in its own context (prompt and output), as vLLM's `ngram`
speculator and llama.cpp's lookup decoding propose them (where that copy runs into the tail, the tail repeats:
a period). No draft model: outputs that copy from their input (summaries, extraction, code edits, quoting)
get several tokens a step.

The scheduler feeds a draft with the sequence's last token in one step (a verify slot), whose tokens the runner
runs as decode rows and samples as plain decode steps at those positions would; the draft's longest prefix that
the samples confirm is accepted, plus the sample after it, and the KV written for the rejected rest is dropped
(scheduler.py). A step therefore gives 1 to k + 1 tokens, each the one plain decoding gives.

`NgramDrafter` keeps, per context, the latest end position of every n-gram of its tokens, updated as tokens
are added, so a lookup costs O(n) and not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_NGRAM = 3  # the longest n-gram matched (then shorter ones, down to `min_ngram`)
DEFAULT_MIN_NGRAM = 2


@dataclass
class _Index:
    """The n-grams of one context's tokens up to `seen` (exclusive of the grams ending at the last token)."""

    seen: int = 0  # every gram whose (exclusive) end is below `seen` is indexed
    last: int = -1  # tokens[seen - 1] when indexed (another token there: the context was rewritten)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # gram -> end (exclusive) of its latest occurrence


class NgramDrafter:
    """Drafts of up to `tokens` tokens from n-gram matches of `min_ngram`..`ngram` tokens."""

    def __init__(self, tokens: int, ngram: int = DEFAULT_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM) -> None:
        if tokens < 1:
            raise ValueError("speculative tokens must be at least 1")
        if not 1 <= min_ngram <= ngram:
            raise ValueError("the n-gram lengths must satisfy 1 <= min_ngram <= ngram")
        self.tokens = tokens
        self.ngram = ngram
        self.min_ngram = min_ngram
        self._index: dict[str, _Index] = {}

    def propose(self, key: str, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """The draft after `tokens` (the context `key`'s tokens so far, its last one included): up to
        min(`self.tokens`, `limit`) tokens, or [] where no n-gram of its tail occurred before."""
        most = self.tokens if limit is None else min(self.tokens, limit)
        n_tokens = len(tokens)
        if most <= 0 or n_tokens < self.min_ngram + 1:
            return []
        index = self._update(key, tokens)
        for n in range(min(self.ngram, n_tokens - 1), self.min_ngram - 1, -1):
            end = index.ends.get(tuple(tokens[n_tokens - n :]))
            if end is not None:  # copy on from there; a copy that reaches the tail goes on with its own tokens
                period = n_tokens - end
                draft = list(tokens[end : end + most])
                while len(draft) < most:
                    draft.append(draft[len(draft) - period])
                return draft
        return []

    def forget(self, key: str) -> None:
        """Drop a context's index (its job ended; a later one rebuilds it)."""
        self._index.pop(key, None)

    def _update(self, key: str, tokens: Sequence[int]) -> _Index:
        """The context's index brought up to `tokens`: every gram ending before the last token (the grams
        ending at it are the tail being looked up; an occurrence must come before it)."""
        index = self._index.get(key)
        if index is None or index.seen > len(tokens) or (index.seen and tokens[index.seen - 1] != index.last):
            index = self._index[key] = _Index()  # new, or its tokens were cut back or rewritten
        stop = len(tokens) - 1  # grams ending at positions < stop (exclusive end <= stop)
        ends = index.ends
        for end in range(max(index.seen, 1), stop + 1):
            for n in range(self.min_ngram, min(self.ngram, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        if stop + 1 > index.seen:
            index.seen = stop + 1
            index.last = tokens[stop]
        return index
