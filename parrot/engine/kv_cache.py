"""Host-side bookkeeping of the paged KV pool: which pages each context owns, and the context tree.

Pure Python (no JAX): the runner owns the device arrays, this module only decides page numbers.

Pool. The pool has `num_pages` pages of `page_size` token slots each. Page 0 is the scratch page that
padding tokens write to (see `parrot.engine.batch.build_batch`); it is never handed to a context, so
pages `1 .. num_pages - 1` are allocatable. Every page has a reference count: the number of contexts
whose page list holds it. A page with count 0 is on the free list and nowhere else.

Contexts. A context is a token sequence whose KV lives in `pages`: token `i` is in slot
`i % page_size` of `pages[i // page_size]`, and a context always holds exactly
`ceil(num_tokens / page_size)` pages.

Fork semantics (Parrot). `fork(child, parent)` makes a child that starts with the parent's tokens:

* the parent's FULL pages are shared, not copied: the child's page list starts with them and each
  one's reference count goes up by one. A full page is never written again by anyone, so sharing it
  is safe; `num_shared_tokens` records how many tokens the child got this way (parent's full pages
  times `page_size`);
* if the parent's last page is partial, the child gets a fresh page of its own and `fork` returns a
  `PageCopy` telling the runner to copy the first `num_tokens` slots of the parent's page into it
  before either context writes again. Both can then append independently.

So a context only ever writes into its own last, partial page, and that page is never shared
(reference count 1). `truncate` keeps that true: cutting a context back into the middle of a shared
page copies that page (copy on write, again returned as a `PageCopy`).

Freeing a context drops one reference from each of its pages; pages reaching 0 return to the free
list. Its children stay valid (the pages they share stay alive through their own references) and
become roots (`parent_id = None`).

Growing. `extend(context_id, n)` is the single call the engine makes before writing `n` new tokens
of a context: it allocates the pages needed (all or nothing), advances `num_tokens` by `n` and
returns the page list to use for the write (positions `old_num_tokens .. old_num_tokens + n - 1`).
There is no separate reserve/commit step; if the forward step fails, roll back with
`truncate(context_id, old_num_tokens)`. Every call that needs pages either succeeds or raises
`OutOfPages` leaving the manager exactly as it was.

Every call costs O(pages touched) (plus O(children) for `free`, and a scan of the free pages where a
context starts a new run of pages); the free pages are a `page_pool.PagePool`, which hands a growing context
the page after its last one where it can, so that its pages lie in runs. `truncate` after `extend` gives back
exactly the pages the extend took.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from parrot.engine.page_pool import PagePool
from parrot.errors import KVCacheFullError, NotFoundError, ParrotError

SCRATCH_PAGE = 0


class OutOfPages(ParrotError):
    """The KV pool has too few free pages for the request; nothing was changed."""

    code = KVCacheFullError.code

    def __init__(self, needed: int, available: int, what: str = "") -> None:
        self.needed, self.available = needed, available
        suffix = f" to {what}" if what else ""
        super().__init__(f"KV cache is full: {needed} page(s) needed{suffix}, {available} free")


@dataclass(frozen=True)
class PageCopy:
    """A device copy the runner must perform: the first `num_tokens` slots of page `src` to `dst`."""

    src: int
    dst: int
    num_tokens: int


@dataclass
class Context:
    """One context of the tree. Read-only for callers: only `KVCacheManager` changes it."""

    context_id: str
    parent_id: str | None
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # tokens whose pages came shared from the parent at fork time (parent's full pages * page_size);
    # `truncate` lowers it when it cuts into them
    num_shared_tokens: int = 0
    children: set[str] = field(default_factory=set)


class KVCacheManager:
    """Page allocator and context tree over a pool of `num_pages` pages of `page_size` tokens."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (page 0 is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount: list[int] = [0] * num_pages
        self._free = PagePool(num_pages, SCRATCH_PAGE + 1, runs=os.environ.get("PARROT_PAGE_RUNS", "1") != "0")
        self._contexts: dict[str, Context] = {}
        self._num_cached_tokens = 0

    # ---- queries ------------------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        """Allocatable pages (the scratch page excluded)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> list[int]:
        """The free pages, in order (O(pages); use `num_free_pages` for the count)."""
        return self._free.pages()

    @property
    def num_used_pages(self) -> int:
        return self.total_pages - len(self._free)

    @property
    def num_written_pages(self) -> int:
        """Pages handed out and not given back to the OS since (`released`): on a CPU, where the lazily zeroed
        pool is resident."""
        return self._free.ever_taken

    def releasable(self) -> np.ndarray:
        """The free pages written since they were last given back (bool, [num_pages])."""
        return self._free.releasable()

    def release_span(self, most: int) -> np.ndarray:
        """The free pages to give back to the OS next, about `most` of them written (`PagePool.release_span`)."""
        return self._free.release_span(most)

    def released(self, pages: np.ndarray) -> None:
        """The runner gave these free pages (a bool mask) back to the OS (`ModelRunner.release_pages`)."""
        self._free.released(pages)

    @property
    def num_cached_tokens(self) -> int:
        """Sum of `num_tokens` over all contexts (a shared token counts once per context)."""
        return self._num_cached_tokens

    def refcount(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range 0..{self.num_pages - 1}")
        return self._refcount[page]

    def get(self, context_id: str) -> Context:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise NotFoundError(f"context {context_id!r} does not exist") from None

    def __contains__(self, context_id: object) -> bool:
        return context_id in self._contexts

    def __len__(self) -> int:
        return len(self._contexts)

    def __iter__(self) -> Iterator[str]:
        return iter(self._contexts)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a context of `num_tokens` tokens holds: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)

    def pages_needed(self, context_id: str, n_tokens: int) -> int:
        """New pages `extend(context_id, n_tokens)` would allocate."""
        ctx = self.get(context_id)
        _check_count(n_tokens)
        return self.pages_for(ctx.num_tokens + n_tokens) - len(ctx.pages)

    def can_extend(self, context_id: str, n_tokens: int) -> bool:
        return self.pages_needed(context_id, n_tokens) <= len(self._free)

    # ---- tree ---------------------------------------------------------------------------------
    def create(self, context_id: str) -> Context:
        """A new empty root context. Allocates nothing."""
        self._check_new(context_id)
        ctx = Context(context_id, None)
        self._contexts[context_id] = ctx
        return ctx

    def fork(self, context_id: str, parent_id: str, num_tokens: int | None = None) -> PageCopy | None:
        """A new child of `parent_id` holding the parent's first `num_tokens` tokens (default: all of them;
        at most what the parent's KV holds): full pages shared, a partial last page copied into a fresh
        page. Returns that copy for the runner to perform, or None."""
        self._check_new(context_id)
        parent = self.get(parent_id)
        n = parent.num_tokens if num_tokens is None else min(num_tokens, parent.num_tokens)
        full = n // self.page_size
        partial = n % self.page_size
        if partial and not self._free:
            raise OutOfPages(1, 0, f"fork {parent_id!r}")
        pages = parent.pages[:full]
        for p in pages:
            self._refcount[p] += 1
        copy = None
        if partial:
            dst = self._alloc()
            pages.append(dst)
            copy = PageCopy(src=parent.pages[full], dst=dst, num_tokens=partial)
        self._contexts[context_id] = Context(context_id, parent_id, pages, n, full * self.page_size)
        parent.children.add(context_id)
        self._num_cached_tokens += n
        return copy

    def free(self, context_id: str) -> int:
        """Drop a context: one reference off each of its pages, pages reaching 0 go back to the free
        list. Its children stay valid and become roots. Returns the number of pages freed."""
        ctx = self.get(context_id)
        freed = self._release(ctx.pages)
        for child in ctx.children:
            self._contexts[child].parent_id = None
        if ctx.parent_id is not None:
            self._contexts[ctx.parent_id].children.discard(context_id)
        self._num_cached_tokens -= ctx.num_tokens
        del self._contexts[context_id]
        return freed

    # ---- growing and shrinking ------------------------------------------------------------------
    def extend(self, context_id: str, n_tokens: int) -> list[int]:
        """Make room for `n_tokens` more tokens and count them in (`num_tokens += n_tokens`); returns
        (a copy of) the context's page list. All or nothing: raises OutOfPages with no change."""
        ctx = self.get(context_id)
        _check_count(n_tokens)
        need = self.pages_for(ctx.num_tokens + n_tokens) - len(ctx.pages)
        if need > len(self._free):
            raise OutOfPages(need, len(self._free), f"extend {context_id!r} by {n_tokens} tokens")
        if n_tokens and ctx.num_tokens % self.page_size:
            # the tokens go into the last page first: it must be ours alone (fork copies partial pages)
            assert self._refcount[ctx.pages[-1]] == 1, f"context {context_id!r} would write a shared page"
        if need:
            for p in self._free.take(need, ctx.pages[-1] if ctx.pages else None):
                self._refcount[p] = 1
                ctx.pages.append(p)
        ctx.num_tokens += n_tokens
        self._num_cached_tokens += n_tokens
        return list(ctx.pages)

    def truncate(self, context_id: str, n_tokens: int) -> PageCopy | None:
        """Shrink a context to its first `n_tokens` tokens (preemption, recompute, rollback), freeing
        the pages no longer needed. If the new last page is partial and shared, it is replaced by a
        private copy (returned for the runner to perform) so later writes never touch shared pages;
        that needs a free page, and raises OutOfPages with no change when there is none (never the
        case when truncating to a page boundary or rolling back an `extend`)."""
        ctx = self.get(context_id)
        _check_count(n_tokens)
        if n_tokens > ctx.num_tokens:
            raise ValueError(f"cannot truncate context {context_id!r} of {ctx.num_tokens} tokens "
                             f"to {n_tokens}")
        keep = self.pages_for(n_tokens)
        partial = n_tokens % self.page_size
        cow = bool(partial) and self._refcount[ctx.pages[keep - 1]] > 1
        if cow and not self._free:
            # the pages dropped may free one; all-or-nothing means checking before touching anything
            if not any(self._refcount[p] == 1 for p in ctx.pages[keep:]):
                raise OutOfPages(1, 0, f"copy a shared page while truncating {context_id!r}")
        self._release(ctx.pages[keep:])
        del ctx.pages[keep:]
        copy = None
        if cow:
            src = ctx.pages[keep - 1]
            dst = self._alloc()
            self._refcount[src] -= 1  # > 0: it was shared
            ctx.pages[keep - 1] = dst
            copy = PageCopy(src=src, dst=dst, num_tokens=partial)
        self._num_cached_tokens -= ctx.num_tokens - n_tokens
        ctx.num_tokens = n_tokens
        ctx.num_shared_tokens = min(ctx.num_shared_tokens, (n_tokens // self.page_size) * self.page_size)
        return copy

    # ---- internals ----------------------------------------------------------------------------
    def _check_new(self, context_id: str) -> None:
        if context_id in self._contexts:
            raise ValueError(f"context {context_id!r} already exists")

    def _alloc(self, after: int | None = None) -> int:
        page = self._free.take(1, after)[0]
        self._refcount[page] = 1
        return page

    def _release(self, pages: list[int]) -> int:
        # last page first: undoing an `extend` gives its pages back in the order a stack of them needs
        freed = 0
        for p in reversed(pages):
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.give(p)
                freed += 1
        return freed


def _check_count(n_tokens: int) -> None:
    if n_tokens < 0:
        raise ValueError(f"token count must be >= 0, got {n_tokens}")
