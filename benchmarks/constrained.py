"""Greedy constrained decoding in multi-step calls against one step a call, side by side on one engine: output
tokens per second of answers constrained to a JSON schema (or a regex), the same answers unconstrained, and
where the grammar refused a token a multi-step call had sampled without its mask, next to this machine's floors.

    python -m benchmarks.constrained [--model smollm2] [--repeats 5] [--concurrency 1 4 16] [--max-tokens 160]
        [--workloads quote_json ...] [--out benchmarks/results/constrained.json]

On a CPU a greedy constrained job samples its argmax without a mask and its grammar checks the token after
(`sampling.lazily_constrained`). With `Scheduler.lazy_constraints` such jobs also decode in multi-step calls (the
tokens checked as they are applied: from the first the grammar refuses, the call's rest is dropped); without it
each of their tokens is one call. One engine, each workload warmed first (its shapes compiled outside the
timing), then both modes in turns, the order alternating, `--repeats` times: medians, and their ratio. Timing
starts after the prompts are filled: it is the decode of the answers, forced tokens (fast-forward) included.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from benchmarks.speculative import DOC, cases, generate_round, rounds_parser
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import load_model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "occupation": {"type": "string", "maxLength": 32},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "married": {"type": "boolean"}},
    "required": ["name", "age", "city", "occupation", "hobbies", "married"], "additionalProperties": False}
# name: (prompt, sampling): long strings (most tokens free), short fields (most forced), a regex
WORKLOADS: dict[str, tuple[str, dict]] = {
    "summary_json": (f"Summarize this text in three sentences, as JSON:\n\n{DOC}", {"json_schema": {
        "type": "object", "properties": {"title": {"type": "string"}, "summary": {"type": "string"}},
        "required": ["title", "summary"]}}),
    "person_json": ("Describe a baker in Vienna as a JSON object with the keys name, age, city, occupation, "
                    "hobbies, married.", {"json_schema": PERSON}),
    "list_regex": ("List five fruits, one per line, each line starting with a dash.",
                   {"regex": r"(- [A-Za-z ]{1,20}\n){5}"}),
}


def run(model: str, repeats: int, concurrency: list[int], max_tokens: int, workloads: list[str] | None) -> dict:
    loaded = load_model(model, progress=False)
    eng = LLMEngine(loaded, EngineConfig(kv_memory_mb=512, precompile=False)).start()
    result: dict = {"model": model, "backend": jax.default_backend(), "machine": procinfo.cpu_name(),
                    "floors": floors.measure(), "repeats": repeats, "max_tokens": max_tokens,
                    "multi_step": eng.runner.multi_step, "lazy": eng.runner.lazy_masks, "runs": {}}
    print(f"CPU {result['machine']}; floors: read {result['floors']['memory_read_gbs']:.1f} GB/s, fp32 GEMM "
          f"{result['floors']['gemm_fp32_gflops']:.0f} GFLOP/s; {eng.runner.multi_step} decode steps a call")
    if not eng.runner.lazy_masks:
        print("this device computes masks beside its steps: constrained jobs run one step a call here")
    sched = eng.scheduler
    modes = {"multi_step": True, "single_step": False}
    try:
        for c, name, prompt, sampling in cases(loaded, WORKLOADS, concurrency, workloads):
            for on in modes.values():  # shapes compiled outside the timing
                sched.lazy_constraints = on
                generate_round(eng, prompt, c, max_tokens, "warm", sampling)
            times: dict[str, list[float]] = {k: [] for k in modes}
            outs: dict[str, list] = {}
            counts = {k: [0, 0] for k in modes}  # tokens multi-step calls sampled that grammars took, refused
            for rep in range(repeats):
                order = list(modes) if rep % 2 == 0 else list(reversed(modes))  # in turns
                for key in order:
                    sched.lazy_constraints = modes[key]
                    before = (sched.unchecked_tokens, sched.unchecked_refusals)
                    dt, outs[key] = generate_round(eng, prompt, c, max_tokens, f"r{rep}", sampling)
                    times[key].append(dt)
                    counts[key][0] += sched.unchecked_tokens - before[0]
                    counts[key][1] += sched.unchecked_refusals - before[1]
            sched.lazy_constraints = eng.runner.lazy_masks
            n_tokens = sum(len(o) for o in outs["single_step"])
            free_dt, _ = generate_round(eng, prompt, c, max(1, n_tokens // c), "free",
                                        {"ignore_eos": True})  # as many tokens without a constraint
            row: dict = {"prompt_tokens": len(prompt), "output_tokens": n_tokens,
                         "same_tokens": outs["multi_step"] == outs["single_step"],
                         "unconstrained_tok_s": n_tokens / free_dt}
            for key in modes:
                t = float(np.median(times[key]))
                taken, refused = counts[key]
                row[key] = {"tok_s": n_tokens / t, "seconds": t, "unchecked_tokens": taken / repeats,
                            "refused_tokens": refused / repeats}
            row["ratio"] = row["multi_step"]["tok_s"] / row["single_step"]["tok_s"]
            result["runs"][f"{name}@c{c}"] = row
            m = row["multi_step"]
            print(f"{name:13s} c={c:<2d} {n_tokens:4d} tokens: multi-step {m['tok_s']:6.1f} tok/s, one step a "
                  f"call {row['single_step']['tok_s']:6.1f} ({row['ratio']:.2f}x); unconstrained "
                  f"{row['unconstrained_tok_s']:6.1f}; {m['unchecked_tokens']:.0f} tokens taken unchecked, "
                  f"{m['refused_tokens']:.0f} refused a round; same tokens: {row['same_tokens']}", flush=True)
    finally:
        eng.shutdown()
    return result


def main() -> None:
    ap = rounds_parser(__doc__, [1, 4, 16])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None)
    ap.add_argument("--out", default="benchmarks/results/constrained.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = run(args.model, args.repeats, args.concurrency, args.max_tokens, args.workloads)
    result["wall_s"] = time.perf_counter() - t0
    write_json(result, args.out)


if __name__ == "__main__":
    main()
