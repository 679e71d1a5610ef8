"""ContextManager: which engine contexts hold which token prefixes, so new work forks the longest one.

A context is keyed by (engine, token prefix). Prefixes are registered at semantic-variable boundaries
(the places requests can share: a system prompt, a document, a previous output), so a new completion
forks the longest cached prefix on its engine and fills only the rest. Keys are token sequences, not
texts: the tokens of a rendered prompt are those a plain completion of the same text gets, so KV is
shared exactly when the tokens agree.

Ownership: a context made only of global constant text (e.g. a system prompt shared by many users)
belongs to no session and is pinned while hot; any other context belongs to the session that made it
and is released when that session ends. Releasing is bookkeeping here; the caller frees the engine
context. The engine may drop any idle context's KV under memory pressure and recompute it on use, so a
cached entry is always correct, only sometimes slower.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass(eq=False)
class CachedContext:
    engine: str
    context_id: str
    tokens: tuple[int, ...]
    parent: CachedContext | None
    session_id: str | None  # None: global (constant text only)
    children: int = 0
    in_use: int = 0  # tasks currently forking from or generating into it
    hits: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class ContextManager:
    def __init__(self, pin_hits: int = 2) -> None:
        self._by_key: dict[tuple[str, tuple[int, ...]], CachedContext] = {}
        self._by_id: dict[tuple[str, str], CachedContext] = {}
        self.pin_hits = pin_hits  # a global context used this often is kept when its sessions end
        self.lookups = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    # ---- queries ------------------------------------------------------------------------------
    def longest_prefix(self, engine: str, tokens: Sequence[int], boundaries: Sequence[int]) -> CachedContext | None:
        """The cached context on `engine` holding the longest prefix tokens[:b], b in `boundaries`."""
        for b in sorted(set(boundaries), reverse=True):
            if 0 < b <= len(tokens):
                ctx = self._by_key.get((engine, tuple(tokens[:b])))
                if ctx is not None:
                    return ctx
        return None

    def cached_length(self, engine: str, tokens: Sequence[int], boundaries: Sequence[int]) -> int:
        ctx = self.longest_prefix(engine, tokens, boundaries)
        return ctx.num_tokens if ctx is not None else 0

    def record_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.lookups += 1
        self.lookup_tokens += prompt_tokens
        self.hit_tokens += cached_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens served from cached contexts."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def contexts(self, engine: str | None = None) -> list[CachedContext]:
        return [c for c in self._by_id.values() if engine is None or c.engine == engine]

    # ---- changes ------------------------------------------------------------------------------
    def new_id(self, session_id: str | None) -> str:
        return f"{session_id or 'global'}-{next(_ids)}"

    def register(self, engine: str, context_id: str, tokens: Sequence[int], parent: CachedContext | None,
                 session_id: str | None) -> CachedContext:
        """Record a context the engine now holds. If the same prefix is already cached on that engine,
        the existing entry stays the one found by lookups; the new one takes over if that one goes."""
        ctx = CachedContext(engine, context_id, tuple(tokens), parent, session_id)
        self._by_id[(engine, context_id)] = ctx
        self._by_key.setdefault((engine, ctx.tokens), ctx)
        if parent is not None:
            parent.children += 1
        return ctx

    def touch(self, ctx: CachedContext) -> None:
        ctx.hits += 1
        ctx.last_used = time.monotonic()

    def release_session(self, session_id: str) -> list[CachedContext]:
        """Forget the session's contexts and return them (the caller frees them on their engines).
        Global contexts are kept while pinned (hot) and returned when no longer used by anyone."""
        out = [c for c in self._by_id.values() if c.session_id == session_id]
        for ctx in out:
            self._forget(ctx)
        return out

    def release_engine(self, engine: str) -> list[CachedContext]:
        """An engine died: everything cached on it is gone."""
        out = self.contexts(engine)
        for ctx in out:
            self._forget(ctx)
        return out

    def evict_cold_globals(self, keep: int, idle_seconds: float = 30.0) -> list[CachedContext]:
        """Global contexts nobody forks from beyond the `keep` most used: forget and return them. A context
        used in the last `idle_seconds` is never taken (a task may be about to fork from it)."""
        now = time.monotonic()
        globals_ = sorted((c for c in self._by_id.values() if c.session_id is None and not c.in_use
                           and not c.children and now - c.last_used > idle_seconds),
                          key=lambda c: (c.hits >= self.pin_hits, c.last_used))
        out = globals_[: max(0, len(globals_) - keep)]
        for ctx in out:
            self._forget(ctx)
        return out

    def _forget(self, ctx: CachedContext) -> None:
        self._by_id.pop((ctx.engine, ctx.context_id), None)
        key = (ctx.engine, ctx.tokens)
        if self._by_key.get(key) is ctx:
            del self._by_key[key]
            twin = next((c for c in self._by_id.values() if (c.engine, c.tokens) == key), None)
            if twin is not None:  # another context holds the same prefix: it answers lookups now
                self._by_key[key] = twin
        if ctx.parent is not None:
            ctx.parent.children -= 1
