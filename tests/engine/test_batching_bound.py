"""Greedy tokens and batch composition in the default mode: identical on a CPU, within a stated bound on
accelerators.

On a CPU the default mode sums each row in one order whatever the batch (the native kernels), so greedy
tokens never change with the batch. On accelerators the default mode is bfloat16, whose products sum in an
order the batch decides (and small stable batches run multi-step loops, another XLA program), so a greedy
token may change with the batch. The bound tested there, and why it holds:
- the exact mode (float32, HIGHEST-precision products, one step a call) is batch-invariant on every backend
  (`test_engine.py`'s batching tests run in it: `batch_invariant_mode`);
- any default-mode program's log-probabilities lie within some d of the exact ones on the same tokens
  (measured below on this model, against the exact engine's scores of the same tokens: a prompt step's, and
  decode steps' (a generation asking for logprobs runs one step a call); asserted at most TAU / 2);
- so two default-mode runs, alone and in a batch, give a token log-probabilities at most 2d apart, and their
  greedy choices can differ only between two tokens whose exact log-probabilities lie within 2d <= TAU:
  where the model itself barely prefers one. Tested: at the first token where a sequence generated alone
  and the same sequence generated in a batch of 8 differ, the two tokens' exact log-probabilities lie within
  TAU of each other.
TAU comes from the same measurement on a CPU in bfloat16 (this model's fills: at most 0.008 nats from float32,
2026-11-28), doubled for the two runs and rounded up with room for an accelerator's other summation orders.
"""

from __future__ import annotations

import jax

from parrot.engine.engine import LLMEngine
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams, TokenLogprob
from tests.conftest import batch_invariant_mode, tiny_engine_config, tiny_model

TIMEOUT = 300
TAU = 0.05  # nats: a greedy token may change with the batch only between tokens this close (exact logprobs)
N, TOKENS = 8, 24


def _prompt(i: int) -> list[int]:
    return [(i * 53 + k * 7) % 250 + 3 for k in range(12 + i)]


def _generate(eng: LLMEngine, tag: str, indices: list[int], logprobs: int | None = None) -> list:
    """Greedy generations of the prompts `indices`, submitted together (one decode batch)."""
    for i in indices:
        eng.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=_prompt(i))).result(TIMEOUT)
    sp = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=logprobs)
    futs = [eng.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=sp)) for i in indices]
    out = [f.result(TIMEOUT) for f in futs]
    for i in indices:
        eng.free_future(f"{tag}{i}").result(TIMEOUT)
    return out


def _apart(ours: list[TokenLogprob], ref: list[TokenLogprob]) -> float:
    """The largest difference of two scorings' logprobs of the same tokens."""
    assert [t.token_id for t in ours] == [t.token_id for t in ref]
    return max(abs(a.logprob - b.logprob) for a, b in zip(ours, ref, strict=True) if a.logprob is not None)


def _scored(eng: LLMEngine, tag: str, tokens: list[int]) -> list[TokenLogprob]:
    """Each token's logprob given the ones before it, and the 5 most likely tokens there (a fill's prompt
    logprobs)."""
    r = eng.fill_future(FillRequest(context_id=tag, token_ids=tokens, logprobs=5)).result(TIMEOUT)
    eng.free_future(tag).result(TIMEOUT)
    assert r.logprobs is not None
    return r.logprobs


def _first_difference(alone: list[int], together: list[int], ref: list[TokenLogprob]) -> tuple | None:
    """Where a sequence's two greedy runs first chose apart: (token index, the exact logprobs of the token
    chosen alone and of the one chosen in the batch; None where not among the exact top 5), or None. `ref`:
    the exact engine's scores of the prompt and the tokens chosen alone."""
    j = next((j for j, (a, b) in enumerate(zip(alone, together, strict=True)) if a != b), None)
    if j is None:
        return None
    top = {t.token_id: t.logprob for t in ref[len(ref) - len(alone) + j].top}
    return j, top.get(alone[j]), top.get(together[j])


def _within(diff: tuple | None) -> bool:
    return diff is None or (diff[1] is not None and diff[2] is not None and abs(diff[1] - diff[2]) <= TAU)


def test_the_bound_reads_the_first_difference() -> None:
    """The check itself, on made-up scores (a CPU's runs never differ): the first token chosen apart is read
    at its own position; a choice between near-equal tokens is within the bound, a far one or one outside the
    top tokens is not."""
    def scored(tops: list[dict[int, float]]) -> list[TokenLogprob]:
        return [TokenLogprob(token_id=0, token="", bytes=[], logprob=None)] + [
            TokenLogprob(token_id=0, token="", bytes=[], logprob=-1.0,
                         top=[{"token_id": t, "token": "", "bytes": [], "logprob": lp} for t, lp in top.items()])
            for top in tops]

    ref = scored([{1: -1.0}, {5: -1.0, 6: -2.0}, {7: -1.0}, {8: -2.0, 9: -2.01}])  # a prompt token, 3 chosen
    assert _first_difference([5, 7, 8], [5, 7, 8], ref) is None
    assert _first_difference([5, 7, 8], [5, 7, 9], ref) == (2, -2.0, -2.01) and _within((2, -2.0, -2.01))
    assert _first_difference([5, 7, 8], [6, 7, 9], ref) == (0, -1.0, -2.0) and not _within((0, -1.0, -2.0))
    assert not _within(_first_difference([5, 7, 8], [5, 3, 8], ref))  # a token outside the top 5


def test_greedy_tokens_change_with_the_batch_only_within_the_bound() -> None:
    default = LLMEngine(tiny_model(), tiny_engine_config(dtype=None, kv_dtype="auto", multi_step=None))
    exact = LLMEngine(tiny_model(), tiny_engine_config(**batch_invariant_mode()))
    default.start(precompile=False)
    exact.start(precompile=False)
    try:
        alone = [_generate(default, "alone", [i])[0].token_ids for i in range(N)]
        together = [r.token_ids for r in _generate(default, "together", list(range(N)))]
        if jax.default_backend() == "cpu":
            assert together == alone  # the CPU's default mode is batch-invariant: no bound needed
        deviation, flips = 0.0, []
        for i in range(N):
            ref = _scored(exact, f"x{i}", _prompt(i) + alone[i])
            deviation = max(deviation, _apart(_scored(default, f"d{i}", _prompt(i) + alone[i]), ref))  # a prompt step
            decoded = _generate(default, "scored", [i], logprobs=5)[0]  # decode steps, one a call
            assert decoded.logprobs is not None
            ref_decoded = _scored(exact, f"y{i}", _prompt(i) + decoded.token_ids)[len(_prompt(i)):]
            deviation = max(deviation, _apart(decoded.logprobs, ref_decoded))
            diff = _first_difference(alone[i], together[i], ref)
            if diff is not None:
                flips.append((i, *diff))
        assert deviation <= TAU / 2, f"default-mode logprobs {deviation:.4f} nats from the exact ones"
        assert all(_within(f[1:]) for f in flips), (
            f"(sequence, token, exact logprob of the token chosen alone, of the one chosen in the batch): {flips}; "
            f"bound {TAU}, largest deviation measured {deviation:.4f}")
    finally:
        default.shutdown()
        exact.shutdown()
