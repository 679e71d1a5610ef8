"""IncrementalDetokenizer on the default model's tokenizer: streamed deltas, multi-byte characters and
stop strings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parrot.engine.loader import LoadedModel
from parrot.engine.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "Hello world, how are you today?",
    "def add(a, b):\n    return a + b  # 12345\n",
    "日本語のテキストと中文文本。",
    "emoji: 🦜🎉 family 👩‍👩‍👧 flag 🇫🇷 skin 👍🏽!",
    "Café naïve façade — «quotes» ẞ ǅ ﬁ",
    "mixed: 42°C, 3.14 × π ≈ 9.87, ₿ 0.001, 😀end",
    "  leading and trailing spaces\t\n\n",
]


@pytest.fixture(scope="module")
def tok(smollm: LoadedModel) -> Tokenizer:
    return smollm.tokenizer


def stream(tok: Tokenizer, ids: list[int], stop: list[str] | None = None):  # noqa: ANN201
    """Feed ids one by one until a stop; returns (deltas, tokens consumed, hit, detokenizer)."""
    detok = IncrementalDetokenizer(tok, stop or [])
    deltas = []
    for n, token in enumerate(ids, 1):
        delta, hit = detok.add(token)
        deltas.append(delta)
        if hit:
            return deltas, n, True, detok
    return deltas, len(ids), False, detok


# ---- streaming ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas, _, hit, detok = stream(tok, ids)
    assert not hit
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.text == text
    assert detok.ids == ids


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_never_split(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas, _, _, _ = stream(tok, ids)
    emitted = ""
    for delta in deltas:
        assert "\ufffd" not in delta
        emitted += delta
        assert text.startswith(emitted)  # every delta ends on a character boundary of the text


def test_emoji_bytes_are_held_back(tok: Tokenizer) -> None:
    """🦜 is 4 UTF-8 bytes spread over several byte-level tokens: nothing shows until the last one."""
    ids = tok.encode("🦜")
    assert len(ids) > 1  # (otherwise this test shows nothing)
    deltas, _, _, _ = stream(tok, ids)
    assert deltas == [""] * (len(ids) - 1) + ["🦜"]
    cjk = tok.encode("語")
    assert len(cjk) > 1
    assert stream(tok, cjk)[0] == [""] * (len(cjk) - 1) + ["語"]


def test_special_tokens_give_no_text(tok: Tokenizer) -> None:
    text = "<|im_start|>assistant\nParis.<|im_end|>\n"
    ids = tok.encode(text)
    deltas, _, hit, detok = stream(tok, ids)
    assert not hit
    assert "".join(deltas) == detok.text == "assistant\nParis.\n" == tok.decode(ids)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.text(st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)), max_size=40))
def test_deltas_property(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # SmolLM2's vocabulary lacks some byte tokens (0x04, 0x1d, 0xf1, ...): such text does not round-trip
    assume(tok.decode(ids) == text)
    deltas, _, hit, detok = stream(tok, ids)
    assert not hit
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 49151), max_size=30))
def test_arbitrary_ids_never_emit_more_than_decode(tok: Tokenizer, ids: list[int]) -> None:
    """Whatever ids the model produces (invalid UTF-8 included), the deltas form the decoded text, minus at most
    a trailing incomplete character, which the end of the generation (`flush`) adds as the decode has it."""
    deltas, _, _, detok = stream(tok, ids)
    full = tok.decode(ids)
    assert "".join(deltas) == detok.text
    assert full.startswith(detok.text)
    if not full.endswith("\ufffd"):
        assert detok.text == full
    tail = detok.flush()
    assert "".join(deltas) + tail == detok.text == full


def test_a_generated_replacement_character_ends_the_text(tok: Tokenizer) -> None:
    """U+FFFD is also a character of its own (a constraint's choice may end with it): held back while it may be
    the start of a multi-byte character, it is text once the generation ends."""
    for text in ("A\ufffd", "\ufffd", "x\ufffd\ufffd"):
        ids = tok.encode(text)
        deltas, _, hit, detok = stream(tok, ids)
        assert not hit and "".join(deltas) + detok.flush() == detok.text == text


# ---- stop strings -------------------------------------------------------------------------------
def _check_stop(tok: Tokenizer, text: str, stop: str) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text)
    deltas, consumed, hit, detok = stream(tok, ids, [stop])
    cut = text.find(stop)
    assert cut != -1 and hit
    assert detok.text == text[:cut]
    # stops on the first token after which the decoded text contains the whole stop string
    assert stop in tok.decode(ids[:consumed]) and stop not in tok.decode(ids[: consumed - 1])
    return deltas, detok


def test_stop_inside_one_token(tok: Tokenizer) -> None:
    text = "Hello world, STOP here"
    assert " world" in [tok.decode([i]) for i in tok.encode(text)]
    deltas, detok = _check_stop(tok, text, "world")
    assert detok.text == "Hello "
    assert "".join(deltas) == "Hello "


def test_stop_straddling_token_boundaries_is_found(tok: Tokenizer) -> None:
    text = "Hello world, STOP here"
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert pieces[1:4] == [" world", ",", " ST"]  # "d, ST" spans three tokens
    _, detok = _check_stop(tok, text, "d, ST")
    assert detok.text == "Hello worl"


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 12345 and more", "234"),  # digits are single tokens
        ("日本語のテキスト", "本語"),  # multi-byte characters on both sides
        ("party 🦜🎉 time", "🎉 t"),  # emoji made of byte tokens
        ("Question: what?\nAnswer: yes", "\nAnswer:"),
        ("stop at the very start", "stop"),
        ("ends with the stop", "the stop"),
        ("aaaaab", "aab"),  # overlapping partial matches
    ],
)
def test_stop_strings_cut_text(tok: Tokenizer, text: str, stop: str) -> None:
    _check_stop(tok, text, stop)


def test_absent_stop_string(tok: Tokenizer) -> None:
    text = "nothing to see here"
    deltas, _, hit, detok = stream(tok, tok.encode(text), ["STOP", "xyz"])
    assert not hit
    assert detok.text == "".join(deltas) == text


@settings(max_examples=80, deadline=None)
@given(st.text("ab c.\n", min_size=1, max_size=30), st.text("ab c.\n", min_size=1, max_size=4))
def test_stop_property(tok: Tokenizer, text: str, stop: str) -> None:
    ids = tok.encode(text)
    _, consumed, hit, detok = stream(tok, ids, [stop])
    cut = text.find(stop)
    assert hit == (cut != -1)
    assert detok.text == (text if cut == -1 else text[:cut])
    if hit:
        assert stop in tok.decode(ids[:consumed]) and stop not in tok.decode(ids[: consumed - 1])


def test_streamed_deltas_exclude_straddling_stop(tok: Tokenizer) -> None:
    deltas, _, hit, detok = stream(tok, tok.encode("Hello world, STOP here"), ["d, ST"])
    assert hit and detok.text == "Hello worl"
    assert "".join(deltas) == detok.text


def test_earliest_of_several_stops_wins(tok: Tokenizer) -> None:
    text = "the theater"
    assert tok.decode(tok.encode(text)[:1]) == "the"
    _, _, hit, detok = stream(tok, tok.encode(text), ["e", "t"])
    assert hit
    assert detok.text == ""  # "t" is at 0; the bug cuts at "e" and leaves "th"


def _held_and_hit(text: str, stop: str) -> tuple[int, int | None]:
    """What StopMatcher computes, by brute force: the longest proper prefix of `stop` ending `text`, and the
    end of its first occurrence."""
    at = text.find(stop)
    held = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return held, None if at == -1 else at + len(stop)


@given(st.text(alphabet="ab", max_size=40), st.text(alphabet="ab", min_size=1, max_size=8),
       st.lists(st.integers(1, 6), max_size=20))
def test_stop_matcher_equals_brute_force_fed_in_any_pieces(text: str, stop: str, cuts: list[int]) -> None:
    m, fed, pos = StopMatcher(stop), "", 0
    for n in [*cuts, len(text)]:
        piece, pos = text[pos : pos + n], pos + n
        end = m.feed(piece)
        held, hit = _held_and_hit(fed + piece, stop)
        if end is not None:  # the first whole occurrence, in this piece
            assert hit == len(fed) + end and _held_and_hit(fed + piece[: end - 1], stop)[1] is None
            return
        assert hit is None and m.matched == held
        fed += piece


@given(st.text(alphabet="ab", max_size=40), st.text(alphabet="ab", min_size=1, max_size=8),
       st.lists(st.integers(1, 6), max_size=20), st.integers(0, 8))
def test_occurrences_that_do_not_count_are_read_past(text: str, stop: str, cuts: list[int], quiet: int) -> None:
    """Pieces fed with `report` False (a job's first min_tokens tokens): the first occurrence reported is the
    first that ends in a later piece, as brute force finds it."""
    m, fed, pos = StopMatcher(stop), "", 0
    pieces = []
    for n in [*cuts, len(text)]:
        pieces.append(text[pos : pos + n])
        pos += n
    for i, piece in enumerate(pieces):
        end = m.feed(piece, report=i >= quiet)
        later = [at + len(stop) for at in range(len(fed + piece)) if (fed + piece).startswith(stop, at)
                 and at + len(stop) > len(fed)]
        if i < quiet:
            assert end is None
        elif later:
            assert end == later[0] - len(fed)
            return
        else:
            assert end is None and m.matched == _held_and_hit(fed + piece, stop)[0]
        fed += piece


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    """As vLLM: a stop string counts only where it ends in a token after the first min_tokens."""
    ids = tok.encode("one, two, three, four")
    comma = [i for i, t in enumerate(ids) if "," in tok.decode([t])]
    detok = IncrementalDetokenizer(tok, [","], min_tokens=comma[0] + 1)
    hit = next(n for n, t in enumerate(ids) if detok.add(t)[1])
    assert hit == comma[1] and detok.text == "one, two"


def test_a_long_stop_string_costs_each_piece_its_own_length() -> None:
    """A 4,096-character stop string (the most a request may give) held back against a long text: the old
    way tested every prefix of it against the text every token."""
    stop = "ab" * 2047 + "ac"
    m = StopMatcher(stop)
    for _ in range(5000):
        assert m.feed("ab") is None
    assert m.matched == len(stop) - 2  # all but its last "ac" ends the text: held back
    assert m.feed("ac") == 2


@pytest.mark.parametrize(("stop", "include", "dropped"), [("world", True, 0), ("wor", True, 2), ("world", False, 5)])
def test_the_text_a_stop_string_leaves_out_is_counted(tok: Tokenizer, stop: str, include: bool, dropped: int) -> None:
    """`dropped`: what was decoded after the cut ("Hello" and " world" are a token each): nothing where a kept
    stop string ends where a token does, which a typed output needs to be whole (the grammar took those tokens)."""
    detok = IncrementalDetokenizer(tok, [stop], include_stop=include)
    assert tok.encode("Hello world", add_bos=False) == [tok.encode("Hello", add_bos=False)[0],
                                                        tok.encode(" world", add_bos=False)[0]]
    hits = [detok.add(t)[1] for t in tok.encode("Hello world", add_bos=False)]
    assert hits == [False, True] and detok.dropped == dropped


@pytest.mark.parametrize(("text", "stop"), [("Hello world, STOP here", "d, ST"), ("Hello world, STOP here", "world"),
                                            ("party 🦜🎉 time", "🎉 t"), ("aaaaab", "aab")])
def test_stop_string_kept_at_the_end_when_asked(tok: Tokenizer, text: str, stop: str) -> None:
    """vLLM's include_stop_str_in_output: the text is cut just after the stop string, and the deltas still
    make it up."""
    detok = IncrementalDetokenizer(tok, [stop], include_stop=True)
    deltas = []
    for token in tok.encode(text):
        delta, hit = detok.add(token)
        deltas.append(delta)
        if hit:
            break
    assert hit and detok.stop_hit == stop
    assert detok.text == text[:text.find(stop) + len(stop)] == "".join(deltas)
