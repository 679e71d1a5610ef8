"""A sequence's KV pages in runs (`parrot.engine.page_pool`, the default) against pages handed out as a stack
(`PARROT_PAGE_RUNS=0`, before runs), in one process, in turns: decode steps of a batch of long sequences while
requests come and go, how many of the sequences' page pairs lie one after the other, and how many pages were
ever written against the most in use at once (a CPU's pool is resident where it was ever written).

    python -m benchmarks.page_runs [--model smollm2] [--batch 16] [--prompt-len 400] [--tokens 128] [--rounds 4]

Each round, every engine fills the prompts of the sequences it lacks (distinct texts of `--prompt-len`
tokens), decodes `--tokens` greedy tokens in all `--batch` sequences at once (timed), then frees half of
them: the next round's new prompts take their pages, as requests that come and go do. Prints decode tokens a
second and a step's milliseconds per round, the fraction of consecutive pages, the CPU's name and this machine's
floors; writes JSON.
"""

from __future__ import annotations

import argparse
import os
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

SETTINGS = {"runs": "1", "stack": "0"}  # PARROT_PAGE_RUNS of each engine


def _engine(loaded: object, runs: str, kv_memory_mb: int, batch: int) -> LLMEngine:
    before = os.environ.get("PARROT_PAGE_RUNS")
    os.environ["PARROT_PAGE_RUNS"] = runs  # read as the engine's KV pool is built
    try:
        return LLMEngine(loaded, EngineConfig(kv_memory_mb=kv_memory_mb, precompile=False,
                                              max_batch_size=max(batch, 1))).start()
    finally:
        if before is None:
            del os.environ["PARROT_PAGE_RUNS"]
        else:
            os.environ["PARROT_PAGE_RUNS"] = before


def _consecutive(eng: LLMEngine, ids: list[str]) -> float:
    """The fraction of the contexts' page pairs that lie one after the other."""
    pairs = [np.diff(eng.kv.get(c).pages) == 1 for c in ids]
    return float(np.concatenate(pairs).mean()) if pairs else 1.0


def run(model: str, batch: int, prompt_len: int, tokens: int, rounds: int, kv_memory_mb: int) -> dict:
    loaded = load_model(model, progress=False)
    tok = loaded.tokenizer
    text = " ".join(f"Parrot number {i} flew over the hills, counted {i * 7} trees and sang about it."
                    for i in range(4000))
    words = tok.encode(text)
    engines = {name: _engine(loaded, runs, kv_memory_mb, batch) for name, runs in SETTINGS.items()}
    result: dict = {"model": model, "machine": procinfo.cpu_name(), "backend": jax.default_backend(),
                    "floors": floors.measure(), "batch": batch, "prompt_len": prompt_len, "tokens": tokens,
                    "rounds": [], "kv_memory_mb": kv_memory_mb}
    live: dict[str, list[str]] = {name: [] for name in engines}
    peak = dict.fromkeys(engines, 0)  # the most pages the sequences held at once (at the end of a round's decode)
    made = 0
    try:
        for r in range(rounds + 1):  # round 0 compiles and warms: not reported
            row: dict = {}
            new = batch - len(live["runs"])
            prompts = [words[(made + i) * 97 % (len(words) - prompt_len):][:prompt_len] for i in range(new)]
            ids = [f"s{made + i}" for i in range(new)]
            made += new
            for name, eng in engines.items():  # in turns: this machine's noise hits both alike
                for c, p in zip(ids, prompts, strict=True):
                    eng.fill_future(FillRequest(context_id=c, token_ids=p)).result()
                live[name] += ids
                eng._step_ms.clear()
                t0 = time.perf_counter()
                futs = [eng.generate_future(GenerateRequest(context_id=c, sampling=SamplingParams(
                    max_tokens=tokens, ignore_eos=True))) for c in live[name]]
                outs = [f.result().token_ids for f in futs]
                dt = time.perf_counter() - t0
                peak[name] = max(peak[name], sum(len(eng.kv.get(c).pages) for c in live[name]))
                row[name] = {"tok_s": batch * tokens / dt, "step_ms": float(np.median(eng._step_ms)),
                             "consecutive": _consecutive(eng, live[name]), "tokens": outs,
                             "written_pages": eng.kv.num_written_pages, "peak_pages": peak[name]}
                for c in live[name][::2]:  # half go; the next round's prompts take their pages
                    eng.free_future(c).result()
                live[name] = live[name][1::2]
            same = row["runs"].pop("tokens") == row["stack"].pop("tokens")
            if r == 0:
                continue
            row["same_tokens"] = same
            row["speedup"] = row["runs"]["tok_s"] / row["stack"]["tok_s"]
            result["rounds"].append(row)
    finally:
        for eng in engines.values():
            eng.shutdown()
    speedups = [row["speedup"] for row in result["rounds"]]
    result["median_speedup"] = float(np.median(speedups)) if speedups else None
    return result


def report(r: dict) -> str:
    f = r["floors"]
    lines = [f"{r['machine']} ({r['backend']}), {r['model']}; floors: read {f['memory_read_gbs']:.1f} GB/s, fp32 GEMM "
             f"{f['gemm_fp32_gflops']:.0f} GFLOP/s; {r['batch']} sequences of {r['prompt_len']} prompt tokens, "
             f"{r['tokens']} decoded",
             "round | runs tok/s, step ms, consecutive pages, pages ever written / most in use | stack (the same) "
             "| runs / stack | same tokens"]

    def cols(a: dict) -> str:
        return (f"{a['tok_s']:.1f}, {a['step_ms']:.1f}, {a['consecutive']:.2f}, "
                f"{a['written_pages'] / max(a['peak_pages'], 1):.2f}x")

    for i, row in enumerate(r["rounds"], 1):
        lines.append(f"{i:>5} | {cols(row['runs'])} | {cols(row['stack'])} | {row['speedup']:.3f}x | "
                     f"{row['same_tokens']}")
    if r["median_speedup"] is not None:
        lines.append(f"median runs / stack: {r['median_speedup']:.3f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-memory-mb", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/page_runs.json")
    args = ap.parse_args()
    r = run(args.model, args.batch, args.prompt_len, args.tokens, args.rounds, args.kv_memory_mb)
    print(report(r))
    write_json(r, args.out)


if __name__ == "__main__":
    main()
