"""ContextManager: which engine contexts hold which token prefixes, so new work forks the longest one.

A context is keyed by (engine, token prefix). Keys are token sequences, not texts: the tokens of a
rendered prompt are those a plain completion of the same text gets, so KV is shared exactly when the
tokens agree. Every context is also indexed by blocks (`block` tokens, the engines' page size): a hash
chained over the full blocks of its tokens, as vLLM's automatic prefix caching does. That gives two
views of any request's tokens, both in O(tokens / block) dictionary look-ups:
* `longest_cached`: the longest cached context whose tokens are a prefix of the request (any length:
  a semantic-variable boundary, a block checkpoint, a whole earlier prompt or prompt + output). A new
  task forks it and fills only the rest.
* `matched_blocks`: how many leading full blocks of the request some cached context holds, even one
  longer than the match (the radix view), and `holder`: such a context. The engine forks a prefix of a
  context (`parent_num_tokens`), so the task forks the holder's first blocks instead of computing them
  again, and keeps a context at that block boundary for later requests sharing the prefix.

Salts (vLLM's `cache_salt`): a request with a salt shares cached contexts only with requests of the same
salt; every key and lookup carries it (None: the unsalted cache every other request shares), so a tenant
cannot learn from `cached_tokens` or timing whether another tenant sent a prompt.

Ownership: a context made only of global constant text (e.g. a system prompt shared by many users)
belongs to no session and is pinned while hot; any other context belongs to the session that made it
and is released when that session ends. Releasing is bookkeeping here; the caller frees the engine
context. The engine may drop any idle context's KV under memory pressure and recompute it on use, so a
cached entry is always correct, only sometimes slower.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

_ids = itertools.count()


def salt_digest(salt: str | None) -> str | None:
    """What the cache keys carry of a request's cache_salt: a digest (a salt may be long; the server keeps none)."""
    if salt is None:
        return None
    return hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def block_hashes(tokens: Sequence[int], block: int) -> list[int]:
    """h[k]: a hash of tokens[:k * block] chained block by block (h[0] = 0), for every full block."""
    out = [0]
    for k in range(len(tokens) // block):
        out.append(hash((out[-1], tuple(tokens[k * block:(k + 1) * block]))))
    return out


def last_match(lo: int, hi: int, matches: Callable[[int], bool]) -> int:
    """The largest k in [lo, hi] with matches(k), where matches holds at lo and, like equal chained block
    hashes (block k matched implies every block before it matched), up to some k and not after."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if matches(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)
class CachedContext:
    engine: str
    context_id: str
    tokens: tuple[int, ...]
    parent: CachedContext | None
    session_id: str | None  # None: global (constant text only)
    salt: str | None = None  # the cache_salt it was computed under: found only by requests with the same one
    children: int = 0
    in_use: int = 0  # tasks currently forking from or generating into it
    hits: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # the pipelined fill computing its KV while that is in flight (ordered engines: registered at once, forked
    # at once; a task forking it depends on that fill: `ParrotServeCore._depend`)
    filling: asyncio.Future | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class ContextManager:
    def __init__(self, pin_hits: int = 2, block: int = 16) -> None:
        self.block = block
        # keys begin with (engine, salt): a salted request's lookups see only contexts of its salt
        self._by_key: dict[tuple[str, str | None, tuple[int, ...]], CachedContext] = {}
        self._by_id: dict[tuple[str, str], CachedContext] = {}
        # (engine, salt, k, h[k]) -> contexts whose length is in [k * block, (k + 1) * block) with those k blocks
        self._ending: dict[tuple[str, str | None, int, int], list[CachedContext]] = {}
        # (engine, salt, k, h[k]) -> the contexts holding those k full blocks (k >= 1), by id(): the radix view
        self._blocks: dict[tuple[str, str | None, int, int], dict[int, CachedContext]] = {}
        self.pin_hits = pin_hits  # a global context used this often is kept when its sessions end
        self.lookups = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0

    # ---- queries ------------------------------------------------------------------------------
    def longest_prefix(self, engine: str, tokens: Sequence[int], boundaries: Sequence[int],
                       salt: str | None = None) -> CachedContext | None:
        """The cached context on `engine` holding the longest prefix tokens[:b], b in `boundaries`."""
        for b in sorted(set(boundaries), reverse=True):
            if 0 < b <= len(tokens):
                ctx = self._by_key.get((engine, salt, tuple(tokens[:b])))
                if ctx is not None:
                    return ctx
        return None

    def cached_length(self, engine: str, tokens: Sequence[int], boundaries: Sequence[int],
                      salt: str | None = None) -> int:
        ctx = self.longest_prefix(engine, tokens, boundaries, salt)
        return ctx.num_tokens if ctx is not None else 0

    def longest_cached(self, engine: str, tokens: Sequence[int], hashes: Sequence[int] | None = None,
                       salt: str | None = None) -> CachedContext | None:
        """The cached context on `engine` with the most tokens that are all a prefix of `tokens`, whatever
        its length. `hashes`: block_hashes(tokens, self.block), when the caller has them already."""
        if hashes is None:
            hashes = block_hashes(tokens, self.block)
        n = len(tokens)
        for k in range(len(hashes) - 1, -1, -1):
            found = self._ending.get((engine, salt, k, hashes[k]))
            if not found:
                continue
            start = k * self.block
            best = None
            for ctx in found:
                if (ctx.num_tokens <= n and (best is None or ctx.num_tokens > best.num_tokens)
                        and ctx.tokens[start:] == tuple(tokens[start:ctx.num_tokens])
                        and ctx.tokens[:start] == tuple(tokens[:start])):  # (a hash collision is not a match)
                    best = ctx
            if best is not None:
                return self._by_key.get((engine, salt, best.tokens), best)
        return None

    def matched_blocks(self, engine: str, hashes: Sequence[int], salt: str | None = None) -> int:
        """How many leading full blocks of the tokens behind `hashes` a cached context on `engine` holds
        (possibly a longer context, which cannot be forked at that length)."""
        return last_match(0, len(hashes) - 1, lambda k: (engine, salt, k, hashes[k]) in self._blocks)

    def holder(self, engine: str, tokens: Sequence[int], hashes: Sequence[int] | None = None,
               salt: str | None = None) -> CachedContext | None:
        """A cached context on `engine` longer than `tokens` (a whole number of blocks) that begins with them:
        what a fork of its first len(tokens) tokens (`parent_num_tokens`) takes them from. None if none."""
        k, rest = divmod(len(tokens), self.block)
        if k == 0 or rest:
            return None
        if hashes is None or len(hashes) <= k:
            hashes = block_hashes(tokens, self.block)
        prefix = tuple(tokens)
        for ctx in self._blocks.get((engine, salt, k, hashes[k]), {}).values():
            if ctx.num_tokens > len(prefix) and ctx.tokens[: len(prefix)] == prefix:  # (not a hash collision)
                return ctx
        return None

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
                 session_id: str | None, salt: str | None = None) -> CachedContext:
        """Record a context the engine now holds. If the same prefix is already cached on that engine,
        the existing entry stays the one found by lookups; the new one takes over if that one goes."""
        ctx = CachedContext(engine, context_id, tuple(tokens), parent, session_id, salt)
        self._by_id[(engine, context_id)] = ctx
        self._by_key.setdefault((engine, salt, ctx.tokens), ctx)
        hashes = block_hashes(ctx.tokens, self.block)
        self._ending.setdefault((engine, salt, len(hashes) - 1, hashes[-1]), []).append(ctx)
        for key in self._block_keys(ctx, hashes):
            self._blocks.setdefault(key, {})[id(ctx)] = ctx
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

    def discard(self, ctx: CachedContext) -> None:
        """Forget a context whose fill failed (the engine dropped what that fill made); the caller frees nothing."""
        self._forget(ctx)

    def release_engine(self, engine: str) -> list[CachedContext]:
        """An engine died: everything cached on it is gone."""
        out = self.contexts(engine)
        for ctx in out:
            self._forget(ctx)
        return out

    def num_globals(self) -> int:
        return sum(1 for c in self._by_id.values() if c.session_id is None)

    def evict_cold_globals(self, keep: int, idle_seconds: float = 30.0, limit: int | None = None,
                           ) -> list[CachedContext]:
        """Global contexts nobody forks from beyond the `keep` most used: forget and return them. A context
        used in the last `idle_seconds` is not taken (a task may be about to fork from it) unless more
        than `limit` global contexts exist: then the least recently used leaves go (never one a task is
        using or one with cached children) until `limit` remain."""
        now = time.monotonic()
        order = (lambda c: (c.hits >= self.pin_hits, c.last_used))  # noqa: E731
        globals_ = sorted((c for c in self._by_id.values() if c.session_id is None and not c.in_use
                           and not c.children and now - c.last_used > idle_seconds), key=order)
        out = globals_[: max(0, len(globals_) - keep)]
        for ctx in out:
            self._forget(ctx)
        if limit is not None:
            over = self.num_globals() - limit
            while over > 0:  # leaves first; their parents may become leaves
                leaves = sorted((c for c in self._by_id.values() if c.session_id is None and not c.in_use
                                 and not c.children), key=lambda c: c.last_used)[:over]
                if not leaves:
                    break
                for ctx in leaves:
                    self._forget(ctx)
                out += leaves
                over -= len(leaves)
        return out

    @staticmethod
    def _block_keys(ctx: CachedContext, hashes: Sequence[int]) -> Iterable[tuple[str, str | None, int, int]]:
        return ((ctx.engine, ctx.salt, k, hashes[k]) for k in range(1, len(hashes)))

    def _forget(self, ctx: CachedContext) -> None:
        if self._by_id.pop((ctx.engine, ctx.context_id), None) is None:
            return
        hashes = block_hashes(ctx.tokens, self.block)
        ending = (ctx.engine, ctx.salt, len(hashes) - 1, hashes[-1])
        found = self._ending.get(ending, [])
        if ctx in found:
            found.remove(ctx)
            if not found:
                del self._ending[ending]
        for key in self._block_keys(ctx, hashes):
            holders = self._blocks.get(key, {})
            holders.pop(id(ctx), None)
            if not holders:
                self._blocks.pop(key, None)
        key = (ctx.engine, ctx.salt, ctx.tokens)
        if self._by_key.get(key) is ctx:
            del self._by_key[key]
            twin = next((c for c in self._by_id.values() if (c.engine, c.salt, c.tokens) == key), None)
            if twin is not None:  # another context holds the same prefix: it answers lookups now
                self._by_key[key] = twin
        if ctx.parent is not None:
            ctx.parent.children -= 1
