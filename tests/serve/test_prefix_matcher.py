"""Prefix matcher: shared leading constant text is cut out consistently."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from parrot.serve.prefix_matcher import PrefixMatcher, common_prefix_len

SYSTEM = ("<|im_start|>system\nYou are a careful assistant. Answer briefly, cite sources, and never invent "
          "facts.<|im_end|>\n")
FEW_SHOT = "Example: Q: 2+2? A: 4. Example: Q: capital of France? A: Paris. Now the real question follows.\n"


def test_common_prefix_len():
    assert common_prefix_len("abc", "abd") == 2
    assert common_prefix_len("abc", "abc") == 3
    assert common_prefix_len("ab", "abc") == 2
    assert common_prefix_len("", "x") == 0
    assert common_prefix_len("x", "y") == 0


def test_unseen_text_is_whole():
    m = PrefixMatcher()
    assert m.split(SYSTEM + "Hi") == [SYSTEM + "Hi"]
    assert m.split("") == [""]


def test_system_prompt_is_cut_out():
    m = PrefixMatcher()
    first = SYSTEM + "<|im_start|>user\nWhat is the capital of France?"
    m.add(first)
    second = SYSTEM + "<|im_start|>user\nWhy is the sky blue?"
    pieces = m.split(second)
    assert "".join(pieces) == second
    # the common prefix runs into "Wh"; the cut moves back to the start of the line
    assert pieces == [SYSTEM + "<|im_start|>user\n", "Why is the sky blue?"]
    m.add(second)
    third = SYSTEM + "<|im_start|>user\nWhere is Rome?"
    assert m.split(third)[0] == SYSTEM + "<|im_start|>user\n"
    assert m.shared_prefixes == [SYSTEM + "<|im_start|>user\n"]


def test_cut_before_a_space():
    m = PrefixMatcher(min_shared_chars=10)
    m.add("You are a helpful bot. What now?")
    assert m.split("You are a helpful bot. Why not?") == ["You are a helpful bot.", " Why not?"]


def test_short_shared_prefix_is_ignored():
    m = PrefixMatcher()
    m.add("Short system. Question one?")
    assert m.split("Short system. Question two?") == ["Short system. Question two?"]
    m.add("Short system. Question two?")
    assert m.shared_prefixes == []


def test_hierarchical_cuts():
    m = PrefixMatcher()
    for text in [SYSTEM + "Q: one", SYSTEM + "Q: two", SYSTEM + FEW_SHOT + "Q: three", SYSTEM + FEW_SHOT + "Q: four"]:
        m.add(text)
    # shared: SYSTEM (all four), SYSTEM + "Q:" (one, two), SYSTEM + FEW_SHOT + "Q:" (three, four)
    assert m.split(SYSTEM + FEW_SHOT + "Q: five") == [SYSTEM, FEW_SHOT + "Q:", " five"]
    assert m.split(SYSTEM + "Q: six") == [SYSTEM, "Q:", " six"]
    assert m.split(SYSTEM + "Other") == [SYSTEM, "Other"]


def test_text_that_is_a_known_prefix():
    m = PrefixMatcher()
    m.add(SYSTEM + "Q: one")
    assert m.split(SYSTEM) == [SYSTEM]  # a prefix of a remembered text: nothing to cut
    m.add(SYSTEM)
    assert m.split(SYSTEM + "Q: two") == [SYSTEM, "Q:", " two"]


def test_add_is_idempotent_and_bounded():
    m = PrefixMatcher(min_shared_chars=4, max_texts=3)
    for t in ["aaaa1", "aaaa1", "bbbb1", "cccc1", "dddd1"]:
        m.add(t)
    assert len(m) == 3
    assert m.split("aaaa2") == ["aaaa2"]  # "aaaa1" was forgotten (oldest)
    assert m.split("dddd2") == ["dddd", "2"]


def test_memory_is_bounded_by_characters():
    """Long distinct texts (the constant text of sessions since deleted): the matcher holds at most max_chars
    of them, and at most max_shared / max_shared_chars of the prefixes they shared, least recently used gone
    first; a shared prefix that keeps cutting texts stays."""
    m = PrefixMatcher(min_shared_chars=4, max_chars=10_000, max_shared=3, max_shared_chars=2_000)
    keep = "K" * 300
    m.add(keep + " one")
    m.add(keep + " two")  # shares `keep`
    for i in range(50):
        head = f"{i:04d}" + "x" * 500
        m.add(head + " a" + "y" * 2_000)
        m.add(head + " b" + "z" * 2_000)  # shares a 504-character prefix with the one before
        assert m.split(keep + " three")[0] == keep  # used: stays the most recently used
        assert m._chars <= 10_000 and m._shared_chars <= 2_000 and len(m.shared_prefixes) <= 3
    assert keep in m.shared_prefixes and len(m) <= 4
    assert m.chars <= 12_000
    recent = "0049" + "x" * 500
    assert m.split(recent + " c") == [recent, " c"]  # the latest texts still cut
    assert m.split("0000" + "x" * 500 + " c") == ["0000" + "x" * 500 + " c"]  # the oldest were forgotten


words = st.sampled_from(["alpha ", "beta ", "gamma\n", "delta, ", "x", "y"])
texts = st.lists(words, max_size=12).map("".join)


@given(st.lists(texts, max_size=8), texts, st.integers(1, 20))
def test_split_properties(seen, text, min_chars):
    m = PrefixMatcher(min_shared_chars=min_chars)
    for t in seen:
        m.add(t)
    pieces = m.split(text)
    assert "".join(pieces) == text
    assert all(pieces) or pieces == [""]
    # every proper cut is a prefix shared with some remembered text, at least min_chars long
    pos = 0
    for piece in pieces[:-1]:
        pos += len(piece)
        assert pos >= min_chars
        assert any(t.startswith(text[:pos]) for t in seen)
