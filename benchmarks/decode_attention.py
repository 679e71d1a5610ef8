"""Decode attention alone: the native CPU kernel `paged_decode` over every layer's KV pages, as one decode step
of the engine reads them, timed without the products around it.

    python -m benchmarks.decode_attention --batches 1 16 64 --context 512
    python -m benchmarks.decode_attention --other-build before=/path/to/an/older/checkout   # builds in turns
    python -m benchmarks.decode_attention --placement random runs   # pages scattered against pages in runs

The caches are a pool per layer ([kv heads, pages, page size, head size], bfloat16 bits by default, as the
engine's bfloat16 mode holds them) with random values, and each sequence's pages lie at random places in it (as
they did in a long-running server before `page_pool` kept them in runs; `--placement runs`: one after another),
so the pages come from memory (not the one zero page an unwritten pool maps). The
shape is SmolLM2-135M's by default (30 layers, 9 query heads over 3 KV heads of 64). Each build (this checkout's
and every `--other-build`, a checkout or a library, `kernels.use_build`) runs the same step in turns; medians.
Prints the floors measured in the same run and the bytes a step reads per second; writes JSON
(`benchmarks/results/decode_attention.json`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import floors
from benchmarks.engine_micro import _other_builds, _time_interleaved
from benchmarks.report import write_json
from parrot import procinfo
from parrot.engine import kernels

CACHE_DTYPES = {"bf16": (np.uint16, 2), "fp8": (np.uint8, 1), "f32": (np.float32, 4)}


def _caches(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> jax.Array:
    """Random cache values: bfloat16 and float8 bits of numbers near 1 in size, or float32 numbers."""
    if dtype == "bf16":
        return jnp.asarray(rng.integers(0x3C00, 0x3F80, shape, dtype=np.uint16) | (rng.integers(0, 2, shape,
                                                                                           dtype=np.uint16) << 15))
    if dtype == "fp8":
        return jnp.asarray(rng.integers(0x20, 0x40, shape, dtype=np.uint8) | (rng.integers(0, 2, shape,
                                                                                       dtype=np.uint8) << 7))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def step_fn(batch: int, context: int, layers: int, heads: int, kv_heads: int, head_dim: int, page: int,
            dtype: str, seed: int = 0, placement: str = "random"):  # noqa: ANN201 - a jitted function, its operands, the block tables
    """One step's attention: `layers` calls of `paged_decode`, each on its own layer's pool, summed (so that
    none is left out). Returns the jitted function, its operands and the sequences' block tables."""
    rng = np.random.default_rng(seed)
    per_seq = -(-context // page)
    pool = batch * per_seq + 64  # the pages in use and some free ones, at random places
    shape = (kv_heads, pool, page, head_dim)
    ks = [_caches(rng, dtype, shape) for _ in range(layers)]
    vs = [_caches(rng, dtype, shape) for _ in range(layers)]
    if placement == "runs":  # each sequence's pages one after another, the sequences in a random order
        order = rng.permutation(batch)
        tables = jnp.asarray((order[:, None] * per_seq + np.arange(per_seq)).astype(np.int32))
    else:
        tables = jnp.asarray(rng.permutation(pool)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((batch, heads, head_dim)).astype(np.float32))
    zeros = jnp.zeros((batch,), jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    scale = head_dim ** -0.5

    @jax.jit
    def step(q: jax.Array, ks: list[jax.Array], vs: list[jax.Array]) -> jax.Array:
        out = jnp.zeros_like(q)
        for k, v in zip(ks, vs, strict=True):
            out = out + kernels.paged_decode(q, k, v, tables, zeros, lens, jnp.zeros((1,), jnp.int32),
                                             jnp.zeros((), jnp.int32), zeros, scale)
        return out

    return step, (q, ks, vs), tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--cache", choices=sorted(CACHE_DTYPES), default="bf16", help="the caches' element type")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--other-build", action="append", default=[], metavar="LABEL=PATH",
                    help="another build of the kernels (a checkout, its cpu_kernels.cc, or a library), in turns")
    ap.add_argument("--placement", nargs="+", choices=["random", "runs"], default=["random"],
                    help="where each sequence's pages lie in the pool: at random places (default), or one after "
                         "another (`runs`); several: each in turns")
    ap.add_argument("--out", default="benchmarks/results/decode_attention.json")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"the native CPU kernels are unavailable: {kernels.unavailable_reason()}")
    builds = {"this": None, **_other_builds(args.other_build, Path(args.out).with_suffix(".builds"))}
    floor = floors.measure()
    cpu = procinfo.cpu_name()
    print(f"CPU {cpu}; floors: read {floor['memory_read_gbs']:.1f} GB/s, fp32 GEMM "
          f"{floor['gemm_fp32_gflops']:.0f} GFLOP/s", flush=True)
    result: dict = {"cpu": cpu, "floors": floor, "args": vars(args), "by_batch": {}}
    width = CACHE_DTYPES[args.cache][1]
    for b in args.batches:
        fns = {}
        for build, lib in builds.items():
            kernels.use_build(lib)
            for placement in args.placement:
                label = build if len(args.placement) == 1 else f"{build} {placement}"
                step, operands, _ = step_fn(b, args.context, args.layers, args.heads, args.kv_heads, args.head_dim,
                                            args.page_size, args.cache, placement=placement)
                step(*operands).block_until_ready()  # compiled with this build's targets

                def run(step=step, operands=operands) -> None:  # noqa: ANN001
                    step(*operands).block_until_ready()
                fns[label] = run
        kernels.use_build(None)
        times = _time_interleaved(fns, args.repeats)
        read = b * args.context * args.layers * args.kv_heads * args.head_dim * 2 * width
        row = {}
        for label, s in times.items():
            gbs = read / s / 1e9
            row[label] = {"ms": s * 1e3, "read_mb": read / 1e6, "gb_per_s": gbs,
                          "of_read_floor": gbs / floor["memory_read_gbs"]}
            print(f"[{label}] batch {b}, context {args.context}: {s * 1e3:.2f} ms a step ({args.layers} layers), "
                  f"{read / 1e6:.0f} MB read: {gbs:.1f} GB/s ({gbs / floor['memory_read_gbs']:.2f}x the read floor)",
                  flush=True)
        first = next(iter(times))
        for label in list(times)[1:]:
            print(f"batch {b}: {label} / {first} time {times[label] / times[first]:.3f}x", flush=True)
        result["by_batch"][str(b)] = row
    write_json(result, args.out)


if __name__ == "__main__":
    main()
