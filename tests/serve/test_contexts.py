"""ContextManager: longest-prefix lookup per engine, ownership, release."""

from __future__ import annotations

from parrot.serve.contexts import ContextManager


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
