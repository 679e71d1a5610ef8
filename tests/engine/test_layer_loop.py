"""The decoder layers as one loop (models/layer_loop.py): the kernels that pick one layer's operands give
the bits of the plain kernels on that layer's arrays, and an engine whose multi-step loops run the layers
as a loop decodes the tokens of one whose loops unroll them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import kernels, quant
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.engine.models.layer_loop import LayerLoop
from parrot.engine.models.llama import Llama, rope_cos_sin
from tests.conftest import TINY, tiny_engine_config, tiny_model, tiny_tokenizer
from tests.engine.test_engine import gen_many

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are not available here")

LAYERS = 3


def _bits(a: jax.Array) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_qmatmul_pick_is_qmatmul_on_the_picked_layer(qtype: str, rows: int) -> None:
    rng = np.random.default_rng(rows)
    mats = [quant.quantize((rng.standard_normal((96, 64)) * 0.05).astype(np.float32), qtype) for _ in range(LAYERS)]
    ws = [jnp.asarray(m.data) for m in mats]
    tiled = [None if quant.tiled(m) is None else jnp.asarray(quant.tiled(m)) for m in mats]
    x = jnp.asarray(rng.standard_normal((rows, 96)).astype(np.float32))
    fill = jnp.asarray(np.where(np.arange(rows) < rows - 1, 0, -1).astype(np.int32))  # a padding row last
    pick = jax.jit(lambda x, i, ws, tiled: kernels.qmatmul_pick(x, i, ws, tiled, qtype, fill, 2))
    for i in range(LAYERS):
        want = kernels.qmatmul(x, ws[i], qtype, fill, 2, tiled[i])
        assert np.array_equal(_bits(pick(x, jnp.int32(i), ws, tiled)), _bits(want))


def _caches(rng: np.random.Generator, dtype: np.dtype) -> list[jax.Array]:
    shape = (2, 6, 4, 16)  # [Hkv, pages, page_size, D]
    if dtype == np.uint16:  # bfloat16 bit patterns
        vals = rng.standard_normal(shape).astype(np.float32)
        return [jax.lax.bitcast_convert_type(jnp.asarray(vals).astype(jnp.bfloat16), jnp.uint16)
                for _ in range(LAYERS)]
    return [jnp.asarray(rng.standard_normal(shape).astype(np.float32)) for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_rope_kv_pick_is_rope_kv_on_the_picked_layer(dtype: np.dtype) -> None:
    rng = np.random.default_rng(1)
    ks, vs = _caches(rng, dtype), _caches(rng, dtype)  # Hkv 2, D 16
    slots = jnp.asarray([5, 17, 2, 23], jnp.int32)
    qkv = jnp.asarray(rng.standard_normal((4, (3 + 2 * 2) * 16)).astype(np.float32))
    cos, sin = rope_cos_sin(jnp.asarray([0, 7, 30, 31], jnp.int32), 16, 10000.0)
    pick = jax.jit(lambda i, ks, vs: kernels.rope_kv_pick(i, qkv, cos, sin, slots, ks, vs, 3))
    for i in range(LAYERS):
        q, got_k, got_v = pick(jnp.int32(i), list(ks), list(vs))
        want_q, want_k, want_v = kernels.rope_kv(qkv, cos, sin, slots, ks[i], vs[i], 3)
        assert np.array_equal(_bits(q), _bits(want_q))
        for j in range(LAYERS):
            assert np.array_equal(_bits(got_k[j]), _bits(want_k if j == i else ks[j]))
            assert np.array_equal(_bits(got_v[j]), _bits(want_v if j == i else vs[j]))


@pytest.mark.parametrize("bf16", [False, True])
def test_paged_decode_pick_is_paged_decode_on_the_picked_layer(bf16: bool) -> None:
    rng = np.random.default_rng(2)
    ks, vs = _caches(rng, np.uint16), _caches(rng, np.uint16)
    q = jnp.asarray(rng.standard_normal((3, 4, 16)).astype(np.float32))
    tables = jnp.asarray([[1, 2, 0], [3, 0, 0], [4, 5, 1]], jnp.int32)
    offset, lens = jnp.zeros(3, jnp.int32), jnp.asarray([7, 3, 12], jnp.int32)
    none, zero = jnp.zeros((0,), jnp.int32), jnp.zeros((), jnp.int32)
    inside = jnp.zeros(3, jnp.int32)
    pick = jax.jit(lambda i, ks, vs: kernels.paged_decode_pick(q, i, ks, vs, tables, offset, lens, none, zero,
                                                               inside, 0.25, bf16))
    for i in range(LAYERS):
        want = kernels.paged_decode(q, ks[i], vs[i], tables, offset, lens, none, zero, inside, 0.25, bf16)
        assert np.array_equal(_bits(pick(jnp.int32(i), ks, vs)), _bits(want))


def _quantized_tiny(qtype: str = "q4_1") -> LoadedModel:
    """The tests' tiny model with its projections block-quantized (as a GGUF file holds them)."""
    weights = tiny_model(seed=3).weights
    mats = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    quantized = {name: quant.quantize(w, qtype) if name.rsplit(".", 1)[-1] in mats else w
                 for name, w in weights.items()}
    return LoadedModel(TINY, quantized, tiny_tokenizer(), "tiny-random-quantized")


def test_a_layer_loop_is_taken_only_where_the_native_path_runs_every_layer() -> None:
    cache = jnp.dtype(jnp.uint16)
    loop = LayerLoop.of(Llama(TINY, _quantized_tiny().weights, jnp.float32), cache)
    assert loop is not None and loop.qtypes == ("q4_1",) * 4
    assert LayerLoop.of(Llama(TINY, tiny_model().weights, jnp.float32), cache) is None  # float matrices


@pytest.mark.parametrize(("dtype", "kv"), [("float32", {}), (None, {}),  # None: the engine's default mode
                                          (None, {"kv_dtype": "fp8"}), (None, {"kv_dtype": "bf16", "v_dtype": "fp8"})])
def test_multi_step_loops_over_the_layers_decode_the_unrolled_tokens(dtype: str | None, kv: dict) -> None:
    """The same tokens with the layers as a loop and unrolled, also over float8 caches (keys and values, or
    values only: the loop's kernels pick each layer's caches of either type)."""
    model = _quantized_tiny()
    runs = [dict(max_tokens=14, ignore_eos=True), dict(max_tokens=9, ignore_eos=True, temperature=0.8, seed=4),
            dict(max_tokens=21, ignore_eos=True), dict(max_tokens=6, ignore_eos=True)]
    results = []
    for layer_loop in (True, False):
        eng = LLMEngine(model, tiny_engine_config(dtype=dtype, multi_step=4, layer_loop=layer_loop, **kv)).start(
            precompile=False)
        try:
            assert (eng.runner._layer_loop is not None) == layer_loop
            results.append([(r.token_ids, r.finish_reason) for r in gen_many(eng, "ll", runs)])
            assert eng.ping().multi_step_launches > 0
        finally:
            eng.shutdown()
    assert results[0] == results[1]
