"""The engine's overlap (a stable decode batch keeps one step in flight) and multi-step decode (that
step runs K decode steps in one call) against waiting for every step's tokens, side by side in one
process: output tokens per second and the host's milliseconds per step (scheduling, batch building,
applying tokens: what overlap hides behind the device), at several concurrencies, next to this machine's
floors.

    python -m benchmarks.overlap [--model smollm2] [--concurrency 1 4 16] [--tokens 64] [--repeats 3]
        [--multi-step 4] [--unrolled-too] [--load-format auto|dummy]

`--multi-step 1` leaves the multi-step engine out. `--unrolled-too` adds a multi-step engine whose loops
unroll the decoder layers (`--no-layer-loop`) beside the default one, whose loops run them as a loop.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import load_model
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams


def _round(eng: LLMEngine, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Fill one context per prompt, then generate `tokens` greedy tokens in all of them at once."""
    for i, p in enumerate(prompts):
        eng.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=p)).result()
    t0 = time.perf_counter()
    futs = [eng.generate_future(GenerateRequest(context_id=f"{tag}{i}", sampling=SamplingParams(
        max_tokens=tokens, ignore_eos=True))) for i in range(len(prompts))]
    outs = [f.result().token_ids for f in futs]
    dt = time.perf_counter() - t0
    for i in range(len(prompts)):
        eng.free_future(f"{tag}{i}").result()
    return dt, outs


def run(model: str, concurrency: list[int], tokens: int, repeats: int, multi_step: int = 4,
        load_format: str = "auto", unrolled: bool = False) -> dict:
    loaded = load_model(model, progress=False, load_format=load_format)
    tok = loaded.tokenizer
    variants: dict[str, dict] = {"overlap": dict(overlap=True, multi_step=1), "wait": dict(overlap=False, multi_step=1)}
    if multi_step > 1:
        variants["multi"] = dict(overlap=True, multi_step=multi_step)
        if unrolled:
            variants["unrolled"] = dict(overlap=True, multi_step=multi_step, layer_loop=False)
    engines = {name: LLMEngine(loaded, EngineConfig(kv_memory_mb=512, precompile=False, **kw)).start()
               for name, kw in variants.items()}
    result: dict = {"model": model, "backend": jax.default_backend(), "machine": procinfo.cpu_name(),
                    "floors": floors.measure(), "tokens": tokens, "repeats": repeats, "multi_step": multi_step,
                    "concurrency": {}}
    try:
        for c in concurrency:
            prompts = [tok.encode(f"Write a long story about parrot number {i} and its travels.") for i in range(c)]
            for eng in engines.values():  # compile this concurrency's shapes outside the timing
                _round(eng, prompts, 4 * max(multi_step, 1), "warm")
            times: dict[str, list[float]] = {k: [] for k in engines}
            host: dict[str, list[float]] = {k: [] for k in engines}
            outs: dict[str, list] = {}
            for rep in range(repeats):
                for name, eng in engines.items():  # in turns: machine noise hits both alike
                    eng._host_ms.clear()
                    dt, outs[name] = _round(eng, prompts, tokens, f"r{rep}")
                    times[name].append(dt)
                    host[name].append(float(np.median(eng._host_ms)) if eng._host_ms else 0.0)
            row = {}
            for name in engines:
                t = float(np.median(times[name]))
                row[name] = {"tok_s": c * tokens / t, "ms_per_step": 1e3 * t / tokens,
                             "host_ms_per_step": float(np.median(host[name]))}
            row["overlap_speedup"] = row["overlap"]["tok_s"] / row["wait"]["tok_s"]
            row["same_tokens"] = all(o == outs["wait"] for o in outs.values())
            row["ahead_steps"] = engines["overlap"].ahead_steps
            if "multi" in engines:
                row["multi_speedup"] = row["multi"]["tok_s"] / row["overlap"]["tok_s"]
                row["multi_step_launches"] = engines["multi"].runner.multi_step_launches
            if "unrolled" in engines:
                row["layer_loop_speedup"] = row["multi"]["tok_s"] / row["unrolled"]["tok_s"]
            result["concurrency"][str(c)] = row
    finally:
        for eng in engines.values():
            eng.shutdown()
    return result


def report(r: dict) -> str:
    f = r["floors"]
    k = r.get("multi_step", 1)
    lines = [f"{r['machine']} ({r['backend']}); floors: read {f['memory_read_gbs']:.1f} GB/s, "
             f"fp32 GEMM {f['gemm_fp32_gflops']:.0f} GFLOP/s; {r['tokens']} tokens, median of {r['repeats']}",
             "concurrency | overlap tok/s | wait tok/s | overlap/wait | host ms/step (overlap, wait)"
             + (f" | multi-step {k} tok/s | multi/overlap | host ms/step (multi)" if k > 1 else "")
             + (" | layers unrolled tok/s | layer loop/unrolled" if any("unrolled" in row for row in
                                                                         r["concurrency"].values()) else "")
             + " | same tokens"]
    for c, row in r["concurrency"].items():
        o, w = row["overlap"], row["wait"]
        line = (f"{c:>11} | {o['tok_s']:13.1f} | {w['tok_s']:10.1f} | {row['overlap_speedup']:11.2f}x | "
                f"{o['host_ms_per_step']:.2f}, {w['host_ms_per_step']:.2f}")
        if "multi" in row:
            m = row["multi"]
            line += f" | {m['tok_s']:.1f} | {row['multi_speedup']:.2f}x | {m['host_ms_per_step']:.2f}"
        if "unrolled" in row:
            line += f" | {row['unrolled']['tok_s']:.1f} | {row['layer_loop_speedup']:.2f}x"
        lines.append(line + f" | {row['same_tokens']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--multi-step", type=int, default=4, help="K of the multi-step engine (1: none)")
    ap.add_argument("--unrolled-too", action="store_true",
                    help="add a multi-step engine with its loops' decoder layers unrolled")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--out", default="benchmarks/results/overlap.json")
    args = ap.parse_args()
    r = run(args.model, args.concurrency, args.tokens, args.repeats, args.multi_step, args.load_format,
            args.unrolled_too)
    print(report(r))
    write_json(r, args.out)


if __name__ == "__main__":
    main()
