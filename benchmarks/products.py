"""The quantized products alone: `kernels.qmatmul` on the default model's matrix shapes, generated rows
(a decode step's) on 2 limbs as the default mode asks for them, each native code this CPU has side by side
in one run, the codes taking turns.

    python -m benchmarks.products [--rows 1 4 16 64] [--repeats 30] [--codes ...] [--weights-in huge xla]
    python -m benchmarks.products --prompt [--rows 128 512] [--repeats 9]
    python -m benchmarks.products --other-build before=/path/to/an/older/checkout [--codes 'avx2 int8']

Codes: "avx2 float32" (the AVX2 code with the dequantized weights: `use_avx2_int8(False)`), "avx2 int8" (its
integer sums from the tiled weights, kernels/avx2_int8.h), and where the CPU has them "avx512-vnni" and
"amx-int8" (and "amx-int8 few-off": VNNI below 16 rows, `use_amx_few(False)`). Each call multiplies 30
different matrices of a shape in turn (a step's layers: the weights come from memory, not the cache).
Prints the median microseconds per matrix and each code's ratio to the first, with the CPU's name and the
machine's floors; writes JSON. `--weights-in huge xla` measures each
code with the matrices in huge pages (parrot.engine.huge_pages, as the engine places them) and in XLA's
own memory, in turns. `--other-build LABEL=PATH` (repeatable: a checkout, its cpu_kernels.cc, or a library)
measures every code of another build of the kernels beside this one's, in the same turns (`kernels.use_build`:
each build's own tiled copies, calls and switches), its columns named `code @LABEL`.

`--prompt`: a prompt step's rows instead (fill rows, in bfloat16 where the CPU multiplies them so), on the
prompt shapes (QKV, O, gate|up, gate|up with silu(gate) * up out of the product as the model asks for it,
down). Codes: "integer" (the bf16 products switched off: the best integer code on 2 limbs), and where the
CPU has them "avx512-bf16" and "amx-bf16", each also as "... gguf-rows" (the weights dequantized from their
GGUF rows, not from the tiled copy: `use_tiled(False)`).
"""

from __future__ import annotations

import argparse
import time

SHAPES = {  # name: (block type, N, K, silu(gate) * up) of SmolLM2-135M's matrices
    "gate|up q4_1 3072x576": ("q4_1", 3072, 576, False),
    "down q4_1 576x1536": ("q4_1", 576, 1536, False),
    "head part q8_0 8192x576": ("q8_0", 8192, 576, False),
}
PROMPT_SHAPES = {
    "qkv q4_1 960x576": ("q4_1", 960, 576, False),
    "o q4_1 576x576": ("q4_1", 576, 576, False),
    "gate|up q4_1 3072x576": ("q4_1", 3072, 576, False),
    "gate|up+silu q4_1 3072x576": ("q4_1", 3072, 576, True),
    "down q4_1 576x1536": ("q4_1", 576, 1536, False),
}
PROMPT_CODES = {"integer": None, "avx512-bf16": "avx512-vnni", "amx-bf16": "amx-int8"}  # code: its matmul path
LAYERS = 30


def _chain(qtype: str, prompt: bool = False, swiglu: bool = False):  # noqa: ANN202
    """Every matrix of `mats` times x in turn, each call waiting on the one before (as a step's layers):
    generated rows, or (`prompt`) a prompt's."""
    import jax.numpy as jnp

    from parrot.engine import kernels

    def f(x, mats):  # noqa: ANN001, ANN202
        acc = jnp.zeros((), jnp.float32)
        fill = jnp.full(x.shape[0], 1 if prompt else 0, jnp.int32)
        for d, t in mats:
            acc = acc + kernels.qmatmul(x + acc * 0, d, qtype, fill, 2, t, swiglu)[0, 0]
        return acc

    return f


def run(rows: list[int], repeats: int, codes: list[str] | None = None, places: list[str] | None = None,
        prompt: bool = False, builds: dict[str, str] | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.floors import measure
    from parrot import procinfo
    from parrot.engine import huge_pages, kernels, quant

    if not kernels.available():
        raise SystemExit(f"the native kernels are unavailable: {kernels.unavailable_reason()}")
    have = ["avx2 float32", "avx2 int8"] + [p for p in kernels.matmul_paths() if p != "avx2"]
    if "amx-int8" in have:
        have.append("amx-int8 few-off")  # VNNI below 16 rows, as before amx::few_rows
    if prompt:
        have = ["integer"] + [c for c, p in PROMPT_CODES.items()
                              if p in kernels.matmul_paths() and (c != "amx-bf16" or kernels.bf16_tiles())]
        have += [f"{c} gguf-rows" for c in have[1:]]  # the weights dequantized from the GGUF rows, not the copy
    codes = [c for c in have if codes is None or c in codes]
    places = places or ["huge"]
    libs = {"": None, **(builds or {})}  # build label ("": this process's) -> its library
    # a configuration: (build, code, place), named "code[, place][ @build]"
    configs = {f"{c}, {p}" if len(places) > 1 else c: ("", c, p) for c in codes for p in places}
    configs |= {f"{name} @{b}": (b, c, p) for b in libs if b for name, (_, c, p) in list(configs.items())}
    before = kernels.matmul_path()

    def select(code: str) -> None:  # the switches of the build in use
        if prompt:
            kernels.use_matmul(PROMPT_CODES[code.split()[0]] or before)
            kernels.use_bf16_fills(code != "integer")
            kernels.use_tiled(not code.endswith("gguf-rows"))
            return
        kernels.use_matmul(code.split()[0])
        kernels.use_avx2_int8(code != "avx2 float32")
        kernels.use_amx_few(code != "amx-int8 few-off")

    def put(a: np.ndarray, place: str) -> jax.Array:
        return huge_pages.put(a) if place == "huge" else jnp.asarray(a)

    rng = np.random.default_rng(0)
    result: dict = {"machine": procinfo.cpu_name(), "jax": jax.__version__, "codes": list(configs), "rows": rows,
                    "builds": {b: lib for b, lib in libs.items() if b},
                    "layers": LAYERS, "huge_pages": huge_pages.enabled(), "prompt": prompt, "us_per_matrix": {}}
    for shape, (qtype, n, k, swiglu) in (PROMPT_SHAPES if prompt else SHAPES).items():
        one = quant.quantize((rng.standard_normal((k, n)) * 0.05).astype(np.float32), qtype)
        mats: dict[tuple[str, str], list] = {(b, p): [] for b in libs for p in places}
        for i in range(LAYERS):  # the same values, 30 copies in memory
            data = np.roll(one.data, i, axis=0)
            for b, lib in libs.items():
                kernels.use_build(lib)
                tiled = kernels.tile_rows(data, qtype, k)  # this build's tiled copy
                for p in places:
                    mats[(b, p)].append((put(data, p), put(tiled, p)))
        kernels.use_build(None)
        fs = {b: jax.jit(_chain(qtype, prompt, swiglu)) for b in libs}  # each traced with its build in use

        result["us_per_matrix"][shape] = {}
        for r in rows:
            x = jnp.asarray(rng.standard_normal((r, k)).astype(np.float32))
            times: dict[str, list[float]] = {c: [] for c in configs}

            def go(c: str, x=x, mats=mats, fs=fs) -> None:  # noqa: ANN001
                b, code, p = configs[c]
                kernels.use_build(libs[b])
                try:
                    select(code)
                    fs[b](x, mats[(b, p)]).block_until_ready()
                finally:
                    kernels.use_build(None)

            for c in configs:  # compile and warm each configuration once
                go(c)
            for _ in range(repeats):
                for c in configs:
                    t0 = time.perf_counter()
                    go(c)
                    times[c].append((time.perf_counter() - t0) / LAYERS * 1e6)
            result["us_per_matrix"][shape][r] = {c: float(np.median(v)) for c, v in times.items()}
    for lib in libs.values():  # every build's switches as they were
        kernels.use_build(lib)
        kernels.use_matmul(before)
        kernels.use_avx2_int8(True)
        kernels.use_amx_few(True)
        kernels.use_bf16_fills(True)
        kernels.use_tiled(True)
    kernels.use_build(None)
    result["floors"] = measure()
    return result


def report(r: dict) -> str:
    fl = r["floors"]
    lines = [f"CPU {r['machine']}, JAX {r['jax']}; floors {fl['memory_read_gbs']:.1f} GB/s read, "
             f"{fl['gemm_fp32_gflops']:.0f} GFLOP/s fp32 GEMM; medians over {r['layers']} matrices a call, in turns"]
    first = r["codes"][0]
    for shape, by_rows in r["us_per_matrix"].items():
        for rows, us in by_rows.items():
            cells = "  ".join(f"{c} {t:8.1f} us ({us[first] / t:4.2f}x)" for c, t in us.items())
            lines.append(f"{shape:26s} {rows:>3} rows: {cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="default: 1 4 16 64 (--prompt: 128 512)")
    ap.add_argument("--repeats", type=int, default=None, help="default: 30 (--prompt: 9)")
    ap.add_argument("--prompt", action="store_true", help="a prompt step's rows, in bfloat16 where the CPU can")
    ap.add_argument("--codes", nargs="+", default=None,
                    help="the codes to measure (default: every one this CPU has): 'avx2 float32', 'avx2 int8', "
                         "avx512-vnni, amx-int8 (--prompt: integer, avx512-bf16, amx-bf16)")
    ap.add_argument("--weights-in", nargs="+", default=["huge"], choices=["huge", "xla"],
                    help="where the matrices lie: huge pages (as the engine places them) or XLA's memory")
    ap.add_argument("--other-build", action="append", default=[], metavar="LABEL=PATH",
                    help="another build of the kernels (a checkout, its cpu_kernels.cc, or a library), in turns")
    ap.add_argument("--out", default="benchmarks/results/products.json")
    args = ap.parse_args()
    from pathlib import Path

    from benchmarks.engine_micro import _other_builds
    from benchmarks.report import write_json

    rows = args.rows or ([128, 512] if args.prompt else [1, 4, 16, 64])
    builds = _other_builds(args.other_build, Path(args.out).with_suffix(".builds"))
    r = run(rows, args.repeats or (9 if args.prompt else 30), args.codes, args.weights_in, args.prompt, builds)
    print(report(r))
    write_json(r, args.out)


if __name__ == "__main__":
    main()
