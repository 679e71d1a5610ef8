"""Tensor parallelism: per-device memory of a sharded model, and step throughput per device.

    python -m benchmarks.tensor_parallel [--quick] [--out benchmarks/results/tensor_parallel.json]

Every tensor-parallel size runs in its own process with that many devices: on a CPU, virtual devices
(`--xla_force_host_platform_device_count`).

- memory: the Llama-3-8B shape with dummy bf16 weights, at tp = 1, 2, 4. The model is built with one
  decoder layer (every layer runs the same compiled block, so one is enough to compile and measure) and
  the figures are scaled to its 32 layers: weights per device from the sharded arrays, and per call
  the argument / output / temporary bytes of the compiled executables (`memory_analysis()`).
- throughput: the default model's decode step (context 512) at batch 1 and 16, at tp = 1 and 2, with
  tokens/s per device. Virtual CPU devices share the same cores and memory bandwidth, so this shows
  what the collectives and the per-call waits cost, never a speed-up: that needs devices of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from benchmarks.report import write_json

LAYERS_8B = 32


def _child_memory(tp: int) -> dict:
    import jax
    import numpy as np

    from parrot.config import EngineConfig
    from parrot.engine.dummy_weights import PRESETS, dummy_weights
    from parrot.engine.runner import ModelRunner

    cfg = dataclasses.replace(PRESETS["llama-3-8b"], num_layers=1)
    weights = {k: np.asarray(v) for k, v in dummy_weights(cfg, jax.numpy.bfloat16).items()}
    ecfg = EngineConfig(tensor_parallel_size=tp, dtype="bfloat16", kv_pages=64, compilation_cache_dir=None,
                        token_buckets=[16, 512], bs_buckets=[1, 16], max_batch_size=16, kv_buckets=[1024])
    r = ModelRunner(cfg, weights, ecfg)
    del weights

    def shard_bytes(tree: object) -> int:
        return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))

    layer = shard_bytes(r.weights.layers[0])
    head = 0 if r.weights.head.tied else shard_bytes(r.weights.head.proj)
    other = shard_bytes(r.weights.embed) + head + shard_bytes(r.weights.head.norm)
    calls = {}
    for name, shape in (("decode_batch_16_ctx_1024", r.shapes.decode_shape(16, 1024)),
                        ("prefill_512_tokens", r.shapes.prefill_shape(1, 512, 512))):
        exe, _ = r.compiler.get(shape)
        stats = {}
        for part, fn in (("embed", exe.embed), ("layer", exe.blocks[1]), ("head", exe.head)):
            m = fn.memory_analysis()
            stats[part] = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
                           "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}
        calls[name] = stats
    per_page = 2 * r.page_size * r.model_cfg.num_kv_heads // tp * cfg.head_dim * 2  # bf16, one layer
    return {"tp": tp, "devices": jax.device_count(), "layer_weight_bytes_per_device": layer,
            "embed_head_bytes_per_device": other,
            "weights_per_device_gb": (other + LAYERS_8B * layer) / 1e9,
            "kv_bytes_per_token_per_device": per_page * LAYERS_8B // r.page_size,
            "max_temp_gb": max(s["temp_bytes"] for c in calls.values() for s in c.values()) / 1e9,
            "calls": calls}


def _child_speed(tp: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from parrot import procinfo
    from parrot.config import EngineConfig
    from parrot.engine.batch import SequenceSlice, build_batch
    from parrot.engine.loader import load_model
    from parrot.engine.runner import ModelRunner

    loaded = load_model(progress=False)
    r = ModelRunner(loaded.config, loaded.weights,
                    EngineConfig(tensor_parallel_size=tp, kv_memory_mb=512, compilation_cache_dir=None))
    ps, ctx = r.page_size, 512
    per_seq = ctx // ps
    out = {"tp": tp, "machine": procinfo.cpu_name(), "exact_mode": r.tp_exact, "decode": {}}
    rng = np.random.default_rng(0)
    for b in (1, 16):
        shape = r.shapes.decode_shape(b, ctx)
        seqs = [SequenceSlice([int(rng.integers(100, 1000))], ctx - 1,
                              list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(b)]
        batch = build_batch(seqs, ps, shape.tokens, shape.batch, shape.q_len, shape.pages)
        np.asarray(r.sample(r.forward(batch), None))  # compile
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.asarray(r.sample(r.forward(batch), None))
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times)) * 1e3
        out["decode"][f"batch_{b}"] = {"ms_per_step": ms, "tokens_per_s": b * 1e3 / ms,
                                       "tokens_per_s_per_device": b * 1e3 / ms / tp}
    out["jax_devices"] = jax.device_count()
    return out


def _spawn(kind: str, tp: int, repeats: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}")
    cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--child", kind, "--tp", str(tp),
           "--repeats", str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool) -> dict:
    from benchmarks import floors
    from parrot import procinfo

    repeats = 10 if quick else 30
    memory = [_spawn("memory", tp, repeats) for tp in (1, 2, 4)]
    speed = [_spawn("speed", tp, repeats) for tp in (1, 2)]
    return {"machine": procinfo.cpu_name(), "floors": floors.measure(), "memory_llama_3_8b_bf16": memory,
            "decode_default_model": speed}


def report(r: dict) -> str:
    fl = r["floors"]
    lines = [f"CPU {r['machine']}; floors: read {fl['memory_read_gbs']:.1f} GB/s, fp32 GEMM "
             f"{fl['gemm_fp32_gflops']:.0f} GFLOP/s",
             "Llama-3-8B shape, bf16 dummy weights, per device (weights scaled from 1 compiled layer to 32):",
             f"{'tp':>3} {'weights GB':>11} {'KV KB/token':>12} {'max temp GB':>12}"]
    for m in r["memory_llama_3_8b_bf16"]:
        kv_kb = m["kv_bytes_per_token_per_device"] / 1024
        lines.append(f"{m['tp']:>3} {m['weights_per_device_gb']:>11.2f} {kv_kb:>12.1f} {m['max_temp_gb']:>12.3f}")
    lines.append("default model decode step, context 512 (virtual CPU devices share the same cores):")
    lines.append(f"{'tp':>3} {'batch':>6} {'ms/step':>9} {'tok/s':>8} {'tok/s/device':>13}")
    for s in r["decode_default_model"]:
        for name, d in s["decode"].items():
            lines.append(f"{s['tp']:>3} {name.split('_')[1]:>6} {d['ms_per_step']:>9.1f} {d['tokens_per_s']:>8.1f} "
                         f"{d['tokens_per_s_per_device']:>13.1f}")
    base = {k: v["ms_per_step"] for k, v in r["decode_default_model"][0]["decode"].items()}
    for s in r["decode_default_model"][1:]:
        for k, v in s["decode"].items():
            lines.append(f"tp={s['tp']} / tp=1 step time, {k}: {v['ms_per_step'] / base[k]:.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    ap.add_argument("--child", choices=["memory", "speed"], help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=30, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out = _child_memory(args.tp) if args.child == "memory" else _child_speed(args.tp, args.repeats)
        print(json.dumps(out))
        return
    result = run(args.quick)
    print(report(result))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
