"""ContextManager: longest-prefix lookup per engine, ownership, release."""

from __future__ import annotations

from parrot.serve.contexts import ContextManager, block_hashes, salt_digest


def test_longest_prefix_at_boundaries() -> None:
    cm = ContextManager()
    sys_ctx = cm.register("e1", "c1", [1, 2, 3], None, None)
    doc_ctx = cm.register("e1", "c2", [1, 2, 3, 4, 5], sys_ctx, "s1")
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert cm.longest_prefix("e1", tokens, [3, 5, 7]) is doc_ctx
    assert cm.longest_prefix("e1", tokens, [3, 7]) is sys_ctx  # 5 is not a boundary of this request
    assert cm.longest_prefix("e2", tokens, [3, 5, 7]) is None  # other engine
    assert cm.longest_prefix("e1", [1, 2, 9], [3]) is None  # tokens differ
    assert cm.cached_length("e1", tokens, [3, 5]) == 5
    assert sys_ctx.children == 1


def test_session_release_keeps_globals_and_other_sessions() -> None:
    cm = ContextManager()
    g = cm.register("e1", "g", [1, 2], None, None)
    a = cm.register("e1", "a", [1, 2, 3], g, "s1")
    b = cm.register("e1", "b", [1, 2, 4], g, "s2")
    released = cm.release_session("s1")
    assert released == [a]
    assert cm.longest_prefix("e1", [1, 2, 3], [3]) is None
    assert cm.longest_prefix("e1", [1, 2, 4], [3]) is b
    assert cm.longest_prefix("e1", [1, 2, 4], [2]) is g
    assert g.children == 1


def test_cold_globals_evicted_hot_kept() -> None:
    cm = ContextManager(pin_hits=2)
    hot = cm.register("e1", "hot", [1], None, None)
    cold = cm.register("e1", "cold", [2], None, None)
    cm.touch(hot)
    cm.touch(hot)
    assert cm.evict_cold_globals(keep=1) == []  # both were used just now: a task may fork from them
    assert cm.evict_cold_globals(keep=1, idle_seconds=-1) == [cold]
    assert cm.contexts() == [hot]


def test_engine_release_and_hit_rate() -> None:
    cm = ContextManager()
    cm.register("e1", "x", [1, 2], None, None)
    cm.register("e2", "y", [1, 2], None, None)
    assert [c.context_id for c in cm.release_engine("e1")] == ["x"]
    assert [c.context_id for c in cm.contexts()] == ["y"]
    cm.record_lookup(100, 75)
    cm.record_lookup(100, 25)
    assert cm.hit_rate == 0.5


def test_duplicate_prefix_takes_over_when_first_goes() -> None:
    cm = ContextManager()
    first = cm.register("e1", "c1", [7, 8], None, "s1")
    second = cm.register("e1", "c2", [7, 8], None, "s2")
    assert cm.longest_prefix("e1", [7, 8, 9], [2]) is first
    cm.release_session("s1")
    assert cm.longest_prefix("e1", [7, 8, 9], [2]) is second


def test_longest_cached_at_any_length_and_matched_blocks() -> None:
    cm = ContextManager(block=4)
    a = cm.register("e1", "a", list(range(10)), None, None)  # 2 full blocks + 2 tokens
    b = cm.register("e1", "b", list(range(13)), a, None)
    assert cm.longest_cached("e1", list(range(20))) is b
    assert cm.longest_cached("e1", list(range(12))) is a  # b is longer than the prompt
    assert cm.longest_cached("e1", [*range(10), 99]) is a
    assert cm.longest_cached("e1", [*range(9), 99]) is None  # a diverges at its 10th token
    assert cm.longest_cached("e2", list(range(20))) is None
    # the radix view: 2 leading blocks are held (by a longer context that cannot be forked there)
    assert cm.matched_blocks("e1", block_hashes([*range(9), 99], 4)) == 2
    assert cm.matched_blocks("e1", block_hashes([*range(12), 99], 4)) == 3
    assert cm.matched_blocks("e1", block_hashes([99] * 8, 4)) == 0
    # ... and which context holds them: a fork of its first blocks takes them (parent_num_tokens)
    assert cm.holder("e1", list(range(8))) in (a, b) and cm.holder("e1", list(range(12))) is b
    assert cm.holder("e1", list(range(10))) is None  # not a whole number of blocks
    assert cm.holder("e1", list(range(13))) is None  # nothing longer holds them
    assert cm.holder("e1", [*range(7), 99]) is None and cm.holder("e2", list(range(8))) is None
    cm.release_session(None)
    assert cm.longest_cached("e1", list(range(20))) is None and not cm._ending and not cm._blocks



def test_a_salted_context_is_found_only_under_its_salt() -> None:
    """cache_salt: every view (exact prefix, any length, the radix view's blocks and holder) sees a context only
    from requests of its salt; unsalted requests share among themselves; forgetting one leaves the other."""
    cm = ContextManager(block=4)
    tokens = list(range(12))
    plain = cm.register("e1", "plain", tokens, None, None)
    salted = cm.register("e1", "salted", tokens, None, None, salt=salt_digest("tenant-a"))
    a, b = salt_digest("tenant-a"), salt_digest("tenant-b")
    assert a != b and salt_digest(None) is None and len(a) == 32
    assert cm.longest_prefix("e1", tokens, [12]) is plain and cm.longest_prefix("e1", tokens, [12], a) is salted
    assert cm.longest_prefix("e1", tokens, [12], b) is None
    assert cm.longest_cached("e1", [*tokens, 5], salt=a) is salted and cm.longest_cached("e1", tokens, salt=b) is None
    hashes = block_hashes([*range(8), 99], 4)
    assert cm.matched_blocks("e1", hashes, a) == 2 and cm.matched_blocks("e1", hashes, b) == 0
    assert cm.holder("e1", list(range(8)), salt=a) is salted and cm.holder("e1", list(range(8)), salt=b) is None
    cm.discard(plain)
    assert cm.longest_prefix("e1", tokens, [12]) is None and cm.longest_prefix("e1", tokens, [12], a) is salted
    cm.discard(salted)
    assert not cm._by_key and not cm._ending and not cm._blocks


def test_cache_limit_evicts_least_recently_used_leaves_now() -> None:
    cm = ContextManager(block=4)
    root = cm.register("e1", "root", [1, 2, 3, 4], None, None)
    leaves = [cm.register("e1", f"l{i}", [1, 2, 3, 4, i], root, None) for i in range(4)]
    leaves[0].in_use = 1  # a task forks it now: kept
    out = cm.evict_cold_globals(keep=10, limit=3)  # all used just now, but over the limit
    assert out == leaves[1:3] and cm.num_globals() == 3  # root has children: kept while they are
    out = cm.evict_cold_globals(keep=10, limit=1)
    assert out == [leaves[3]] and {c.context_id for c in cm.contexts()} == {"root", "l0"}
