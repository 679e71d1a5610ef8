"""Constrained decoding: llguidance masks on the engine's tokenizer, compile errors at submit, outputs that
match their constraint, "length" with partial text, fast-forward."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from parrot.engine.engine import LLMEngine
from parrot.engine.structured import ConstraintError, Grammars, fill_masks, mask_words
from parrot.errors import InvalidRequestError
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams
from tests.conftest import tiny_engine_config, tiny_model, tiny_tokenizer

TIMEOUT = 120


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)  # the shapes its tests meet
    yield eng
    eng.shutdown()


def _allowed(mask_row: np.ndarray, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(mask_row[t >> 5]) >> (t & 31)) & 1}


def test_masks_allow_only_what_the_grammar_allows() -> None:
    tok = tiny_tokenizer()
    grammars = Grammars(tok, 260)
    c = grammars.compile(SamplingParams(regex="[ab]cdef[gh]"))
    other = grammars.compile(SamplingParams(choice=["yes", "no"]))
    mask = np.full((3, mask_words(260)), -1, np.int32)
    fill_masks([(c, 0), (other, 2)], mask)
    ids = {ch: tok.encode(ch)[0] for ch in "abcnoy"}
    assert _allowed(mask[0], 260) == {ids["a"], ids["b"]}
    assert _allowed(mask[1], 260) == set(range(260))  # rows without a constraint are left alone
    assert _allowed(mask[2], 260) == {ids["y"], ids["n"]}
    c.consume(ids["b"])
    assert tok.decode(c.forced()) == "cdef"  # forced by the grammar: fast-forward material
    assert grammars.masked_steps == 1 and grammars.mask_stats()["mask_ms_mean"] is not None


def test_a_state_after_tokens_is_a_copy_that_moves_alone() -> None:
    """`after` (a speculative verify row's grammar state) is the state consuming the tokens gives, in a copy: the
    constraint itself, its masks and forced tokens stay; `takes` counts the tokens the grammar takes, in order."""
    tok = tiny_tokenizer()
    grammars = Grammars(tok, 260)
    params = SamplingParams(regex="[ab]cdef[gh]")
    c = grammars.compile(params)
    ids = {ch: tok.encode(ch)[0] for ch in "abcdefgz"}
    assert c.takes([ids["a"], ids["c"], ids["z"], ids["d"]]) == 2 and c.takes([]) == 0
    assert c.after([]) is c
    ahead = c.after([ids["b"]])
    fresh = grammars.compile(params)
    fresh.consume(ids["b"])
    assert ahead.state_key == fresh.state_key and tok.decode(ahead.forced()) == "cdef"
    mask = np.full((3, mask_words(260)), -1, np.int32)
    fill_masks([(c, 0), (ahead, 1), (fresh, 2)], mask)
    assert _allowed(mask[0], 260) == {ids["a"], ids["b"]}  # the original did not move
    assert _allowed(mask[1], 260) == _allowed(mask[2], 260) == {ids["c"]}
    assert c.consumed == [] and c.forced() == []
    with pytest.raises(ConstraintError):
        c.after([ids["a"], ids["z"]])


def test_rows_in_one_state_share_a_mask_and_others_get_their_own() -> None:
    """Constraints of one grammar that consumed the same tokens are in one state: one mask is computed
    and copied; the same grammar after other tokens, or another grammar, gets its own."""
    tok = tiny_tokenizer()
    grammars = Grammars(tok, 260)
    params = SamplingParams(regex="(ab|ac)[xy]z")
    a = tok.encode("a")[0]
    cs = [grammars.compile(params) for _ in range(4)]
    for c in cs[:3]:
        c.consume(a)
    other = grammars.compile(SamplingParams(regex="(ba|bc)q"))
    other.consume(tok.encode("b")[0])
    assert cs[0].state_key == cs[1].state_key != cs[3].state_key
    mask = np.zeros((5, mask_words(260)), np.int32)
    fill_masks([(cs[0], 0), (cs[1], 1), (cs[2], 2), (cs[3], 3), (other, 4)], mask)
    ids = {ch: tok.encode(ch)[0] for ch in "abc"}
    assert _allowed(mask[0], 260) == _allowed(mask[1], 260) == _allowed(mask[2], 260) == {ids["b"], ids["c"]}
    assert _allowed(mask[3], 260) == {ids["a"]}  # nothing consumed yet
    assert _allowed(mask[4], 260) == {ids["a"], ids["c"]}
    for row, c in enumerate(cs):  # each as computed alone
        alone = np.zeros((1, mask_words(260)), np.int32)
        fill_masks([(c, 0)], alone)
        np.testing.assert_array_equal(alone[0], mask[row])


@pytest.mark.parametrize("sampling, message", [
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"grammar": "start: missing_rule"}, "unknown name"),
    ({"json_schema": {"type": "no-such-type"}}, "Invalid type"),
    ({"json_schema": {"type": "string", "format": "no-such-format"}}, "Unknown format"),
    # no output satisfies these: said in a line, not the matcher's state dump
    ({"regex": "[^\\x00-\\x{10FFFF}]"}, "no output satisfies it"), ({"json_schema": {"$ref": "#"}}, "no output"),
    ({"grammar": "start: start"}, "no output satisfies it"),
])
def test_invalid_constraints_fail_at_submit(engine: LLMEngine, sampling: dict, message: str) -> None:
    """The matcher's message, raised by the submit itself: the context does not even exist, so no engine
    work ran (that would have failed with not_found)."""
    req = GenerateRequest(context_id="never-created", sampling=SamplingParams(**sampling))
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.generate_future(req)
    assert "<state>" not in str(info.value) and engine.alive


def test_compiling_has_a_time_limit() -> None:
    grammars = Grammars(tiny_tokenizer(), 260, timeout_s=1e-6)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,9}"} for i in range(50)}}
    with pytest.raises(InvalidRequestError, match="took longer than"):
        grammars.compile(SamplingParams(json_schema=schema))


def _generate(eng: LLMEngine, ctx: str, **sampling):
    eng.fill_future(FillRequest(context_id=ctx, token_ids=list(b"Answer: "))).result(TIMEOUT)
    try:
        return eng.generate_future(GenerateRequest(context_id=ctx, sampling=SamplingParams(**sampling))).result(TIMEOUT)
    finally:
        eng.free_future(ctx).result(TIMEOUT)


def test_outputs_match_their_constraint(engine: LLMEngine) -> None:
    """A random-weight model writes nothing sensible on its own: the mask alone makes it match."""
    r = _generate(engine, "re", regex="[0-9]{3}-[a-z]{2}", max_tokens=20)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.text) and r.finish_reason == "stop"
    r = _generate(engine, "ch", choice=["alpha", "beta", "gamma"], max_tokens=20, temperature=1.0, seed=3)
    assert r.text in {"alpha", "beta", "gamma"} and r.finish_reason == "stop"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2]}},
              "required": ["ok", "n"], "additionalProperties": False}
    before = engine.ping().fast_forward_tokens
    r = _generate(engine, "js", json_schema=schema, max_tokens=40)
    value = json.loads(r.text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2)
    assert r.finish_reason == "stop"
    assert engine.ping().fast_forward_tokens - before >= len('"ok": ')  # the keys are forced, not sampled
    grammar = 'start: "call(" NAME ")"\nNAME: /[a-z]+/'
    r = _generate(engine, "lark", grammar=grammar, max_tokens=12)
    assert re.fullmatch(r"call\([a-z]*\)?", r.text)


def test_max_tokens_first_gives_length_and_the_partial_text(engine: LLMEngine) -> None:
    r = _generate(engine, "len", regex="[ab]{50}", max_tokens=5)
    assert r.finish_reason == "length" and re.fullmatch("[ab]{5}", r.text)
    r = _generate(engine, "ff", regex="x{50}", max_tokens=7)  # all forced: fast-forward stops at max_tokens too
    assert r.finish_reason == "length" and r.text == "x" * 7 and len(r.token_ids) == 7


# ---- greedy rows sampled unmasked and checked after (CPUs) ---------------------------------------------
LAZY_CASES = [dict(regex="[0-9]{3}-[a-z]{2}"), dict(choice=["alpha", "beta", "gamma"]),
              dict(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"},
                                                                 "name": {"type": "string", "maxLength": 6}},
                                "required": ["ok", "name"], "additionalProperties": False}),
              dict(grammar='start: "call(" NAME ")"\nNAME: /[a-z]+/')]


def _set_lazy(eng: LLMEngine, lazy: bool) -> None:
    """Greedy constrained rows sampled unmasked and checked after (single steps: the runner's check; multi-step
    calls: the scheduler's as it applies them), or every mask computed before sampling."""
    eng.runner.lazy_masks = lazy
    eng.scheduler.lazy_constraints = lazy


def _eager_and_lazy(eng: LLMEngine, prompts: list[list[int]], cases: list[dict]) -> tuple[list, list, list]:
    """Each (prompt, constraint) greedily, all at once, with masks computed before sampling, then with greedy
    rows checked after: (eager outputs, lazy outputs, tokens taken without a mask in each mode)."""
    import concurrent.futures as cf

    def run(i: int, prompt: list[int], case: dict) -> list[int]:
        ctx = f"lazy-{i}-{eng.runner.lazy_masks}"
        eng.fill_future(FillRequest(context_id=ctx, token_ids=prompt)).result(TIMEOUT)
        sp = SamplingParams(max_tokens=40, **case)
        try:
            return eng.generate_future(GenerateRequest(context_id=ctx, sampling=sp)).result(TIMEOUT).token_ids
        finally:
            eng.free_future(ctx).result(TIMEOUT)

    jobs = [(p, c) for p in prompts for c in cases]
    outs, unmasked = [], []
    for lazy in (False, True):
        _set_lazy(eng, lazy)
        before = eng.ping().unmasked_tokens
        with cf.ThreadPoolExecutor(len(jobs)) as ex:
            outs.append(list(ex.map(lambda a: run(a[0], *a[1]), enumerate(jobs))))
        unmasked.append(eng.ping().unmasked_tokens - before)
    _set_lazy(eng, eng.runner._masks_first)
    return outs[0], outs[1], unmasked


def test_greedy_rows_checked_after_sampling_equal_masked_sampling(engine: LLMEngine) -> None:
    """A random model's argmax almost never fits the grammar: nearly every row falls back to its mask, and
    the outputs are the masked argmaxes, token for token, in batches of eight."""
    if not engine.runner._masks_first:
        pytest.skip("greedy rows are checked after sampling on CPUs only")
    eager, lazy, unmasked = _eager_and_lazy(engine, [list(b"Answer: "), list(b"Q: 1+1? A: ")], LAZY_CASES)
    assert lazy == eager
    assert all(len(t) > 2 for t in eager)
    print(f"tiny model: {unmasked[1]} of {sum(map(len, lazy))} tokens unmasked")
    assert unmasked[0] == 0 and unmasked[1] < sum(map(len, lazy)) // 2


def test_real_model_greedy_json_is_the_same_checked_or_masked(smollm_engine: LLMEngine) -> None:
    """The default model mostly writes what its schema allows: its argmax stands without a mask, and the
    outputs equal the masked ones."""
    eng = smollm_engine
    if not eng.runner._masks_first:
        pytest.skip("greedy rows are checked after sampling on CPUs only")
    tok = eng.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in (
        "Describe a baker in Vienna as JSON with the keys ok and name.", "Give me a product code.")]
    eager, lazy, unmasked = _eager_and_lazy(eng, prompts, LAZY_CASES)
    assert lazy == eager
    print(f"default model: {unmasked[1]} of {sum(map(len, lazy))} tokens unmasked")
    assert unmasked[1] > 0


SUMMARY = {"type": "object", "properties": {"title": {"type": "string"}, "summary": {"type": "string"}},
           "required": ["title", "summary"]}
DOC = ("Parrot serves LLM applications rather than single requests. Its prompts are templates whose placeholders "
       "are bound to semantic variables, so the server sees which calls feed which. The serve layer builds the "
       "graph between requests, decides which calls are latency-critical, groups related tasks and shares prompt "
       "prefixes between them. The engine runs the calls with continuous batching, a paged KV cache and compiled "
       "steps, and its native CPU kernels multiply the quantized weights as the file stores them.")


def _answers(eng: LLMEngine, prompt: list[int], n: int, tag: str) -> list[list[int]]:
    """`n` greedy JSON answers to one prompt, generated at once."""
    import concurrent.futures as cf

    sp = SamplingParams(max_tokens=160, json_schema=SUMMARY)
    for i in range(n):
        eng.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=prompt)).result(TIMEOUT)
    try:
        with cf.ThreadPoolExecutor(n) as ex:
            return list(ex.map(lambda i: eng.generate_future(GenerateRequest(
                context_id=f"{tag}{i}", sampling=sp)).result(TIMEOUT).token_ids, range(n)))
    finally:
        for i in range(n):
            eng.free_future(f"{tag}{i}").result(TIMEOUT)


def test_default_model_json_strings_decode_in_multi_step_calls_with_the_same_tokens(
        smollm_default_engine: LLMEngine) -> None:
    """A long string in a schema: greedy constrained jobs take multi-step calls, checked as applied, and give the
    tokens of single masked steps, alone and four at once (tokens a grammar forces go as decode rows of their own
    whatever decodes beside them: fed in a chunk in some steps and as rows in others, their bits, and then a near
    tie, would depend on the batch)."""
    eng = smollm_default_engine
    if not eng.runner.lazy_masks or eng.runner.multi_step == 1:
        pytest.skip("greedy rows are checked after sampling on CPUs only, in multi-step calls where there are any")
    tok = eng.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content":
                                                  f"Summarize this text in three sentences, as JSON:\n\n{DOC}"}]))
    outs = {}
    for lazy in (False, True):
        _set_lazy(eng, lazy)
        before = eng.scheduler.unchecked_tokens
        outs[lazy] = [_answers(eng, prompt, 1, f"one{lazy}")[0], *_answers(eng, prompt, 4, f"four{lazy}")]
        taken = eng.scheduler.unchecked_tokens - before
        assert (taken > 40) == lazy, taken
    _set_lazy(eng, eng.runner._masks_first)
    first = outs[False][0]
    assert re.match(r'\{\s*"title"\s*:\s*"[^"]+"\s*,\s*"summary"\s*:\s*"[^"]{40}', tok.decode(first))
    assert all(o == first for o in outs[False] + outs[True])


# ---- the masked argmax without the mask (structured.next_allowed) --------------------------------------
def _left_to_the_mask(c, tok_id: int, stops: frozenset[int]) -> bool:  # noqa: ANN001
    """The tokens `accepts` may refuse although the mask holds them: stop tokens (next_allowed decides them by
    whether the grammar is accepting) and those it leaves to the mask."""
    b = c.grammars.ll_tokenizer.decode_bytes([tok_id])
    forced = bytes(c.matcher.compute_ff_bytes())
    return tok_id in stops or not b or (bool(forced) and forced.startswith(b))


def _stops_follow_accepting(c, allowed: set[int], stops: frozenset[int]) -> bool:  # noqa: ANN001
    """The rule next_allowed takes for stop tokens: in the mask exactly when the grammar is accepting."""
    return all((s in allowed) == c.matcher.is_accepting() for s in stops)


def _forced_bytes_follow_the_rules(c, allowed: set[int], token_bytes: list[bytes]) -> bool:  # noqa: ANN001
    """The rules next_allowed takes where the grammar forces bytes: with forced tokens the mask is the first
    of them alone; without, every token whose bytes stop inside the forced bytes is in the mask."""
    forced = bytes(c.matcher.compute_ff_bytes())
    if not forced:
        return True
    ff = list(c.matcher.compute_ff_tokens())
    if ff and c.forces_tokens:
        return allowed == {ff[0]}
    return all(t in allowed for t, b in enumerate(token_bytes) if b and len(b) < len(forced) and forced.startswith(b))


def _masked_argmax_found(c, allowed: set[int], stops: frozenset[int], rng, vocab: int) -> tuple[int, int]:  # noqa: ANN001
    """next_allowed on random rows whose top candidates are refused tokens, held tokens and stop tokens:
    (rows it answered, rows) after checking each answer against the argmax over the mask."""
    from parrot.engine.structured import next_allowed

    held = np.array(sorted(allowed))
    answered = 0
    for _ in range(10):
        row = rng.standard_normal(vocab).astype(np.float32)
        row[rng.choice(held, size=min(2, len(held)), replace=False)] += rng.uniform(0, 3)
        row[rng.integers(0, vocab, 3)] = row.max()  # ties at the top
        if rng.random() < 0.3:
            row[rng.choice(sorted(stops))] = row.max() + 1
        got = next_allowed(c, row, stops)
        if got is not None:
            answered += 1
            assert got == int(np.argmax(np.where(np.isin(np.arange(vocab), held), row, -np.inf)))
    return answered, 10


def _states(grammars: Grammars, params: SamplingParams, text: str, tok) -> list:  # noqa: ANN001
    """The constraint after each prefix of `text`'s tokens (copies, so each keeps its state)."""
    import copy

    c = grammars.compile(params)
    out = []
    for t in tok.encode(text):
        out.append(copy.copy(c))
        out[-1].matcher = c.matcher.deep_copy()
        out[-1].consumed = list(c.consumed)
        c.consume(t)
    out.append(c)
    return out


@pytest.mark.parametrize("params, text", [
    (SamplingParams(regex="[0-9]{3}-[a-z]{2}"), "123-ab"),
    (SamplingParams(choice=["alpha", "beta", "gamma"]), "beta"),
    (SamplingParams(json_schema={"type": "object", "properties": {"ok": {"type": "boolean"},
                                 "name": {"type": "string", "maxLength": 6}}, "required": ["ok", "name"],
                                 "additionalProperties": False}), '{"ok": true, "name": "abc"}'),
    # accepting states that may still go on (a stop token is in the mask there, and so is more text)
    (SamplingParams(regex="[0-9]+"), "12345"),
    (SamplingParams(choice=["alpha", "alphabet"]), "alphabet"),
    (SamplingParams(json_schema={"type": "array", "items": {"type": "integer"}}), "[1, 22, 333]"),
    # forced bytes that the grammar asks not to force as tokens: the mask holds every consistent token
    (SamplingParams(grammar='%llguidance {"no_forcing": true}\nstart: "Hello, " NAME\nNAME: /[A-Z][a-z]+/'),
     "Hello, Ann"),
])
def test_accepts_is_the_mask_but_for_the_tokens_it_leaves_to_it(params: SamplingParams, text: str) -> None:
    """In every state of a few constraints, over the whole vocabulary: `accepts` admits no token the mask
    refuses, and refuses no token the mask holds other than the ones next_allowed leaves to the mask."""
    tok = tiny_tokenizer()
    grammars = Grammars(tok, 260)
    stops = tok.stop_token_ids
    token_bytes = [grammars.ll_tokenizer.decode_bytes([t]) for t in range(260)]
    rng = np.random.default_rng(0)
    answered = total = 0
    for c in _states(grammars, params, text, tok):
        mask = np.zeros((1, mask_words(260)), np.int32)
        fill_masks([(c, 0)], mask, record=False)
        allowed = _allowed(mask[0], 260)
        accepted = {t for t in range(260) if c.accepts(t)}
        assert accepted <= allowed
        assert all(_left_to_the_mask(c, t, stops) for t in allowed - accepted)
        assert _stops_follow_accepting(c, allowed, stops)
        assert _forced_bytes_follow_the_rules(c, allowed, token_bytes)
        a, n = _masked_argmax_found(c, allowed, stops, rng, 260)
        answered, total = answered + a, total + n
    assert answered >= total // 2


def test_next_allowed_is_the_masked_argmax() -> None:
    """Logits where some allowed tokens rank high: whenever next_allowed answers, its token is the argmax
    over the mask's tokens (ties included), and it answers in most rows."""
    from parrot.engine.structured import next_allowed

    tok = tiny_tokenizer()
    grammars = Grammars(tok, 260)
    rng = np.random.default_rng(0)
    answered = total = took_stop = 0
    stops = sorted(tok.stop_token_ids)
    for params, text in [(SamplingParams(regex="[0-9]{3}-[a-z]{2}"), "123-ab"),
                         (SamplingParams(choice=["alpha", "beta", "gamma"]), "gam"),
                         (SamplingParams(regex="[0-9]+"), "1234"),
                         (SamplingParams(choice=["alpha", "alphabet"]), "alphabe")]:
        for c in _states(grammars, params, text, tok)[:-1]:
            mask = np.zeros((1, mask_words(260)), np.int32)
            fill_masks([(c, 0)], mask, record=False)
            allowed = np.array(sorted(_allowed(mask[0], 260)))
            for _ in range(20):
                row = rng.standard_normal(260).astype(np.float32)
                row[rng.choice(allowed, size=min(2, len(allowed)), replace=False)] += rng.uniform(0, 3)
                row[rng.integers(0, 260, 3)] = row.max()  # ties at the top
                if rng.random() < 0.5:  # a stop token first: taken where the grammar is accepting, else passed
                    row[rng.choice(stops)] = row.max() + 1
                want = int(np.argmax(np.where(np.isin(np.arange(260), allowed), row, -np.inf)))
                got = next_allowed(c, row, tok.stop_token_ids)
                total += 1
                if got is not None:
                    answered += 1
                    took_stop += got in stops
                    assert got == want
    assert answered > total // 2
    assert took_stop > 0  # stop tokens decided without a mask where the grammar is accepting


def test_accepts_is_the_mask_on_the_default_models_tokens(smollm) -> None:  # noqa: ANN001
    """The same over SmolLM2's 49,152 tokens (multi-byte tokens, the key separator forced after a key),
    every third state of a JSON object."""
    tok, vocab = smollm.tokenizer, smollm.config.vocab_size
    grammars = Grammars(tok, vocab)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    states = _states(grammars, SamplingParams(json_schema=schema), '{"name": "Ann Lee", "age": 41}', tok)
    token_bytes = [grammars.ll_tokenizer.decode_bytes([t]) for t in range(vocab)]
    rng = np.random.default_rng(0)
    answered = total = 0
    for c in states[::3] + states[-1:]:
        mask = np.zeros((1, mask_words(vocab)), np.int32)
        fill_masks([(c, 0)], mask, record=False)
        allowed = set(np.nonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab])[0].tolist())
        accepted = {t for t in range(vocab) if c.accepts(t)}
        assert accepted <= allowed
        assert all(_left_to_the_mask(c, t, tok.stop_token_ids) for t in allowed - accepted)
        assert _stops_follow_accepting(c, allowed, tok.stop_token_ids)
        assert _forced_bytes_follow_the_rules(c, allowed, token_bytes)
        a, n = _masked_argmax_found(c, allowed, tok.stop_token_ids, rng, vocab)
        answered, total = answered + a, total + n
    assert answered >= total // 2


def test_next_allowed_follows_a_grammar_without_forcing(smollm) -> None:  # noqa: ANN001
    """`no_forcing`: the mask holds every token consistent with the forced bytes ('H', 'He', 'Hel', 'Hello'
    before a forced "Hello, "), not the first forced token alone; next_allowed gives the argmax over it."""
    from parrot.engine.structured import next_allowed

    tok, vocab = smollm.tokenizer, smollm.config.vocab_size
    grammars = Grammars(tok, vocab)
    rule = 'start: "Hello, " NAME\nNAME: /[A-Z][a-z]+/'
    for grammar, forcing in ((rule, True), ('%llguidance {"no_forcing": true}\n' + rule, False)):
        c = grammars.compile(SamplingParams(grammar=grammar))
        assert c.forces_tokens is forcing
        mask = np.zeros((1, mask_words(vocab)), np.int32)
        fill_masks([(c, 0)], mask, record=False)
        allowed = _allowed(mask[0], vocab)
        assert (len(allowed) == 1) is forcing
        h = tok.encode("H")[0]
        row = np.zeros(vocab, np.float32)
        row[h] = 5.0  # the top logit on a token that stops inside the forced bytes
        want = int(np.argmax(np.where(np.isin(np.arange(vocab), sorted(allowed)), row, -np.inf)))
        assert next_allowed(c, row, tok.stop_token_ids) == want
        assert (want == h) is not forcing
