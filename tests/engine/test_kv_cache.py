"""KVCacheManager: unit tests for each behaviour and error, and a hypothesis state machine that runs
random create / fork / extend / truncate / free sequences against a simulated device pool."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from parrot.engine.kv_cache import Context, KVCacheManager, OutOfPages, PageCopy
from parrot.errors import NotFoundError, ParrotError

PS = 4  # page size of the unit tests


def snapshot(m: KVCacheManager) -> dict[str, Any]:
    """Everything observable about a manager, to check that a failed call changed nothing."""
    return {
        "free": m.free_pages,
        "refcounts": [m.refcount(p) for p in range(m.num_pages)],
        "contexts": {cid: copy.deepcopy(m.get(cid)) for cid in m},
        "cached": m.num_cached_tokens,
    }


def filled(m: KVCacheManager, cid: str, n: int) -> Context:
    m.create(cid)
    m.extend(cid, n)
    return m.get(cid)


# ---- construction and queries --------------------------------------------------------------------
def test_new_pool() -> None:
    m = KVCacheManager(num_pages=8, page_size=PS)
    assert m.total_pages == 7
    assert m.num_free_pages == 7
    assert sorted(m.free_pages) == list(range(1, 8))
    assert m.num_used_pages == 0
    assert m.num_cached_tokens == 0
    assert len(m) == 0
    assert m.num_written_pages == 0
    assert all(m.refcount(p) == 0 for p in range(8))


@pytest.mark.parametrize("num_pages,page_size", [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_bad_construction(num_pages: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        KVCacheManager(num_pages, page_size)


def test_written_pages_count_every_page_ever_handed_out() -> None:
    """Pages freed stay written (a CPU's pool stays resident there); taken again, they count once."""
    m = KVCacheManager(num_pages=16, page_size=PS)
    filled(m, "a", 3 * PS)
    filled(m, "b", PS + 1)
    assert m.num_written_pages == m.num_used_pages == 5
    m.free("a")
    assert m.num_written_pages == 5 and m.num_used_pages == 2
    taken = len(set(filled(m, "c", 2 * PS).pages) - set(m.get("b").pages))
    assert taken == 2 and m.num_written_pages <= 7


def test_released_pages_no_longer_count_as_written() -> None:
    """Free written pages given back to the OS (`released`) leave the written count; used ones never do."""
    m = KVCacheManager(num_pages=16, page_size=PS)
    filled(m, "a", 3 * PS)
    filled(m, "b", 2 * PS)
    m.free("a")
    pages = m.releasable()
    assert pages.sum() == 3 and not pages[m.get("b").pages].any() and not pages[0]
    m.released(np.ones(16, bool))  # a mask that also names used pages and the scratch page: only free ones count
    assert m.num_written_pages == m.num_used_pages == 2 and not m.releasable().any()
    filled(m, "c", PS)
    assert m.num_written_pages == 3


def test_only_scratch_page() -> None:
    m = KVCacheManager(num_pages=1, page_size=PS)
    assert m.total_pages == 0
    m.create("a")
    assert m.extend("a", 0) == []
    with pytest.raises(OutOfPages):
        m.extend("a", 1)


def test_refcount_out_of_range() -> None:
    m = KVCacheManager(4, PS)
    with pytest.raises(IndexError):
        m.refcount(4)
    with pytest.raises(IndexError):
        m.refcount(-1)


def test_pages_for() -> None:
    m = KVCacheManager(4, PS)
    assert [m.pages_for(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


# ---- create / get / contains ---------------------------------------------------------------------
def test_create_empty_root() -> None:
    m = KVCacheManager(8, PS)
    ctx = m.create("a")
    assert ctx == Context("a", None, [], 0, 0, set())
    assert m.get("a") is ctx
    assert "a" in m and "b" not in m
    assert list(m) == ["a"]
    assert m.num_free_pages == 7


def test_create_duplicate() -> None:
    m = KVCacheManager(8, PS)
    m.create("a")
    with pytest.raises(ValueError, match="already exists"):
        m.create("a")


def test_get_unknown() -> None:
    m = KVCacheManager(8, PS)
    with pytest.raises(NotFoundError):
        m.get("nope")
    for call in (lambda: m.extend("nope", 1), lambda: m.truncate("nope", 0), lambda: m.free("nope"),
                 lambda: m.pages_needed("nope", 1)):
        with pytest.raises(NotFoundError):
            call()


# ---- extend --------------------------------------------------------------------------------------
def test_extend_allocates_pages_as_needed() -> None:
    m = KVCacheManager(8, PS)
    m.create("a")
    assert m.pages_needed("a", 1) == 1
    pages = m.extend("a", 1)
    assert len(pages) == 1 and 0 not in pages
    assert m.pages_needed("a", 3) == 0  # the partial page is filled first
    assert m.extend("a", 3) == pages
    assert m.pages_needed("a", 1) == 1
    assert m.pages_needed("a", 9) == 3
    pages = m.extend("a", 9)
    assert len(pages) == 4 == len(set(pages))
    ctx = m.get("a")
    assert ctx.num_tokens == 13 and ctx.pages == pages
    assert m.num_free_pages == 3
    assert m.num_cached_tokens == 13
    assert all(m.refcount(p) == 1 for p in pages)


def test_extend_returns_a_copy() -> None:
    m = KVCacheManager(8, PS)
    m.create("a")
    pages = m.extend("a", 5)
    pages.append(99)
    assert m.get("a").pages == pages[:-1]


def test_extend_zero_and_negative() -> None:
    m = KVCacheManager(8, PS)
    m.create("a")
    assert m.extend("a", 0) == []
    assert m.get("a").num_tokens == 0
    with pytest.raises(ValueError):
        m.extend("a", -1)
    with pytest.raises(ValueError):
        m.pages_needed("a", -1)


def test_extend_out_of_pages_changes_nothing() -> None:
    m = KVCacheManager(4, PS)  # 3 allocatable pages
    m.create("a")
    m.extend("a", 6)
    before = snapshot(m)
    assert not m.can_extend("a", 7)
    with pytest.raises(OutOfPages) as exc:
        m.extend("a", 7)  # needs 2 pages, 1 free
    assert exc.value.needed == 2 and exc.value.available == 1
    assert isinstance(exc.value, ParrotError)
    assert "full" in str(exc.value)
    assert snapshot(m) == before
    assert m.can_extend("a", 6)
    m.extend("a", 6)  # exactly fills the pool
    assert m.num_free_pages == 0


def test_scratch_page_never_allocated() -> None:
    m = KVCacheManager(6, 1)
    m.create("a")
    pages = m.extend("a", 5)
    assert sorted(pages) == [1, 2, 3, 4, 5]
    with pytest.raises(OutOfPages):
        m.extend("a", 1)
    assert m.refcount(0) == 0


# ---- fork ----------------------------------------------------------------------------------------
def test_fork_page_aligned_shares_everything() -> None:
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 8)
    free = m.num_free_pages
    assert m.fork("c", "p") is None
    child = m.get("c")
    assert child.pages == parent.pages and child.pages is not parent.pages
    assert child.num_tokens == 8 and child.num_shared_tokens == 8
    assert child.parent_id == "p" and parent.children == {"c"}
    assert all(m.refcount(p) == 2 for p in parent.pages)
    assert m.num_free_pages == free
    assert m.num_cached_tokens == 16


def test_fork_partial_page_is_copied() -> None:
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 10)  # 2 full pages + 2 tokens
    cp = m.fork("c", "p")
    child = m.get("c")
    assert cp == PageCopy(src=parent.pages[2], dst=child.pages[2], num_tokens=2)
    assert child.pages[:2] == parent.pages[:2]
    assert child.pages[2] not in parent.pages
    assert child.num_tokens == 10 and child.num_shared_tokens == 8
    assert [m.refcount(p) for p in parent.pages] == [2, 2, 1]
    assert m.refcount(child.pages[2]) == 1
    assert m.num_free_pages == 8 - 1 - 4


def test_fork_of_a_prefix() -> None:
    """A child of the parent's first N tokens: the pages wholly inside them shared, the page N ends in
    copied up to N; asking for more than the parent's KV holds gives what it holds."""
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 13)  # 3 full pages + 1 token
    assert m.fork("c", "p", 8) is None  # page-aligned prefix: two pages shared, nothing copied
    assert m.get("c").pages == parent.pages[:2] and m.get("c").num_tokens == 8
    cp = m.fork("d", "p", 6)  # one full page + 2 tokens of the second
    assert cp == PageCopy(src=parent.pages[1], dst=m.get("d").pages[1], num_tokens=2)
    assert m.get("d").num_tokens == 6 and m.get("d").num_shared_tokens == 4
    assert m.fork("e", "p", 99) is not None and m.get("e").num_tokens == 13
    assert m.fork("f", "p", 0) is None and m.get("f").pages == []
    assert [m.refcount(p) for p in parent.pages] == [4, 3, 2, 1]


def test_fork_of_empty_and_short_parents() -> None:
    m = KVCacheManager(8, PS)
    m.create("p")
    assert m.fork("c", "p") is None
    assert m.get("c").pages == [] and m.get("c").num_tokens == 0
    m.extend("p", 3)
    cp = m.fork("d", "p")
    assert cp is not None and cp.num_tokens == 3
    assert m.get("d").num_shared_tokens == 0
    assert m.get("p").children == {"c", "d"}


def test_forked_contexts_grow_independently() -> None:
    m = KVCacheManager(16, PS)
    parent = filled(m, "p", 6)
    m.fork("c", "p")
    child = m.get("c")
    m.extend("p", 5)
    m.extend("c", 3)
    assert parent.pages[0] == child.pages[0]
    assert set(parent.pages[1:]).isdisjoint(child.pages[1:])
    assert parent.num_tokens == 11 and child.num_tokens == 9


def test_fork_out_of_pages_changes_nothing() -> None:
    m = KVCacheManager(4, PS)
    filled(m, "p", 10)  # 3 pages: pool full, last page partial
    before = snapshot(m)
    with pytest.raises(OutOfPages):
        m.fork("c", "p")
    assert snapshot(m) == before
    assert "c" not in m


def test_fork_page_aligned_needs_no_free_page() -> None:
    m = KVCacheManager(3, PS)
    filled(m, "p", 8)
    assert m.num_free_pages == 0
    assert m.fork("c", "p") is None


def test_fork_errors() -> None:
    m = KVCacheManager(8, PS)
    filled(m, "p", 5)
    m.create("x")
    with pytest.raises(NotFoundError):
        m.fork("c", "nope")
    with pytest.raises(ValueError):
        m.fork("x", "p")
    with pytest.raises(ValueError):
        m.fork("p", "p")
    assert m.get("p").children == set()


def test_nested_forks() -> None:
    m = KVCacheManager(16, PS)
    filled(m, "a", 4)
    m.fork("b", "a")
    m.extend("b", 4)
    m.fork("c", "b")
    a, b, c = m.get("a"), m.get("b"), m.get("c")
    assert c.pages == b.pages and c.num_shared_tokens == 8
    assert m.refcount(a.pages[0]) == 3
    assert m.refcount(b.pages[1]) == 2


# ---- free ----------------------------------------------------------------------------------------
def test_free_returns_pages() -> None:
    m = KVCacheManager(8, PS)
    ctx = filled(m, "a", 9)
    pages = list(ctx.pages)
    assert m.free("a") == 3
    assert "a" not in m
    assert m.num_free_pages == 7
    assert all(m.refcount(p) == 0 for p in pages)
    assert m.num_cached_tokens == 0
    with pytest.raises(NotFoundError):
        m.free("a")


def test_free_parent_keeps_children_valid() -> None:
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 10)
    shared = parent.pages[:2]
    m.fork("c1", "p")
    m.fork("c2", "p")
    assert m.free("p") == 1  # only its private partial page
    for cid in ("c1", "c2"):
        child = m.get(cid)
        assert child.parent_id is None
        assert child.pages[:2] == shared and child.num_tokens == 10
    assert all(m.refcount(p) == 2 for p in shared)
    m.free("c1")
    assert all(m.refcount(p) == 1 for p in shared)
    m.extend("c2", 6)  # pages no longer shared with anyone; writing past them is fine
    assert m.free("c2") == 4
    assert m.num_free_pages == 7


def test_free_child_updates_parent() -> None:
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 8)
    m.fork("c", "p")
    assert m.free("c") == 0  # every page still held by the parent
    assert parent.children == set()
    assert all(m.refcount(p) == 1 for p in parent.pages)
    m.fork("c", "p")  # the id can be reused
    assert parent.children == {"c"}


# ---- truncate ------------------------------------------------------------------------------------
def test_truncate_frees_pages() -> None:
    m = KVCacheManager(8, PS)
    ctx = filled(m, "a", 13)
    tail = ctx.pages[2:]
    assert m.truncate("a", 7) is None
    assert ctx.num_tokens == 7 and len(ctx.pages) == 2
    assert all(m.refcount(p) == 0 for p in tail)
    assert m.num_free_pages == 5
    assert m.num_cached_tokens == 7
    assert m.truncate("a", 7) is None  # no-op
    assert m.truncate("a", 0) is None
    assert ctx.pages == [] and ctx.num_tokens == 0
    assert m.num_free_pages == 7


def test_truncate_errors() -> None:
    m = KVCacheManager(8, PS)
    filled(m, "a", 5)
    with pytest.raises(ValueError):
        m.truncate("a", 6)
    with pytest.raises(ValueError):
        m.truncate("a", -1)


def test_truncate_rolls_back_extend() -> None:
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 8)
    m.fork("c", "p")
    child = m.get("c")
    before = snapshot(m)
    m.extend("c", 6)
    assert m.truncate("c", 8) is None
    assert snapshot(m) == before
    assert child.pages == parent.pages


def test_truncate_into_shared_page_copies_it() -> None:
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 8)
    m.fork("c", "p")
    child = m.get("c")
    cp = m.truncate("c", 6)  # cuts into the second, shared page
    assert cp is not None
    assert cp.src == parent.pages[1] and cp.num_tokens == 2
    assert child.pages == [parent.pages[0], cp.dst]
    assert m.refcount(parent.pages[1]) == 1 and m.refcount(cp.dst) == 1
    assert child.num_tokens == 6 and child.num_shared_tokens == 4
    m.extend("c", 1)  # writes into its private copy


def test_truncating_the_parent_copies_too() -> None:
    m = KVCacheManager(8, PS)
    parent = filled(m, "p", 8)
    m.fork("c", "p")
    child = m.get("c")
    cp = m.truncate("p", 5)
    assert cp is not None and cp.src == child.pages[1]
    assert parent.pages == [child.pages[0], cp.dst]


def test_truncate_copy_out_of_pages_changes_nothing() -> None:
    m = KVCacheManager(3, PS)
    filled(m, "p", 8)
    m.fork("c", "p")
    assert m.num_free_pages == 0
    before = snapshot(m)
    with pytest.raises(OutOfPages):
        m.truncate("c", 6)
    assert snapshot(m) == before
    assert m.truncate("c", 4) is None  # page aligned: no copy needed


def test_truncate_copy_reuses_a_page_it_frees() -> None:
    m = KVCacheManager(4, PS)
    filled(m, "p", 8)
    m.fork("c", "p")
    m.extend("c", 4)  # c: [shared, shared, own]; pool full
    assert m.num_free_pages == 0
    own = m.get("c").pages[2]
    cp = m.truncate("c", 6)
    assert cp is not None and cp.dst == own
    assert m.num_free_pages == 0


# ---- property tests ------------------------------------------------------------------------------
class KVCacheMachine(RuleBasedStateMachine):
    """Random operations against the manager and a simulated device pool.

    The device is a dict page -> slots; every token ever written is a unique integer. `extend`
    writes through the returned pages, PageCopy results are applied, and after every step each
    context's tokens read back through its pages must be exactly what it wrote (so no context ever
    wrote into a page another context reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.device: dict[int, list[int | None]] = {}
        self.tokens: dict[str, list[int]] = {}  # expected token sequence per context
        self.fork_pages: dict[str, list[int]] = {}  # the parent's full pages at fork time
        self.next_id = 0
        self.next_token = 0

    @initialize(num_pages=st.integers(1, 12), page_size=st.integers(1, 4))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.m = KVCacheManager(num_pages, page_size)
        self.ps = page_size
        self.device = {p: [None] * page_size for p in range(num_pages)}

    # helpers
    def pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    def new_id(self) -> str:
        self.next_id += 1
        return f"ctx{self.next_id}"

    def apply(self, cp: PageCopy | None) -> None:
        if cp is not None:
            assert cp.src != cp.dst and 0 not in (cp.src, cp.dst)
            assert 0 < cp.num_tokens < self.ps
            self.device[cp.dst][: cp.num_tokens] = self.device[cp.src][: cp.num_tokens]

    # rules
    @rule()
    def create(self) -> None:
        cid = self.new_id()
        self.m.create(cid)
        self.tokens[cid] = []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = self.pick(data)
        parent = self.m.get(parent_id)
        full = parent.num_tokens // self.ps
        cid = self.new_id()
        before = snapshot(self.m)
        try:
            cp = self.m.fork(cid, parent_id)
        except OutOfPages:
            assert parent.num_tokens % self.ps and before["free"] == []
            assert snapshot(self.m) == before
            return
        assert (cp is None) == (parent.num_tokens % self.ps == 0)
        self.apply(cp)
        child = self.m.get(cid)
        assert child.parent_id == parent_id and cid in parent.children
        assert child.num_tokens == parent.num_tokens
        assert child.num_shared_tokens == full * self.ps
        assert child.pages[:full] == parent.pages[:full]
        assert not set(child.pages[full:]) & set(parent.pages)
        self.tokens[cid] = list(self.tokens[parent_id])
        self.fork_pages[cid] = parent.pages[:full]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 9))
    def extend(self, data: st.DataObject, n: int) -> None:
        cid = self.pick(data)
        ctx = self.m.get(cid)
        need = self.m.pages_needed(cid, n)
        assert need == -(-(ctx.num_tokens + n) // self.ps) - len(ctx.pages)
        before = snapshot(self.m)
        try:
            pages = self.m.extend(cid, n)
        except OutOfPages:
            assert need > len(before["free"])
            assert snapshot(self.m) == before
            return
        assert need <= len(before["free"])
        start = len(self.tokens[cid])
        for pos in range(start, start + n):
            self.device[pages[pos // self.ps]][pos % self.ps] = self.next_token
            self.tokens[cid].append(self.next_token)
            self.next_token += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        cid = self.pick(data)
        n = data.draw(st.integers(0, self.m.get(cid).num_tokens))
        before = snapshot(self.m)
        try:
            cp = self.m.truncate(cid, n)
        except OutOfPages:
            assert n % self.ps and before["free"] == []
            assert snapshot(self.m) == before
            return
        self.apply(cp)
        del self.tokens[cid][n:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        cid = self.pick(data)
        ctx = self.m.get(cid)
        children, pages = set(ctx.children), list(ctx.pages)
        freed = self.m.free(cid)
        assert freed == sum(1 for p in pages if self.m.refcount(p) == 0)
        for child in children:
            assert self.m.get(child).parent_id is None
        del self.tokens[cid]
        self.fork_pages.pop(cid, None)

    @rule(data=st.data())
    def errors(self, data: st.DataObject) -> None:
        before = snapshot(self.m)
        if self.tokens:
            cid = self.pick(data)
            with pytest.raises(ValueError):
                self.m.create(cid)
            with pytest.raises(ValueError):
                self.m.fork(cid, cid)
            with pytest.raises(ValueError):
                self.m.truncate(cid, self.m.get(cid).num_tokens + 1)
        with pytest.raises(NotFoundError):
            self.m.fork("fresh", "missing")
        with pytest.raises(NotFoundError):
            self.m.free("missing")
        assert snapshot(self.m) == before

    # invariants
    @invariant()
    def pages_accounted(self) -> None:
        m = self.m
        free = m.free_pages
        held = Counter(p for cid in m for p in m.get(cid).pages)
        assert len(free) == len(set(free)) == m.num_free_pages
        assert not set(free) & set(held), "a referenced page is on the free list"
        assert set(free) | set(held) == set(range(1, m.num_pages)), "a page leaked"
        assert 0 not in held and 0 not in free
        for p in range(m.num_pages):
            assert m.refcount(p) == held.get(p, 0)

    @invariant()
    def contexts_consistent(self) -> None:
        m = self.m
        assert set(m) == set(self.tokens)
        assert m.num_cached_tokens == sum(len(t) for t in self.tokens.values())
        for cid in m:
            ctx = m.get(cid)
            assert ctx.context_id == cid
            assert ctx.num_tokens == len(self.tokens[cid])
            assert len(ctx.pages) == -(-ctx.num_tokens // self.ps)
            assert len(set(ctx.pages)) == len(ctx.pages)
            if ctx.num_tokens % self.ps:
                assert m.refcount(ctx.pages[-1]) == 1, "a partial last page is shared"
            # the tree: parent and children links agree
            if ctx.parent_id is not None:
                assert cid in m.get(ctx.parent_id).children
            for child in ctx.children:
                assert m.get(child).parent_id == cid
            # forks share exactly the parent's full pages (as far as not truncated since)
            shared = ctx.num_shared_tokens
            assert shared % self.ps == 0 and shared <= ctx.num_tokens
            if cid in self.fork_pages:
                k = shared // self.ps
                assert ctx.pages[:k] == self.fork_pages[cid][:k]
            else:
                assert shared == 0

    @invariant()
    def device_contents(self) -> None:
        for cid, expected in self.tokens.items():
            pages = self.m.get(cid).pages
            got = [self.device[pages[i // self.ps]][i % self.ps] for i in range(len(expected))]
            assert got == expected, f"context {cid} reads back wrong tokens"


KVCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
