"""The kernels as an AVX2-only CPU builds them (`-march=haswell`), run on this CPU beside its own build
(`kernels.other_build`): the code only such a build compiles (float32 attention on 8 lanes, the AVX2
products) is tested wherever the suite runs, not only on AVX2-only machines, and its generated rows must
be the same bits as this CPU's own code gives them."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import kernels, quant
from tests.engine import test_kernels as tk

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native CPU kernels unavailable")

QTYPES = ["q8_0", "q4_0", "q4_1"]


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The library built for an AVX2-only CPU (at -O1: the same arithmetic, built faster)."""
    path = tmp_path_factory.mktemp("avx2-build") / "cpu_kernels.so"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "CXXFLAGS", tuple("-O1" if f == "-O3" else f for f in kernels.CXXFLAGS))
        return kernels.build_library(path, march="haswell")


def _products(qtype: str, rows: int, limbs: int, tiled: bool):  # noqa: ANN202
    q = quant.quantize((np.random.default_rng(3).standard_normal((576, 200)) * 0.05).astype(np.float32), qtype)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32))
    d, t = jnp.asarray(q.data), (jnp.asarray(quant.tiled(q)) if tiled else None)
    return lambda: np.asarray(jax.jit(lambda x, d, t: kernels.qmatmul(x, d, qtype, None, limbs, t))(x, d, t)), q, x


def test_calls_traced_inside_go_to_the_other_build(avx2_build) -> None:  # noqa: ANN001
    product, _, _ = _products("q4_1", 3, 2, True)
    own = product()
    with kernels.other_build(avx2_build) as lib:
        assert lib.parrot_matmul_select(-1) == 0  # this build's only code: AVX2
        routed = product()
        lib.parrot_avx2_int8_enable(0)  # its generated rows in float32 instead: only its own calls change
        try:
            float32 = product()
        finally:
            lib.parrot_avx2_int8_enable(1)
    np.testing.assert_array_equal(routed, own)
    assert not np.array_equal(float32, own)
    np.testing.assert_array_equal(product(), own)  # outside: this CPU's build again


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 4, 17, 40])
@pytest.mark.parametrize("tiled", [True, False])
def test_generated_rows_are_the_same_bits_as_this_cpus_build(avx2_build, qtype: str, rows: int,  # noqa: ANN001
                                                             tiled: bool) -> None:
    product, _, _ = _products(qtype, rows, 2, tiled)
    own = product()
    with kernels.other_build(avx2_build):
        np.testing.assert_array_equal(product(), own)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_prompt_rows_are_the_float_product(avx2_build, qtype: str, rows: int) -> None:  # noqa: ANN001
    product, q, x = _products(qtype, rows, 3, False)
    with kernels.other_build(avx2_build):
        got = product()
    ref = np.asarray(x, np.float64) @ q.dequantize().astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_greedy_rows_take_the_argmax(avx2_build) -> None:  # noqa: ANN001
    logits = np.random.default_rng(4).standard_normal((5, 1000)).astype(np.float32)
    zeros, ones = jnp.zeros(5, jnp.float32), jnp.ones(5, jnp.float32)
    with kernels.other_build(avx2_build):
        got = np.asarray(jax.jit(lambda x: kernels.sample(x, zeros, jnp.zeros(5, jnp.int32), ones, zeros,
                                                          zeros))(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, logits.argmax(axis=1))


# the attention tests of this CPU's build that hold for every build (the bfloat16 products' are AVX512-BF16's)
ATTENTION = {
    "decode, float32 cache": lambda: tk.test_decode_in_place_equals_gather_path("float32"),
    "decode, bfloat16 cache": lambda: tk.test_decode_in_place_equals_gather_path("bfloat16"),
    "decode, shared prefix": tk.test_decode_with_shared_prefix_equals_gather_path,
    "decode, prefix read once, float32": lambda: tk.test_shared_prefix_read_once_is_bit_identical_to_own_pages(
        "float32"),
    "decode, prefix read once, bfloat16": lambda: tk.test_shared_prefix_read_once_is_bit_identical_to_own_pages(
        "bfloat16"),
    "prefill, float32 cache": lambda: tk.test_prefill_in_place_equals_gather_path("float32"),
    "prefill, bfloat16 cache": lambda: tk.test_prefill_in_place_equals_gather_path("bfloat16"),
    "prefill, any chunk or batch": lambda: tk.test_prefill_gives_each_token_the_same_bits_in_any_chunk_or_batch(
        False, "bfloat16"),
    "decode, float8 cache": lambda: tk.test_decode_in_place_equals_gather_path("float8"),
    "prefill, float8 cache": lambda: tk.test_prefill_in_place_equals_gather_path("float8"),
    "prefill, float8, any chunk or batch": lambda: tk.test_prefill_gives_each_token_the_same_bits_in_any_chunk_or_batch(
        False, "float8"),
    "rope and KV writes, float8": lambda: tk.test_rope_kv_is_xlas_rope_and_kv_writes("float8", 70, 64),
    "float8 writes round as XLA converts": tk.test_fp8_writes_round_as_xla_converts,
    "prefill, any page size": lambda: tk.test_prefill_bits_do_not_depend_on_the_page_size(False),
    "prefill, head size 80": lambda: tk.test_prefill_in_float32_at_other_head_sizes(80),
    "rope and KV writes, bfloat16": lambda: tk.test_rope_kv_is_xlas_rope_and_kv_writes("bfloat16", 70, 64),
    "rope and KV writes, float32": lambda: tk.test_rope_kv_is_xlas_rope_and_kv_writes("float32", 5, 40),
}


@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention_holds_in_the_avx2_build(avx2_build, case: str) -> None:  # noqa: ANN001
    with kernels.other_build(avx2_build):
        ATTENTION[case]()


def test_the_other_build_is_loaded_once_and_routes_per_thread(avx2_build) -> None:  # noqa: ANN001
    import threading

    own = kernels.use_build(None)
    with kernels.other_build(avx2_build) as a, kernels.other_build(avx2_build) as b:
        assert a is b and isinstance(a, ctypes.CDLL) and a is not own
        seen = []
        other = threading.Thread(target=lambda: seen.append(kernels._routed_lib()))
        other.start(), other.join()
        assert seen == [own] and kernels._routed_lib() is a  # another thread: this process's build
    assert kernels._routed_lib() is own
