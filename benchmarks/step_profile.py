"""Where one decode step's time goes: per-kernel device time from a JAX profiler trace, next to the
step's wall time (synced and pipelined) and the host's dispatch time.

    python -m benchmarks.step_profile --model llama-3-8b --load-format dummy --batch 1 64 [--context 512]

On a GPU the kernels are read from the device's stream lines of the trace (`jax.profiler.ProfileData`);
on a CPU from XLA's CPU client threads. Prints the busiest kernels and writes JSON
(`benchmarks/results/step_profile.json`). Random weights of a preset's shape need no files.
"""

from __future__ import annotations

import argparse
import collections
import glob
import tempfile
import time

import jax
import numpy as np

from benchmarks.report import write_json
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine.batch import SequenceSlice, build_batch
from parrot.engine.loader import load_model
from parrot.engine.runner import ModelRunner


def _kernel_lines(plane_name: str, line_name: str) -> bool:
    if plane_name.startswith("/device:"):
        return "tream" in line_name  # a GPU's compute and copy streams
    return plane_name == "/host:CPU" and ("XLAPjRtCpuClient" in line_name or "XLAEigen" in line_name)


def kernel_times(step, steps: int = 5) -> dict:  # noqa: ANN001
    """Per-kernel device time of `steps` calls of `step`, per step: {name: [us, count]}, and the total."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(steps):
            step()
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
        agg: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for plane in data.planes:
            for line in plane.lines:
                if not _kernel_lines(plane.name, line.name):
                    continue
                for ev in line.events:
                    if ev.duration_ns <= 0 or ev.name.startswith("ThreadpoolListener"):
                        continue
                    agg[ev.name][0] += ev.duration_ns / 1e3 / steps
                    agg[ev.name][1] += 1 / steps
    busy = sum(v[0] for v in agg.values())
    return {"busy_us": busy, "kernels_per_step": sum(v[1] for v in agg.values()),
            "top": sorted(([k, round(v[0], 1), round(v[1], 1)] for k, v in agg.items()), key=lambda r: -r[1])[:25]}


def profile(runner: ModelRunner, batch_size: int, context: int, fill: int = 0) -> dict:
    """One decode step of `batch_size` sequences at `context`, or (`fill` > 0) one prefill step of
    `fill` prompt tokens per sequence after `context` - `fill` cached ones."""
    ps = runner.page_size
    per = -(-context // ps)
    n = fill or 1
    seqs = [SequenceSlice([100 + i] * n, context - n, list(range(1 + i * per, 1 + (i + 1) * per)), fill=fill > 0)
            for i in range(batch_size)]
    shape = (runner.shapes.prefill_shape(batch_size, fill, context, fill * batch_size) if fill
             else runner.shapes.decode_shape(batch_size, context))
    batch = build_batch(seqs, ps, shape.tokens, shape.batch, shape.q_len, shape.pages)

    def step() -> None:
        np.asarray(runner.sample(runner.forward(batch), None))

    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(20):
        step()
    synced = (time.perf_counter() - t) / 20 * 1e3
    d0, t = runner.dispatch_s, time.perf_counter()
    jax.block_until_ready([runner.sample(runner.forward(batch), None) for _ in range(20)])
    pipelined = (time.perf_counter() - t) / 20 * 1e3
    dispatch = (runner.dispatch_s - d0) / 20 * 1e3
    return {"batch": batch_size, "context": context, "fill": fill, "synced_ms": synced, "pipelined_ms": pipelined,
            "host_dispatch_ms": dispatch, **kernel_times(step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--fill", type=int, default=0,
                    help="profile a prefill step of this many prompt tokens per sequence (ending at --context)")
    ap.add_argument("--layers-per-call", type=int, default=1, help="0: the whole model in one call")
    ap.add_argument("--decode-attention", choices=["auto", "xla", "kernel"], default="auto")
    ap.add_argument("--kv-memory-mb", type=int, default=2048)
    ap.add_argument("--out", default="benchmarks/results/step_profile.json")
    args = ap.parse_args()
    model = load_model(args.model, load_format=args.load_format, progress=False)
    runner = ModelRunner(model.config, model.weights, EngineConfig(
        model=args.model, kv_memory_mb=args.kv_memory_mb, compilation_cache_dir=None,
        layers_per_call=args.layers_per_call or None, decode_attention=args.decode_attention))
    result = {"model": model.source, "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
              "cpu": procinfo.cpu_name(), "jax": jax.__version__, "decode_kernel": runner.decode_kernel,
              "layers_per_call": args.layers_per_call, "steps": []}
    for b in args.batch:
        r = profile(runner, b, args.context, args.fill)
        result["steps"].append(r)
        what = f"fill {args.fill} tokens" if args.fill else "decode"
        print(f"batch {b} {what}, context {args.context}: synced {r['synced_ms']:.2f} ms, pipelined "
              f"{r['pipelined_ms']:.2f} ms, host dispatch {r['host_dispatch_ms']:.2f} ms; kernels busy "
              f"{r['busy_us'] / 1e3:.2f} ms in {r['kernels_per_step']:.0f} kernels per step")
        for name, us, n in r["top"][:15]:
            print(f"    {us:9.1f} us  x{n:5.0f}  {name[:110]}")
    print(f"{result['device']} ({result['backend']}), CPU {result['cpu']}, JAX {result['jax']}")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
