"""The sampler of a sampled step alone: the native CPU kernels (`kernels.sample`, `kernels.logprobs`) against
XLA's code of the same definitions, side by side in one run, per batch size and kind of sampling; and the
prompt logprobs of a fill's rows (`logprobs.token_logprobs`).

    python -m benchmarks.sampler [--batch 1 16 64] [--prompt-rows 16 128 512] [--repeats 30]

Runs the executable the engine runs for a sampled step (`sampling.processed_sampler`, neutral extras, zero
counts), traced once with `PARROT_CPU_SAMPLER=1` and once with `0`, the two taking turns. Logits of SmolLM2's
vocabulary (49,152), two shapes: "flat" (normal, sigma 2: at temperature 1 a top-p of 0.95 keeps thousands
of tokens, the hard case) and "peaked" (Zipf over a random order, as a model's next-token distribution
mostly is). "+ logprobs": the same step with every row asking for logprobs. Prints medians in ms and the
ratio, with the machine's floors; writes JSON.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from benchmarks.floors import measure
from benchmarks.report import write_json
from parrot import procinfo
from parrot.engine import kernels
from parrot.engine.logprobs import token_logprobs
from parrot.engine.sampling import SamplerExtras, SamplingBatch, sample_processed
from parrot.protocol import SamplingParams

VOCAB = 49152
KINDS = {  # name: SamplingParams' fields
    "temperature 1.0": dict(temperature=1.0),
    "top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "top-k 40": dict(temperature=0.8, top_k=40),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top-k 200, top-p 0.9": dict(temperature=1.0, top_k=200, top_p=0.9),
    "top-p 0.95 + logprobs": dict(temperature=0.8, top_p=0.95, logprobs=5),
}


def _logits(shape: str, batch: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if shape == "flat":
        return (rng.standard_normal((batch, VOCAB)) * 2.0).astype(np.float32)
    ranks = np.argsort(rng.random((batch, VOCAB)), axis=-1) + 1
    return (-1.1 * np.log(ranks) * 2.5 + rng.standard_normal((batch, VOCAB)) * 0.2 + 8.0).astype(np.float32)


def _compiled(native: bool, fn, *args):  # noqa: ANN001, ANN202
    os.environ["PARROT_CPU_SAMPLER"] = "1" if native else "0"
    try:
        # a new function each time: jit's trace cache is keyed by the function
        return jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    finally:
        os.environ.pop("PARROT_CPU_SAMPLER", None)


def _in_turns(fns: dict, args: tuple, repeats: int) -> dict[str, float]:
    """Median ms of each compiled function, run in turns."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def run(batches: list[int], prompt_rows: list[int], repeats: int) -> dict:
    if not kernels.available():
        raise SystemExit(f"the native kernels are unavailable here: {kernels.unavailable_reason()}")
    floors = measure()
    rows, prompt = [], []
    for batch in batches:
        counts = np.zeros((batch, VOCAB), np.int32)
        for shape in ("flat", "peaked"):
            logits = _logits(shape, batch)
            for kind, fields in KINDS.items():
                params = [SamplingParams(seed=i, **fields) for i in range(batch)]
                sb = SamplingBatch.build(params, [5] * batch, batch, [0] * batch)
                ex = SamplerExtras.neutral(batch, VOCAB)
                ex.logprobs[:] = "logprobs" in fields
                # on the device, as the engine's logits, extras and counts are: only the sampler is timed
                args = jax.device_put((logits, sb, ex, counts))
                fns = {name: _compiled(name == "native", sample_processed, *args) for name in ("native", "xla")}
                ms = _in_turns(fns, args, repeats)
                rows.append({"batch": batch, "logits": shape, "kind": kind, "native_ms": ms["native"],
                             "xla_ms": ms["xla"], "speedup": ms["xla"] / ms["native"]})
                print(f"batch {batch:3d}  {shape:6s}  {kind:22s}  native {ms['native']:8.2f} ms   "
                      f"xla {ms['xla']:8.2f} ms   {ms['xla'] / ms['native']:6.1f}x", flush=True)
    for n in prompt_rows:  # a prefill chunk's prompt logprobs: every row scored
        args = jax.device_put((_logits("peaked", n), np.arange(n, dtype=np.int32) % VOCAB))
        fns = {name: _compiled(name == "native", token_logprobs, *args) for name in ("native", "xla")}
        ms = _in_turns(fns, args, max(3, repeats // 5))
        prompt.append({"rows": n, "native_ms": ms["native"], "xla_ms": ms["xla"], "speedup": ms["xla"] / ms["native"]})
        print(f"prompt logprobs, {n:4d} rows  native {ms['native']:8.2f} ms   xla {ms['xla']:8.2f} ms   "
              f"{ms['xla'] / ms['native']:6.1f}x", flush=True)
    return {"benchmark": "sampler", "machine": procinfo.cpu_name(), "cpus": os.cpu_count(), "vocab": VOCAB,
            "repeats": repeats, "floors": floors, "rows": rows, "prompt_logprobs": prompt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-rows", type=int, nargs="*", default=[16, 128, 512])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/sampler.json")
    args = ap.parse_args()
    result = run(args.batch, args.prompt_rows, args.repeats)
    f = result["floors"]
    print(f"CPU {result['machine']} ({result['cpus']} cores); floors: read {f['memory_read_gbs']:.1f} GB/s, "
          f"fp32 GEMM {f['gemm_fp32_gflops']:.0f} GFLOP/s")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
