"""Common-prefix detection across requests: split constant text where earlier texts diverged.

Requests often begin with the same constant text (a system prompt, few-shot examples) followed by text
of their own. The matcher remembers the leading constant texts it was shown (`add`) and the *shared
prefixes* found between them; `split(text)` cuts a new text at those shared prefixes, so the shared
part becomes its own piece, hence the same (content-addressed) constant variable and the same KV
context in every request that has it.

Cuts are hierarchical: if some texts share `S` and some of those share `S + U`, a text starting with
`S + U` splits into `[S, U, rest]`, and `"".join(pieces[:k])` is a shared prefix for every `k` below
`len(pieces)`. A cut found only now (against a text that was added whole) is moved back to the start of
a word or line when that keeps it at least `min_shared_chars` long, so pieces end where tokens do.
Shared prefixes shorter than `min_shared_chars` are ignored. Costs are O(len(text)) string work per
call (plus a bisect over the remembered texts, and a look-up per length of the known shared prefixes).

Memory is bounded however long or many the texts (a template may hold a million characters, and the texts
of deleted sessions stay): the remembered texts by count and by total characters, the shared prefixes by
count and by total characters, each forgetting its least recently used first (a shared prefix is used
when it cuts a text). Forgetting only costs cuts: the KV contexts are kept by the context manager.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict


def common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixMatcher:
    """Remembers leading constant texts and the prefixes they share; splits new texts at them."""

    def __init__(self, min_shared_chars: int = 64, max_texts: int = 10_000, max_chars: int = 8_000_000,
                 max_shared: int = 2_048, max_shared_chars: int = 4_000_000) -> None:
        if min_shared_chars < 1:
            raise ValueError("min_shared_chars must be at least 1")
        self.min_shared_chars = min_shared_chars
        self.max_texts, self.max_chars = max_texts, max_chars
        self.max_shared, self.max_shared_chars = max_shared, max_shared_chars
        self._lock = threading.Lock()
        self._sorted: list[str] = []  # remembered texts, sorted, distinct
        self._recent: OrderedDict[str, None] = OrderedDict()  # the same texts, least recently added first
        self._chars = 0  # their characters
        self._shared: dict[int, set[str]] = {}  # known shared prefixes by length
        self._shared_recent: OrderedDict[str, None] = OrderedDict()  # the same, least recently used first
        self._shared_chars = 0

    def __len__(self) -> int:
        return len(self._sorted)

    @property
    def shared_prefixes(self) -> list[str]:
        with self._lock:
            return sorted(self._shared_recent)

    @property
    def chars(self) -> int:
        """Characters held: the remembered texts and the shared prefixes."""
        return self._chars + self._shared_chars

    def _longest_common_locked(self, text: str) -> tuple[int, str | None]:
        """Longest common prefix of `text` with a remembered text other than itself (sorted neighbours)."""
        i = bisect.bisect_left(self._sorted, text)
        best, other = 0, None
        for j in (i - 1, i, i + 1):
            if 0 <= j < len(self._sorted) and self._sorted[j] != text:
                n = common_prefix_len(text, self._sorted[j])
                if n > best:
                    best, other = n, self._sorted[j]
        return best, other

    def _new_cut_locked(self, text: str) -> int:
        """Where `text` would cut against the remembered texts (0: nowhere), snapped to a word/line start."""
        n, other = self._longest_common_locked(text)
        if n < self.min_shared_chars or other is None:
            return 0
        if n == len(text) or n == len(other):  # one ends where the other goes on: a clean cut
            return n
        for i in range(n, self.min_shared_chars - 1, -1):
            if text[i - 1] == "\n" or text[i].isspace():
                return i
        return n

    def _cuts_locked(self, text: str) -> list[int]:
        cuts = {n for n, prefixes in self._shared.items()
                if self.min_shared_chars <= n <= len(text) and text[:n] in prefixes}
        for n in cuts:
            self._shared_recent.move_to_end(text[:n])
        cut = self._new_cut_locked(text)
        if cut:
            cuts.add(cut)
        return sorted(c for c in cuts if 0 < c < len(text))

    def split(self, text: str) -> list[str]:
        """Pieces whose concatenation is `text`, cut at every shared prefix of at least `min_shared_chars`
        (known, or found against a remembered text). The first piece is the shortest shared prefix; the
        whole text if it shares nothing long enough. Does not remember `text`: call `add` for that."""
        if not text:
            return [text]
        with self._lock:
            cuts = self._cuts_locked(text)
        bounds = [0, *cuts, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def add(self, text: str) -> None:
        """Remember `text`, and the prefix it shares with the remembered texts (if long enough)."""
        if not text:
            return
        with self._lock:
            cut = self._new_cut_locked(text)
            if cut:
                self._add_shared_locked(text[:cut])
            if text in self._recent:
                self._recent.move_to_end(text)
                return
            self._recent[text] = None
            self._chars += len(text)
            bisect.insort(self._sorted, text)
            while len(self._sorted) > self.max_texts or (self._chars > self.max_chars and len(self._sorted) > 1):
                old, _ = self._recent.popitem(last=False)
                self._chars -= len(old)
                del self._sorted[bisect.bisect_left(self._sorted, old)]

    def _add_shared_locked(self, prefix: str) -> None:
        if prefix in self._shared_recent:
            self._shared_recent.move_to_end(prefix)
            return
        self._shared_recent[prefix] = None
        self._shared.setdefault(len(prefix), set()).add(prefix)
        self._shared_chars += len(prefix)
        while len(self._shared_recent) > self.max_shared or (
                self._shared_chars > self.max_shared_chars and len(self._shared_recent) > 1):
            old, _ = self._shared_recent.popitem(last=False)
            self._shared_chars -= len(old)
            same_length = self._shared[len(old)]
            same_length.discard(old)
            if not same_length:
                del self._shared[len(old)]
