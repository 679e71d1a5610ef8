"""Block-quantized matrices: exact dequantization (against the gguf package's own), and the product with
activations through the native kernel and through XLA equal to the float32 product."""

from __future__ import annotations

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import kernels, quant
from parrot.engine.quant import QuantizedTensor

QTYPES = ["q8_0", "q4_0", "q4_1"]


def _random(k: int, n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(np.float32)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf(qtype: str) -> None:
    w = _random(96, 40)
    q = quant.quantize(w, qtype)
    assert q.data.dtype == np.uint8 and q.data.shape == (40, 3 * quant.BLOCK_BYTES[qtype])
    ref = gguf.quants.dequantize(q.data, gguf.GGMLQuantizationType[qtype.upper()]).T
    np.testing.assert_array_equal(q.dequantize(), ref)  # bit for bit
    rows = jnp.asarray([3, 0, 39])
    got = quant.dequantize_rows(jnp.asarray(q.data), rows, qtype, 96, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), ref.T[[3, 0, 39]])


def test_embedding_rows_are_the_matrix() -> None:
    table = _random(8, 64)  # [vocab, hidden]
    q = quant.quantize(table.T, "q8_0")  # rows = vocab
    emb = QuantizedTensor(q.qtype, q.data, (8, 64), rows_are_matrix=True)
    np.testing.assert_allclose(emb.dequantize(), table, atol=0.01)


def test_concat_rows_fuses_projections() -> None:
    a, b = quant.quantize(_random(64, 32), "q4_1"), quant.quantize(_random(64, 16, 1), "q4_1")
    fused = quant.concat_rows([a, b])
    assert fused.shape == (64, 48)
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([a.dequantize(), b.dequantize()], axis=1))
    with pytest.raises(ValueError):
        quant.concat_rows([a, quant.quantize(_random(64, 16), "q8_0")])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 12, 16, 65, 4097])  # one row; a few rows; the panel; 4097: XLA
@pytest.mark.parametrize("shape", [(96, 40), (64, 7)])  # output widths that are not multiples of the tiles
def test_linear_equals_float_product(qtype: str, rows: int, shape: tuple[int, int]) -> None:
    k, n = shape
    q = quant.quantize(_random(k, n), qtype)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, d: quant.linear(x, d, qtype))(x, jnp.asarray(q.data)))
    ref = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_and_xla_paths_agree(qtype: str) -> None:
    q = quant.quantize(_random(576, 120), qtype)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 576)).astype(np.float32))
    native = np.asarray(jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype))(x, jnp.asarray(q.data)))
    w = quant.dequantize(jnp.asarray(q.data), qtype, 576)
    xla = np.asarray(jnp.dot(x, w.T, precision="highest"))
    np.testing.assert_allclose(native, xla, rtol=1e-5, atol=2e-6)


@pytest.fixture(params=kernels.MATMUL_PATHS)
def native_path(request: pytest.FixtureRequest):  # noqa: ANN201
    """Each native product code this CPU has, switched on for the test."""
    if not kernels.available():
        pytest.skip("native CPU kernels unavailable")
    if request.param not in kernels.matmul_paths():
        pytest.skip(f"this CPU (or this build) cannot run {request.param}")
    before = kernels.matmul_path()
    assert kernels.use_matmul(request.param) == request.param
    yield request.param
    kernels.use_matmul(before)


def test_the_best_code_the_cpu_has_runs_by_default() -> None:
    if not kernels.available():
        pytest.skip("native CPU kernels unavailable")
    flags = open("/proc/cpuinfo").read()
    paths = kernels.matmul_paths()
    assert paths[0] == "avx2"
    if os.environ.get("PARROT_KERNEL_MARCH", "native") == "native":  # else a build for another CPU's flags
        assert ("avx512-vnni" in paths) == ("avx512_vnni" in flags and "avx512bw" in flags and "avx512vl" in flags)
    assert kernels.use_matmul("auto") == paths[-1]
    assert kernels.use_matmul("no such code") == paths[-1]  # unchanged


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 2, 9, 16, 17, 33, 70])  # VNNI: token groups of 16; AMX: tiles above 16
def test_native_paths_equal_float_product(native_path: str, qtype: str, rows: int) -> None:
    """Both native paths compute the float32 product with the exactly dequantized matrix (widths that are
    not multiples of 16, several chunks of blocks: K = 576 is 18 blocks)."""
    q = quant.quantize(_random(576, 200), qtype)
    x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype))(x, jnp.asarray(q.data)))
    ref = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_row_is_the_same_alone_and_in_any_batch(native_path: str, qtype: str) -> None:
    """A row's product is bit for bit the same whatever rows share the call: on the integer paths (VNNI,
    AMX) for any number of rows, on the AVX2 path up to 16 (above that its panel kernel sums in another
    order)."""
    q = quant.quantize(_random(576, 80), qtype)
    x = np.random.default_rng(7).standard_normal((70, 576)).astype(np.float32)
    f = jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype))
    d = jnp.asarray(q.data)
    alone = np.concatenate([np.asarray(f(x[i:i + 1], d)) for i in range(len(x))])
    sizes = [2, 3, 9, 16] + ([17, 33, 70] if native_path != "avx2" else [])
    for size in sizes:
        for start in range(0, len(x) - size + 1, size):
            np.testing.assert_array_equal(np.asarray(f(x[start:start + size], d)), alone[start:start + size])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 17])  # one token group; two (VNNI) or the tiles (AMX)
def test_native_paths_take_tiny_and_non_finite_activations(native_path: str, qtype: str, rows: int) -> None:
    """Activations far below float32's normal range count as zero (their products are below it too), and a
    NaN or an infinity in a row makes that row's products NaN, as in float32; other rows are unaffected."""
    q = quant.quantize(_random(96, 40), qtype)
    x = np.random.default_rng(3).standard_normal((rows, 96)).astype(np.float32)
    x[0, :32] = 1e-35  # a whole block of tiny values
    if rows > 1:
        x[1, 40] = np.nan
    got = np.asarray(jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype))(x, jnp.asarray(q.data)))
    ref = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    if rows > 1:
        assert np.isnan(got[1]).all()
        np.testing.assert_allclose(got[2:], ref[2:], rtol=1e-5, atol=1e-5)


BF16_FILLS = kernels.available() and kernels.bf16_fills() is not None
NO_BF16 = "this CPU (or this build) has neither AMX-BF16 nor AVX512-BF16"


@pytest.mark.skipif(not BF16_FILLS, reason=NO_BF16)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 4, 13, 17, 33, 70])
def test_bf16_fills_equal_the_bf16_product(qtype: str, rows: int) -> None:
    """A product asked for in bfloat16 (prompt fills; AMX's bf16 tiles or AVX512-BF16's pair products) is
    the product of the dequantized weights and the activations, both rounded to bfloat16, summed in float32
    (widths not multiples of 16 or 32)."""
    import ml_dtypes

    q = quant.quantize(_random(576, 200), qtype)
    x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
    fill = jnp.ones(rows, jnp.int32)
    got = np.asarray(jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype, fill))(x, jnp.asarray(q.data)))

    def bf(a: np.ndarray) -> np.ndarray:
        return a.astype(ml_dtypes.bfloat16).astype(np.float64)
    ref = bf(x) @ bf(q.dequantize())
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    exact = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    assert np.abs(got - exact).max() > 1e-4  # it did round to bfloat16 (the exact path is within 1e-5)


@pytest.mark.skipif(not BF16_FILLS, reason=NO_BF16)
@pytest.mark.parametrize("k", [96, 1536, 4096])
def test_bf16_fills_at_other_widths(k: int) -> None:
    """Widths of fewer blocks than one run of the tiles' product, of several runs (their accumulators set
    aside between runs) and of more dequantized weights than one call takes: still the bfloat16 product,
    and a row's result the same alone and in a batch."""
    import ml_dtypes

    q = quant.quantize(_random(k, 300), "q4_1")
    x = np.random.default_rng(k).standard_normal((45, k)).astype(np.float32)
    f = jax.jit(lambda x, d: kernels.qmatmul(x, d, "q4_1", jnp.ones(x.shape[0], jnp.int32)))
    d = jnp.asarray(q.data)
    got = np.asarray(f(x, d))

    def bf(a: np.ndarray) -> np.ndarray:
        return a.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(got, bf(x) @ bf(q.dequantize()), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(f(x[7:8], d)), got[7:8])
    np.testing.assert_array_equal(np.asarray(f(x[:33], d)), got[:33])


@pytest.mark.skipif(not BF16_FILLS, reason=NO_BF16)
def test_bf16_fills_give_a_row_the_same_result_in_any_batch() -> None:
    q = quant.quantize(_random(576, 80), "q4_1")
    x = np.random.default_rng(7).standard_normal((70, 576)).astype(np.float32)
    f = jax.jit(lambda x, d: kernels.qmatmul(x, d, "q4_1", jnp.ones(x.shape[0], jnp.int32)))
    d = jnp.asarray(q.data)
    alone = np.concatenate([np.asarray(f(x[i:i + 1], d)) for i in range(len(x))])
    for size in [2, 3, 9, 16, 17, 33, 70]:
        for start in range(0, len(x) - size + 1, size):
            np.testing.assert_array_equal(np.asarray(f(x[start:start + size], d)), alone[start:start + size])


@pytest.mark.skipif(not BF16_FILLS, reason=NO_BF16)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [576, 1536, 4096])
def test_bf16_fills_from_the_tiled_copy_give_the_same_bits(native_path: str, qtype: str, k: int) -> None:
    """Prompt rows in bfloat16 dequantize the weights from the matrix's tiled copy where it is given: the
    same bits as from the GGUF rows, on each bf16 code (AMX's tiles; AVX512-BF16 where its CPU has byte
    permutes), a last tile of 8 weight rows (N = 200), widths of one run of the tiles' product, of several,
    and of fewer panels a call than the output has; the fused silu(gate) * up too, its gate rows a multiple
    of 16 (the up rows' tiles start at a tile) or not (then from the GGUF rows)."""
    if kernels.bf16_fills() is None:
        pytest.skip(f"{native_path} multiplies prompt rows exactly")
    x = np.random.default_rng(k).standard_normal((45, k)).astype(np.float32)
    for n, swiglu in [(200, False), (2 * 96, True), (2 * 75, True)]:
        q = quant.quantize(_random(k, n, seed=n), qtype)
        tiled = quant.tiled(q)
        d, t = jnp.asarray(q.data), jnp.asarray(tiled)
        f = jax.jit(lambda x, d, t, s=swiglu: kernels.qmatmul(x, d, qtype, jnp.ones(x.shape[0], jnp.int32), 2, t, s))
        ref = np.asarray(f(x, d, None))
        np.testing.assert_array_equal(np.asarray(f(x, d, t)), ref)
        np.testing.assert_array_equal(np.asarray(f(x[:1], d, t)), ref[:1])


@pytest.mark.skipif(not BF16_FILLS, reason=NO_BF16)
def test_bf16_fills_switch_off_to_the_exact_path() -> None:
    q = quant.quantize(_random(96, 40), "q8_0")
    x = np.random.default_rng(5).standard_normal((20, 96)).astype(np.float32)
    d = jnp.asarray(q.data)
    exact = np.asarray(jax.jit(lambda x, d: kernels.qmatmul(x, d, "q8_0"))(x, d))
    try:
        assert kernels.use_bf16_fills(False) is None
        off = np.asarray(jax.jit(lambda x, d: kernels.qmatmul(x, d, "q8_0", jnp.ones(x.shape[0], jnp.int32)))(x, d))
    finally:
        kernels.use_bf16_fills(True)
    np.testing.assert_array_equal(off, exact)


@pytest.mark.skipif(not BF16_FILLS, reason=NO_BF16)
@pytest.mark.parametrize("rows", [2, 5, 40])
def test_each_kind_of_row_is_computed_apart(rows: int) -> None:
    """In a call with prompt rows and generated rows, each row is what a call of its kind alone gives."""
    q = quant.quantize(_random(576, 120), "q4_1")
    x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
    fill = (np.arange(rows) % 3 == 1).astype(np.int32)
    d = jnp.asarray(q.data)
    f = jax.jit(lambda x, d, fill: kernels.qmatmul(x, d, "q4_1", fill))
    mixed = np.asarray(f(x, d, fill))
    for i in range(rows):
        alone = np.asarray(f(x[i:i + 1], d, fill[i:i + 1]))
        np.testing.assert_array_equal(mixed[i], alone[0])
    exact = np.asarray(f(x, d, np.zeros(rows, np.int32)))
    np.testing.assert_array_equal(mixed[fill == 0], exact[fill == 0])


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_mixed_calls_generated_rows_equal_a_decode_calls(native_path: str, qtype: str) -> None:
    """The generated rows of a call that has prompt rows too (a mixed step) are bit for bit what a call of
    those rows alone (a decode step) gives, on every code: the AVX2 code, whose sums are the same row by row
    only up to 16 rows, multiplies the two kinds apart even where both are exact."""
    q = quant.quantize(_random(576, 80), qtype)
    x = np.random.default_rng(11).standard_normal((40, 576)).astype(np.float32)
    fill = (np.arange(40) % 3 != 0).astype(np.int32)  # 14 generated rows among 26 prompt rows
    d = jnp.asarray(q.data)
    f = jax.jit(lambda x, d, fill: kernels.qmatmul(x, d, qtype, fill))
    mixed = np.asarray(f(x, d, fill))
    gen = fill == 0
    np.testing.assert_array_equal(mixed[gen], np.asarray(f(x[gen], d, fill[gen])))


@pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels are not available")
@pytest.mark.parametrize("limbs", [2, 3])
@pytest.mark.parametrize("kinds", ["generated", "mixed"])
def test_trailing_padding_rows_are_skipped(limbs: int, kinds: str) -> None:
    """A step's padding rows (fill -1, after its tokens) give zeros, and the other rows are what the call
    without them gives: a batch pays for its tokens, not for its bucket."""
    q = quant.quantize(_random(576, 96), "q4_1")
    x = np.random.default_rng(limbs).standard_normal((16, 576)).astype(np.float32)
    fill = (np.arange(16) % 2 if kinds == "mixed" else np.zeros(16)).astype(np.int32)
    fill[9:] = -1
    d = jnp.asarray(q.data)
    f = jax.jit(lambda x, d, fill: kernels.qmatmul(x, d, "q4_1", fill, limbs))
    padded = np.asarray(f(x, d, fill))
    np.testing.assert_array_equal(padded[:9], np.asarray(f(x[:9], d, fill[:9])))
    np.testing.assert_array_equal(padded[9:], 0.0)
    assert not np.all(np.asarray(f(x, d, np.maximum(fill, 0)))[9:] == 0.0)  # unmarked, they are computed


@pytest.mark.parametrize("qtype", QTYPES)
def test_two_limbs_round_activations_to_15_bits_the_same_in_any_batch(native_path: str, qtype: str) -> None:
    """The bfloat16 mode's generated rows on the integer paths: activations to 15 bits below their block's
    largest (2 limbs), so within sum over blocks of max|x| / 2^15 * sum|w| of the float product, and a
    row's result the same alone and in any batch (VNNI in token groups of 16; AMX: VNNI up to 16 rows, the
    tiles above; the AVX2 code's integer sums, 8 weight rows at a time)."""
    q = quant.quantize(_random(576, 80), qtype)
    x = np.random.default_rng(11).standard_normal((70, 576)).astype(np.float32)
    d = jnp.asarray(q.data)
    f = jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype, None, 2))
    ref = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    got = np.asarray(f(x, d))
    w = np.abs(q.dequantize().astype(np.float64)).reshape(18, 32, 80).sum(axis=1)  # [blocks, N]
    bound = (np.abs(x).reshape(70, 18, 32).max(axis=2) / 2**15) @ w
    assert (np.abs(got - ref) <= bound + 1e-5 * np.abs(ref) + 1e-6).all()
    three = np.asarray(jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype))(x, d))
    assert not np.array_equal(got, three)
    alone = np.concatenate([np.asarray(f(x[i:i + 1], d)) for i in range(len(x))])
    for size in [3, 16, 17, 32, 70]:  # VNNI from 32 rows: tokens in lanes (16-bit products)
        for start in range(0, len(x) - size + 1, size):
            np.testing.assert_array_equal(np.asarray(f(x[start:start + size], d)), alone[start:start + size])


@pytest.mark.parametrize("qtype", QTYPES)
def test_two_limbs_in_many_rows_take_tiny_and_non_finite_activations(native_path: str, qtype: str) -> None:
    """With 2 limbs and enough rows for VNNI's tokens-in-lanes code, a block of tiny activations counts as
    zero and a NaN makes its row NaN, in either token group, and every other row is the same bits as alone
    (where the weight-rows-in-lanes code computes it)."""
    q = quant.quantize(_random(96, 40), qtype)
    x = np.random.default_rng(5).standard_normal((40, 96)).astype(np.float32)
    x[0, :32] = 1e-35
    x[35, 64:] = 1e-35
    x[1, 40] = np.nan
    x[37, 3] = np.inf
    d = jnp.asarray(q.data)
    f = jax.jit(lambda x, d: kernels.qmatmul(x, d, qtype, None, 2))
    got = np.asarray(f(x, d))
    assert np.isnan(got[[1, 37]]).all()
    ok = [i for i in range(40) if i not in (1, 37)]
    alone = np.concatenate([np.asarray(f(x[i:i + 1], d)) for i in ok])
    np.testing.assert_array_equal(got[ok], alone)
    assert np.isfinite(got[ok]).all()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("limbs", [2, 3])
def test_the_tiled_copy_gives_the_same_bits(native_path: str, qtype: str, limbs: int) -> None:
    """The matrix's copy tiled for VNNI's lanes (quant.tiled, read by the products of few rows) gives every
    row the bits its GGUF rows give: any number of rows (VNNI: tiled below 64, tokens in lanes from there;
    AMX: every limb a tile row from 5 to 8 rows on 2 limbs, the tiles from the tiled copy from 9 rows, from
    the GGUF rows above 16 without it), a
    last tile of 8 weight rows (N = 200), prompt and padding rows among them, tiny and non-finite
    activations; on every code, the AVX2 code's generated rows on 2 limbs included."""
    q = quant.quantize(_random(576, 200), qtype)
    tiled = quant.tiled(q)
    if tiled is None:
        pytest.skip("the native kernels are not available")
    assert tiled.nbytes == q.data.nbytes + (16 - 200 % 16) * q.data.shape[1]  # the last tile padded to 16 rows
    d, t = jnp.asarray(q.data), jnp.asarray(tiled)
    f = jax.jit(lambda x, d, fill, t: kernels.qmatmul(x, d, qtype, fill, limbs, t))
    for rows in [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 32, 33, 63, 64, 70, 130]:
        x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
        x[0, 64:96] = 1e-35
        if rows > 2:
            x[2, 100] = np.nan
        fill = np.zeros(rows, np.int32)
        if rows > 4:
            fill[1::4] = 1  # prompt rows (bfloat16 where the CPU has bf16 products)
            fill[-1] = -1  # a padding row
        ref = np.asarray(f(x, d, fill, None))
        got = np.asarray(f(x, d, fill, t))
        np.testing.assert_array_equal(got, ref)
        assert np.isfinite(np.delete(got, 2 if rows > 2 else [], axis=0)).all()


def _two_limb_product(w: np.ndarray, qtype: str):  # noqa: ANN202
    """The generated rows' product on 2 limbs with `w` quantized (f(x, d, t): t its tiled copy or None), the
    quantized blocks and the tiled copy; skips without the native kernels."""
    q = quant.quantize(w, qtype)
    tiled = quant.tiled(q)
    if tiled is None:
        pytest.skip("the native kernels are not available")
    f = jax.jit(lambda x, d, t: kernels.qmatmul(x, d, qtype, None, 2, t))
    return f, jnp.asarray(q.data), jnp.asarray(tiled)


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_few_rows_give_their_bits_alone(native_path: str, qtype: str) -> None:
    """2 to 9 generated rows on 2 limbs (on AMX: every limb a row of one tile from 5 rows, the tiled copy's
    tiles from 9) over an odd number of blocks (17) and a last tile of 12 weight rows: each row is the bits
    it is alone and the bits of the GGUF rows."""
    f, d, t = _two_limb_product(_random(544, 60, seed=6), qtype)
    x = np.random.default_rng(7).standard_normal((9, 544)).astype(np.float32)
    alone = np.concatenate([np.asarray(f(x[i:i + 1], d, t)) for i in range(9)])
    for rows in range(2, 10):
        got = np.asarray(f(x[:rows], d, t))
        np.testing.assert_array_equal(got, alone[:rows])
        np.testing.assert_array_equal(got, np.asarray(f(x[:rows], d, None)))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_a_wide_output_gives_the_same_bits(native_path: str, qtype: str) -> None:
    """A wide output (an LM head's logits for many rows: more than 2^20 floats) is the same bits from the
    tiled copy as from the GGUF rows, a last tile of 8 weight rows and a last token tile of 6 rows
    included, and each row is its result alone."""
    f, d, t = _two_limb_product(_random(64, 16392, seed=3), qtype)
    x = np.random.default_rng(4).standard_normal((70, 64)).astype(np.float32)
    got = np.asarray(f(x, d, t))
    assert got.size > 2**20
    np.testing.assert_array_equal(got, np.asarray(f(x, d, None)))
    np.testing.assert_array_equal(got[[0, 69]], np.concatenate([np.asarray(f(x[i:i + 1], d, t)) for i in (0, 69)]))


@pytest.fixture
def avx2_code():  # noqa: ANN201
    """The AVX2 code switched on (every CPU the kernels run on has it), the best code after."""
    if not kernels.available():
        pytest.skip("native CPU kernels unavailable")
    before = kernels.matmul_path()
    assert kernels.use_matmul("avx2") == "avx2" and kernels.avx2_int8()
    yield
    kernels.use_matmul(before)
    kernels.use_avx2_int8(True)


@pytest.mark.parametrize("qtype", QTYPES)
def test_avx2_codes_prompt_rows_are_the_same_bits_in_a_chunk_of_any_size(avx2_code: None, qtype: str) -> None:
    """The AVX2 code multiplies prompt rows in float32 through its panel for any number of rows (its few-row
    products sum in another order): a prompt token gets the same bits in a chunk of any size, so a context
    recomputed in other chunks than it was first fed in gets its bits again."""
    q = quant.quantize(_random(576, 80), qtype)
    x = np.random.default_rng(11).standard_normal((70, 576)).astype(np.float32)
    d = jnp.asarray(q.data)
    f = jax.jit(lambda x: kernels.qmatmul(x, d, qtype, jnp.ones(x.shape[0], jnp.int32)))
    alone = np.concatenate([np.asarray(f(x[i:i + 1])) for i in range(len(x))])
    for size in [2, 3, 9, 16, 17, 33, 70]:
        for start in range(0, len(x) - size + 1, size):
            np.testing.assert_array_equal(np.asarray(f(x[start:start + size])), alone[start:start + size])
    ref = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    np.testing.assert_allclose(alone, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", QTYPES)
def test_avx2_code_puts_generated_rows_on_two_limbs(avx2_code: None, qtype: str) -> None:
    """The AVX2 code, asked for 2 limbs (the default mode's generated rows): activations to 15 bits below
    their block's largest, within the 2-limb bound of the float product; a row the same bits alone and in a
    batch of any size, and from the tiled copy or the GGUF rows alone; a tiny block counts as zero, a NaN
    or infinity makes its row NaN; prompt rows of a mixed call exact (float32, as with 3 limbs); switched
    off, float32 for all."""
    q = quant.quantize(_random(576, 200), qtype)
    d, t = jnp.asarray(q.data), jnp.asarray(quant.tiled(q))
    f = jax.jit(lambda x, fill: kernels.qmatmul(x, d, qtype, fill, 2, t))
    x = np.random.default_rng(3).standard_normal((70, 576)).astype(np.float32)
    x[4, 32:64] = 1e-35
    x[9, 100] = np.nan
    x[50, 7] = -np.inf
    gen = np.zeros(70, np.int32)
    got = np.asarray(f(x, gen))
    assert np.isnan(got[[9, 50]]).all() and np.isfinite(np.delete(got, [9, 50], axis=0)).all()
    ok = np.delete(np.arange(70), [9, 50])
    ref = x[ok].astype(np.float64) @ q.dequantize().astype(np.float64)
    w = np.abs(q.dequantize().astype(np.float64)).reshape(18, 32, 200).sum(axis=1)
    bound = (np.abs(x[ok]).reshape(len(ok), 18, 32).max(axis=2) / 2**15) @ w
    assert (np.abs(got[ok] - ref) <= bound + 1e-5 * np.abs(ref) + 1e-6).all()
    exact = np.asarray(jax.jit(lambda x: kernels.qmatmul(x, d, qtype, None, 3, t))(x))
    assert not np.array_equal(got[ok], exact[ok])  # 15 bits, not float32
    alone = np.concatenate([np.asarray(f(x[i:i + 1], gen[:1])) for i in range(70)])
    for size in [2, 3, 4, 16, 17, 33, 70]:  # every size: one code for generated rows (1-4: sums in registers)
        for start in range(0, 70 - size + 1, size):
            np.testing.assert_array_equal(np.asarray(f(x[start:start + size], gen[:size])), alone[start:start + size])
    mixed = gen.copy()
    mixed[1::3] = 1  # prompt rows among them
    both = np.asarray(f(x, mixed))
    np.testing.assert_array_equal(both[mixed == 0], got[mixed == 0])
    np.testing.assert_array_equal(both[mixed == 1], exact[mixed == 1])
    rows = np.asarray(jax.jit(lambda x: kernels.qmatmul(x, d, qtype, None, 2))(x))  # the GGUF rows alone
    np.testing.assert_array_equal(rows.view(np.uint32), got.view(np.uint32))
    kernels.use_avx2_int8(False)
    np.testing.assert_array_equal(np.asarray(f(x, gen)), exact)


@pytest.mark.parametrize("qtype", QTYPES)
def test_avx2_codes_generated_rows_are_the_vnni_codes_bits(qtype: str) -> None:
    """Generated rows on 2 limbs: the AVX2 code's integer sums give every row the VNNI code's bits (its rows
    and its tokens-in-lanes code, 64 rows and more), tiny and non-finite activations included: a sequence
    decodes the same on an AVX2-only CPU as on an AVX-512 one."""
    if "avx512-vnni" not in kernels.matmul_paths():
        pytest.skip("this CPU (or this build) has no VNNI code to compare with")
    q = quant.quantize(_random(576, 200), qtype)
    d, t = jnp.asarray(q.data), jnp.asarray(quant.tiled(q))
    before = kernels.matmul_path()
    try:
        for rows in [1, 5, 16, 17, 40, 64, 100]:
            x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
            x *= np.exp(np.random.default_rng(rows + 1).standard_normal((rows, 1))).astype(np.float32)
            x[0, :32] = 0.0
            if rows > 2:
                x[1, 64:96] = 1e-35
                x[2, 300] = np.nan
            fill = np.zeros(rows, np.int32)
            out = {}
            for path in ("avx512-vnni", "avx2"):
                kernels.use_matmul(path)
                out[path] = np.asarray(kernels.qmatmul(jnp.asarray(x), d, qtype, jnp.asarray(fill), 2, t))
            np.testing.assert_array_equal(out["avx2"].view(np.uint32), out["avx512-vnni"].view(np.uint32))
    finally:
        kernels.use_matmul(before)


def test_no_tiled_copy_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PARROT_TILED_WEIGHTS=0`: no tiled copies (the products read the GGUF rows alone, no memory for a copy)."""
    q = quant.quantize(_random(64, 32), "q4_1")
    monkeypatch.setenv("PARROT_TILED_WEIGHTS", "0")
    assert quant.tiled(q) is None


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("kind", ["prompt", "generated", "mixed"])
@pytest.mark.parametrize("rows", [1, 13, 45])
def test_fused_swiglu_is_silu_of_gate_times_up(native_path: str, qtype: str, kind: str, rows: int) -> None:
    """`swiglu`: the product of a fused gate|up matrix comes out as silu(gate) * up of the same products
    ([T, N / 2]; on AMX's bf16 tiles prompt rows' in the product's epilogue), each code this CPU has, odd
    widths included; trailing padding rows are zeros."""
    q = quant.quantize(_random(576, 2 * 75), qtype)  # 75 output columns: whole tiles and a part
    d = jnp.asarray(q.data)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows + 2, 576)).astype(np.float32))
    fill = {"prompt": np.ones(rows, np.int32), "generated": np.zeros(rows, np.int32),
            "mixed": np.arange(rows, dtype=np.int32) % 2}[kind]
    fill = jnp.asarray(np.concatenate([fill, [-1, -1]]).astype(np.int32))  # two padding rows
    full = np.asarray(kernels.qmatmul(x, d, qtype, fill, 2), np.float64)
    fused = np.asarray(kernels.qmatmul(x, d, qtype, fill, 2, swiglu=True))
    assert fused.shape == (rows + 2, 75)
    g, u = full[:rows, :75], full[:rows, 75:]
    np.testing.assert_allclose(fused[:rows], g / (1 + np.exp(-g)) * u, rtol=2e-6, atol=1e-7)
    assert np.all(fused[rows:] == 0)


@pytest.mark.skipif(not BF16_FILLS, reason=NO_BF16)
def test_fused_swiglu_gives_a_row_the_same_bits_alone_in_a_batch_and_beside_generated_rows() -> None:
    """A prompt row's silu(gate) * up is the same bits alone, in a batch of prompt rows (on AMX's tiles: the
    product's epilogue) and in a call with generated rows (the product first, then the same function)."""
    q = quant.quantize(_random(576, 2 * 200), "q4_1")
    d = jnp.asarray(q.data)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((40, 576)).astype(np.float32))
    f = jax.jit(lambda x, fill: kernels.qmatmul(x, d, "q4_1", fill, 2, swiglu=True))
    batch = np.asarray(f(x, jnp.ones(40, jnp.int32)))
    alone = np.concatenate([np.asarray(f(x[i:i + 1], jnp.ones(1, jnp.int32))) for i in (0, 17, 39)])
    np.testing.assert_array_equal(alone, batch[[0, 17, 39]])
    mixed = np.asarray(f(x, jnp.asarray(np.arange(40) % 3 != 0, jnp.int32)))
    prompt = np.arange(40) % 3 != 0
    np.testing.assert_array_equal(mixed[prompt], batch[prompt])


def test_fused_swiglu_takes_an_even_matrix_only() -> None:
    if not kernels.available():
        pytest.skip("native CPU kernels unavailable")
    q = quant.quantize(_random(64, 33), "q8_0")
    with pytest.raises(Exception, match="even number of rows"):
        np.asarray(kernels.qmatmul(jnp.ones((2, 64)), jnp.asarray(q.data), "q8_0", swiglu=True))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1", "q4_0"])
def test_quantize_matrices_takes_the_float_matrices_only(qtype: str) -> None:
    """`--weights q8_0` (q4_1, q4_0): every float matrix as such blocks (the embedding by its rows), each block
    as gguf quantizes it; norms, biases, matrices already in blocks and inputs not a multiple of 32 kept."""
    rng = np.random.default_rng(5)
    q4 = quant.quantize(rng.standard_normal((64, 96)).astype(np.float32), "q4_1")
    w = {"embed": rng.standard_normal((100, 64)).astype(np.float32),
         "layers.0.wq": rng.standard_normal((64, 96)).astype(np.float32),
         "layers.0.w_down": q4,
         "layers.0.wo": rng.standard_normal((48, 64)).astype(np.float32),  # input of 48: not whole blocks
         "layers.0.bq": rng.standard_normal(96).astype(np.float32),
         "layers.0.attn_norm": np.ones(64, np.float32)}
    out = quant.quantize_matrices(w, qtype)
    emb, wq = out["embed"], out["layers.0.wq"]
    assert isinstance(emb, QuantizedTensor) and emb.rows_are_matrix and emb.shape == (100, 64)
    assert isinstance(wq, QuantizedTensor) and not wq.rows_are_matrix and wq.shape == (64, 96)
    assert wq.qtype == emb.qtype == qtype
    np.testing.assert_array_equal(wq.data, gguf.quants.quantize(np.ascontiguousarray(w["layers.0.wq"].T),
                                                                 gguf.GGMLQuantizationType[qtype.upper()]))
    steps = {"q8_0": 127, "q4_1": 15 / 2, "q4_0": 7}  # within a step of each block's range / levels
    for name in ("embed", "layers.0.wq"):
        np.testing.assert_allclose(out[name].dequantize(), w[name], atol=np.abs(w[name]).max() / steps[qtype])
    assert out["layers.0.w_down"] is q4
    for name in ("layers.0.wo", "layers.0.bq", "layers.0.attn_norm"):
        assert out[name] is w[name]
