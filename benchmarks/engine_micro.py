"""Engine micro-benchmark: load, compile, prefill and decode on the default model, next to this
machine's floors measured in the same run.

    python -m benchmarks.engine_micro [--model smollm2] [--out benchmarks/results/engine_micro.json]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from parrot.config import EngineConfig
from parrot.engine.batch import SequenceSlice, build_batch
from parrot.engine.loader import load_model
from parrot.engine.runner import ModelRunner, Shape


def _time_steps(fn, repeats: int) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(model: str, prompt_len: int, decode_ctx: int, batches: list[int], repeats: int) -> dict:
    t0 = time.perf_counter()
    loaded = load_model(model)
    t_read = time.perf_counter() - t0
    cfg = EngineConfig(model=model, kv_memory_mb=2048, compilation_cache_dir=None)
    runner = ModelRunner(loaded.config, loaded.weights, cfg)
    jax.block_until_ready(runner.state)
    t_load = time.perf_counter() - t0
    ps = runner.page_size
    result: dict = {
        "model": loaded.source, "params": loaded.config.num_params, "decode_weight_dtype": str(runner.dtype),
        "prefill_weight_dtype": str(runner.prefill_dtype), "activation_dtype": str(runner.act_dtype),
        "load_s": t_load, "load_read_dequant_s": t_read, "compile_s": {}, "jax": jax.__version__,
        "backend": jax.default_backend(), "machine": platform.processor() or platform.machine(),
    }

    def step(shape: Shape, seqs: list[SequenceSlice]):  # noqa: ANN202
        batch = jax.device_put(build_batch(seqs, ps, shape.tokens, shape.batch, shape.q_len, shape.pages))

        def go() -> None:
            runner.sample(runner.forward(batch), None)  # forward + greedy sample, host sync

        t = time.perf_counter()
        go()
        result["compile_s"][f"tokens={shape.tokens},batch={shape.batch},kv={shape.pages * ps}"] = (
            time.perf_counter() - t)
        return go

    # prefill: one prompt of prompt_len tokens
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, loaded.config.vocab_size, prompt_len).tolist()
    pages = list(range(1, 1 + -(-prompt_len // ps)))
    go = step(runner.prefill_shape(1, prompt_len, prompt_len), [SequenceSlice(prompt, 0, pages)])
    t_prefill = float(np.median(_time_steps(go, repeats)))
    result["prefill"] = {"tokens": prompt_len, "median_s": t_prefill, "tokens_per_s": prompt_len / t_prefill}

    # decode: each sequence has decode_ctx - 1 tokens cached and decodes one more
    per_seq = -(-decode_ctx // ps)
    result["decode"] = {}
    for b in batches:
        seqs = [SequenceSlice([int(rng.integers(100, 1000))], decode_ctx - 1,
                              list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(b)]
        go = step(runner.decode_shape(b, decode_ctx), seqs)
        ms = float(np.median(_time_steps(go, repeats * 2))) * 1e3
        result["decode"][f"batch_{b}"] = {"context": decode_ctx, "ms_per_step": ms, "tokens_per_s": b * 1e3 / ms}

    fl = floors.measure()
    weight_bytes = loaded.config.num_params * runner.dtype.itemsize  # the weights a decode step reads
    decode_floor_ms = weight_bytes / (fl["memory_read_gbs"] * 1e9) * 1e3
    prefill_floor = fl["gemm_fp32_gflops"] * 1e9 / (2 * loaded.config.num_params)
    result["floors"] = fl | {
        "weight_bytes": weight_bytes, "decode_floor_ms": decode_floor_ms, "prefill_floor_tokens_per_s": prefill_floor,
    }
    result["ratios"] = {
        "decode_batch_1_over_floor": result["decode"].get("batch_1", {}).get("ms_per_step", float("nan"))
        / decode_floor_ms,
        "prefill_fraction_of_floor": result["prefill"]["tokens_per_s"] / prefill_floor,
    }
    return result


def report(r: dict) -> str:
    lines = [
        f"model {Path(r['model']).name} ({r['params'] / 1e6:.1f}M params, {r['backend']}; weights: prefill "
        f"{r['prefill_weight_dtype']}, decode {r['decode_weight_dtype']}; activations {r['activation_dtype']})",
        f"load: {r['load_s']:.2f} s (read + dequantize {r['load_read_dequant_s']:.2f} s)",
    ]
    lines += [f"compile {k}: {v:.2f} s" for k, v in r["compile_s"].items()]
    p = r["prefill"]
    fl = r["floors"]
    lines.append(f"prefill {p['tokens']} tokens: {p['median_s']:.3f} s = {p['tokens_per_s']:.0f} tok/s "
                 f"(fp32 floor {fl['prefill_floor_tokens_per_s']:.0f} tok/s at {fl['gemm_fp32_gflops']:.0f} GFLOP/s; "
                 f"{r['ratios']['prefill_fraction_of_floor']:.0%} of floor)")
    for name, d in r["decode"].items():
        lines.append(f"decode {name} (context {d['context']}): {d['ms_per_step']:.1f} ms/step = "
                     f"{d['tokens_per_s']:.0f} tok/s")
    lines.append(f"decode floor: {fl['weight_bytes'] / 1e6:.0f} MB weights / {fl['memory_read_gbs']:.1f} GB/s = "
                 f"{fl['decode_floor_ms']:.1f} ms/step; batch 1 is "
                 f"{r['ratios']['decode_batch_1_over_floor']:.2f}x the floor")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/engine_micro.json")
    args = ap.parse_args()
    r = run(args.model, args.prompt_len, args.decode_context, args.batches, args.repeats)
    print(report(r))
    write_json(r, args.out)


if __name__ == "__main__":
    main()
