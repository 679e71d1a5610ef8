"""The model runner's choice of how quantized products are asked for: generated rows on 2 limbs in the
default mode on every CPU (with bf16 products or without), exact in the float32 mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from parrot.engine import kernels, quant, runner
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.engine.runner import ModelRunner
from parrot.protocol import GenerateRequest, SamplingParams
from tests.conftest import TINY, tiny_engine_config, tiny_model, tiny_tokenizer
from tests.engine.test_engine import TIMEOUT, fill, prompt

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not kernels.available(),
                                reason="the native CPU kernels are not available")


def _quantized_tiny() -> LoadedModel:
    weights = tiny_model(seed=5).weights
    mats = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    quantized = {name: quant.quantize(w, "q4_1") if name.rsplit(".", 1)[-1] in mats else w
                 for name, w in weights.items()}
    return LoadedModel(TINY, quantized, tiny_tokenizer(), "tiny-random-quantized")


@pytest.mark.parametrize("bf16_units", [True, False])
def test_generated_rows_take_two_limbs_in_the_default_mode_on_every_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                         bf16_units: bool) -> None:
    """A CPU without bf16 products (AVX2-only, or AVX-512 without BF16) fills prompts in float32 as before,
    and asks for generated rows on 2 limbs as a CPU with them does; the float32 mode keeps 3."""
    monkeypatch.setattr(runner, "_cpu_has_bf16_matmul", lambda: bf16_units)
    model = _quantized_tiny()
    default = ModelRunner(model.config, model.weights, tiny_engine_config(dtype=None))
    assert default.prefill_dtype == (jnp.bfloat16 if bf16_units else jnp.float32)
    assert default.qdtype == jnp.bfloat16 and default.generated_row_limbs == 2
    exact = ModelRunner(model.config, model.weights, tiny_engine_config())  # dtype float32
    assert exact.qdtype == jnp.float32 and exact.generated_row_limbs == 3


def _decode(eng: LLMEngine, tag: str, which: list[int]) -> list[list[int]]:
    """Greedy tokens of prompts `which` (tests.engine.test_engine.prompt), decoded in one batch."""
    futs = []
    for i in which:
        fill(eng, f"{tag}{i}", prompt(i + 40, 12))
        sp = SamplingParams(max_tokens=12, ignore_eos=True)
        futs.append(eng.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=sp)))
    out = [f.result(TIMEOUT).token_ids for f in futs]
    for i in which:
        eng.free_future(f"{tag}{i}").result(TIMEOUT)
    return out


def test_the_avx2_code_decodes_a_sequence_the_same_alone_and_in_any_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default mode on a CPU without bf16 products, with the AVX2 code multiplying (an AVX2-only CPU's
    products): greedy tokens of sequences decoded alone and together are the same (its generated rows are
    integer sums, the same bits in a batch of any size), and where this CPU has the VNNI code, the same as
    with it (prompt rows exact on both)."""
    monkeypatch.setattr(runner, "_cpu_has_bf16_matmul", lambda: False)
    model = _quantized_tiny()
    before = kernels.matmul_path()
    results = {}
    try:
        for path in ["avx2"] + (["avx512-vnni"] if "avx512-vnni" in kernels.matmul_paths() else []):
            assert kernels.use_matmul(path) == path
            eng = LLMEngine(model, tiny_engine_config(dtype=None, multi_step=1)).start(precompile=False)
            try:
                assert eng.runner.generated_row_limbs == 2
                together = _decode(eng, "b", [0, 1, 2, 3])
                alone = [_decode(eng, "a", [i])[0] for i in range(4)]
            finally:
                eng.shutdown()
            assert together == alone
            assert all(len(t) == 12 for t in together) and len(set(map(tuple, together))) > 1
            results[path] = together
    finally:
        kernels.use_matmul(before)
    assert len({str(r) for r in results.values()}) == 1
