"""Replay engine_serving's throughput round with an accelerator's scheduling settings on any machine, and count
the steps the engine takes: prompt passes, their padded tokens, decode passes and loop calls. The scheduling is
the engine's own (a tiny random model, XLA's kernels: the gathered attention an accelerator runs, no mixed
steps); the step costs are not an accelerator's, so the wall times printed are not its figures, only the step
sequence is. For scheduling work without a GPU.

    python -m benchmarks.step_replay [--concurrency 16] [--repeats 3] [--out benchmarks/results/step_replay.json]

Settings compared, each with engine_serving's buckets (decode batches up to 64, KV buckets 256-2048):
- `fixed`: the prefill settings of the GPU runs of 2026-11-24 and 11-27 (engine_serving's 512-token steps,
  prompts batched 1 or 4, 256 prompt tokens between decode bursts);
- `device`: the accelerator defaults (device.ACCELERATOR_DEFAULTS, device.auto_decode_bursts).
Both run multi-step decode as accelerators do (4 steps a call for batches of up to 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("PARROT_CPU_KERNELS", "0")  # attention as an accelerator runs it: gathered, no mixed steps

import numpy as np  # noqa: E402

from benchmarks.engine_serving import FIXED_PREFILL, SERVING_BUCKETS, throughput  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from parrot import procinfo  # noqa: E402
from parrot.config import EngineConfig  # noqa: E402
from parrot.engine.batch import pick_bucket  # noqa: E402
from parrot.engine.device import auto_decode_bursts, for_device  # noqa: E402
from parrot.engine.engine import LLMEngine  # noqa: E402
from parrot.engine.loader import load_model  # noqa: E402
from parrot.engine.step_trace import StepTrace  # noqa: E402


def settings(name: str) -> EngineConfig:
    """engine_serving's configuration as an accelerator resolves it, with `name`'s prefill settings."""
    cfg = for_device(EngineConfig(model="tiny-llama", kv_memory_mb=256, max_batch_size=64, **SERVING_BUCKETS,
                                  explicit=("max_batch_size", "bs_buckets")), "gpu")
    if name == "fixed":
        cfg = dataclasses.replace(cfg, max_num_batched_tokens=FIXED_PREFILL["max_num_batched_tokens"],
                                  prefill_bs_buckets=FIXED_PREFILL["prefill_bs_buckets"],
                                  decode_bursts=FIXED_PREFILL["decode_bursts"])
    else:
        cfg = dataclasses.replace(cfg, decode_bursts=auto_decode_bursts(cfg, "gpu"))
    return cfg


def count(steps: list[dict], cfg: EngineConfig) -> dict:
    """The step sequence's counts, from the engine's step trace (step_trace.py)."""
    prompt = [s for s in steps if s["prefill"]]
    padded = sum(pick_bucket(len(s["prefill"]), cfg.prefill_bs_buckets)
                 * pick_bucket(max(n for _, n in s["prefill"]), cfg.token_buckets) for s in prompt)
    last_fill = max((i for i, s in enumerate(steps) if s["prefill"]), default=-1)
    return {"steps": len(steps), "prompt_passes": len(prompt),
            "prompt_tokens": sum(n for s in prompt for _, n in s["prefill"]), "padded_prompt_tokens": padded,
            "prompts_per_pass": [len(s["prefill"]) for s in prompt],
            "decode_passes_until_last_fill": sum(1 for s in steps[: last_fill + 1] if s["decode"]),
            "loop_calls_until_last_fill": sum(1 for s in steps[: last_fill + 1] if s["steps"] > 1),
            "decode_passes": sum(1 for s in steps if s["decode"]),
            "loop_calls": sum(1 for s in steps if s["steps"] > 1)}


def replay(name: str, conc: int, repeats: int, prompt_len: int, out_len: int) -> dict:
    cfg = settings(name)
    eng = LLMEngine(load_model("tiny-llama", load_format="dummy", progress=False), cfg)
    eng.runner.precompile(progress=False)
    eng.start(precompile=False)
    rng = np.random.default_rng(0)
    runs = []
    try:
        throughput(eng, rng, conc, prompt_len, 8)  # warm
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(repeats):
                prefix = f"{tmp}/trace{r}"
                eng.trace = StepTrace(prefix)
                throughput(eng, rng, conc, prompt_len, out_len)
                eng.trace.close()
                (path,) = Path(tmp).glob(f"trace{r}.*")
                runs.append(count([json.loads(line) for line in path.read_text().splitlines()], cfg))
        misses = eng.ping().shape_misses
    finally:
        eng.shutdown()
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0] if k != "prompts_per_pass"}
    return {"settings": {"max_num_batched_tokens": cfg.max_num_batched_tokens,
                         "prefill_bs_buckets": cfg.prefill_bs_buckets, "decode_bursts": cfg.decode_bursts,
                         "prefill_tokens_beside_decodes": cfg.prefill_tokens_beside_decodes,
                         "multi_step": cfg.multi_step, "multi_step_max_batch": cfg.multi_step_max_batch},
            "median": med, "runs": runs, "shape_misses": misses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/step_replay.json")
    args = ap.parse_args()
    result: dict = {"concurrency": args.concurrency, "prompt_len": args.prompt_len, "out_len": args.out_len,
                    "repeats": args.repeats, "machine": procinfo.cpu_name()}
    for name in ("fixed", "device"):
        r = result[name] = replay(name, args.concurrency, args.repeats, args.prompt_len, args.out_len)
        m = r["median"]
        print(f"{name:6s} {r['settings']}: {m['prompt_passes']:.0f} prompt passes ({m['padded_prompt_tokens']:.0f} "
              f"padded tokens for {m['prompt_tokens']:.0f}), {m['decode_passes_until_last_fill']:.0f} decode passes "
              f"({m['loop_calls_until_last_fill']:.0f} loops) until the last prompt filled; {m['decode_passes']:.0f} "
              f"decode passes in all (medians of {args.repeats}); per pass {r['runs'][0]['prompts_per_pass']}; "
              f"shape misses {r['shape_misses']}", flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
