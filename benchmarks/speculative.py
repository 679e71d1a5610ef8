"""Speculative decoding by prompt lookup against plain decoding, side by side in one process: output tokens per
second of greedy chat answers that copy from their prompt (a text repeated, sentences quoted, a function
rewritten), of one that does not (a story), of a sampled one (temperature 0.7, seeded), of one asking for
logprobs (whose plain decoding runs a step at a time: its sampling is processed on the host) and of answers
constrained to a JSON schema (masked by their grammars), the share of draft tokens the model confirmed and the
tokens a verify step gave, next to this machine's floors.

    python -m benchmarks.speculative [--model smollm2] [--speculative-tokens 4] [--repeats 5]
        [--concurrency 1 4] [--max-tokens 160] [--ngram 2 3] [--workloads repeat ...]
        [--out benchmarks/results/speculative.json]

Two engines on one model, each warmed on every workload first (its shapes compiled outside the timing); then
the workloads run on both in turns, the order alternating, `--repeats` times: medians, and their ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import time
from collections.abc import Iterator

import jax
import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel, load_model
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams

DOC = ("Parrot serves LLM applications rather than single requests. Its prompts are templates whose placeholders "
       "are bound to semantic variables, so the server sees which calls feed which. The serve layer builds the "
       "graph between requests, decides which calls are latency-critical, groups related tasks and shares "
       "prompt prefixes between them. The engine runs the calls with continuous batching, a paged KV cache "
       "and compiled steps, and its native CPU kernels multiply the quantized weights as the file stores them.")
CODE = '''def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out'''
# name: (prompt, sampling): greedy, and one sampled as OpenAI requests are by default (seeded: the same tokens)
WORKLOADS: dict[str, tuple[str, dict]] = {
    "repeat": (f"Repeat the following text exactly, word for word:\n\n{DOC}", {}),
    "quote": (f"Quote, word for word, the sentences of this text that mention the engine or the server:\n\n{DOC}", {}),
    "code": (f"Add type hints to this Python function and return the whole function:\n\n```python\n{CODE}\n```",
             {}),
    "story": ("Write a short story about a parrot who learns to read.", {}),
    "repeat_t0.7": (f"Repeat the following text exactly, word for word:\n\n{DOC}", {"temperature": 0.7, "seed": 1}),
    "repeat_logprobs": (f"Repeat the following text exactly, word for word:\n\n{DOC}", {"logprobs": 1}),
    # constrained: the answer as JSON of a schema (its keys and punctuation forced, its strings drafted; short
    # fields leave a draft little to copy: the n-gram before a value is the schema's, not the prompt's)
    "quote_json": (f"List, word for word, the sentences of this text that mention the engine or the server, as "
                   f"JSON:\n\n{DOC}", {"json_schema": {
                       "type": "object", "properties": {"sentences": {"type": "array", "items": {"type": "string"}}},
                       "required": ["sentences"]}}),
    "extract_json": ("Ada Lovelace was born in London in 1815. She worked with Charles Babbage on the Analytical "
                     "Engine and wrote the first published algorithm meant for a machine. Give her name, birth city, "
                     "birth year and the machine she worked on as JSON.",
                     {"json_schema": {"type": "object", "properties": {
                         "name": {"type": "string"}, "city": {"type": "string"}, "year": {"type": "integer"},
                         "machine": {"type": "string"}}, "required": ["name", "city", "year", "machine"],
                         "additionalProperties": False}}),
    "repeat_json": (f"Repeat the following text exactly, word for word, as the JSON field \"text\":\n\n{DOC}",
                    {"json_schema": {"type": "object", "properties": {"text": {"type": "string"}},
                                     "required": ["text"]}}),
}


def chat_prompt(model: LoadedModel, text: str) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def generate_round(eng: LLMEngine, prompt: list[int], concurrency: int, max_tokens: int, tag: str, sampling: dict,
           ) -> tuple[float, list[list[int]]]:
    """Fill `concurrency` contexts with `prompt`, then generate in all of them at once."""
    for i in range(concurrency):
        eng.fill_future(FillRequest(context_id=f"{tag}{i}", token_ids=prompt)).result()
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        futs = [pool.submit(lambda i=i: eng.generate_future(GenerateRequest(
            context_id=f"{tag}{i}", sampling=SamplingParams(max_tokens=max_tokens, **sampling))).result().token_ids)
            for i in range(concurrency)]
        outs = [f.result() for f in futs]
    dt = time.perf_counter() - t0
    for i in range(concurrency):
        eng.free_future(f"{tag}{i}").result()
    return dt, outs


def run(model: str, spec_tokens: int, repeats: int, concurrency: list[int], max_tokens: int,
        workloads: list[str] | None = None, ngram: tuple[int, int] = (2, 3)) -> dict:
    loaded = load_model(model, progress=False)
    engines = {name: LLMEngine(loaded, EngineConfig(
        kv_memory_mb=512, precompile=False, speculative_tokens=k, speculative_min_ngram=ngram[0],
        speculative_ngram=ngram[1])).start() for name, k in (("plain", 0), ("speculative", spec_tokens))}
    result: dict = {"model": model, "backend": jax.default_backend(), "machine": procinfo.cpu_name(),
                    "floors": floors.measure(), "speculative_tokens": spec_tokens, "ngram": list(ngram),
                    "repeats": repeats, "max_tokens": max_tokens, "runs": {}}
    print(f"CPU {result['machine']}; floors: read {result['floors']['memory_read_gbs']:.1f} GB/s, fp32 GEMM "
          f"{result['floors']['gemm_fp32_gflops']:.0f} GFLOP/s")
    try:
        for c, name, prompt, sampling in cases(loaded, WORKLOADS, concurrency, workloads):
            for eng in engines.values():  # this workload's shapes compiled outside the timing
                generate_round(eng, prompt, c, max_tokens, "warm", sampling)
            spec = engines["speculative"].scheduler
            before = (spec.spec_steps, spec.spec_draft_tokens, spec.spec_accepted_tokens)
            times: dict[str, list[float]] = {k: [] for k in engines}
            outs: dict[str, list] = {}
            for rep in range(repeats):
                order = list(engines) if rep % 2 == 0 else list(reversed(engines))  # in turns
                for key in order:
                    dt, outs[key] = generate_round(engines[key], prompt, c, max_tokens, f"r{rep}", sampling)
                    times[key].append(dt)
            steps, drafted, accepted = (now - was for now, was in zip(
                (spec.spec_steps, spec.spec_draft_tokens, spec.spec_accepted_tokens), before, strict=True))
            n_tokens = sum(len(o) for o in outs["plain"])
            row: dict = {"prompt_tokens": len(prompt), "output_tokens": n_tokens}
            for key in engines:
                t = float(np.median(times[key]))
                row[key] = {"tok_s": n_tokens / t, "seconds": t}
            row["ratio"] = row["speculative"]["tok_s"] / row["plain"]["tok_s"]
            row["accepted_share"] = accepted / drafted if drafted else 0.0
            row["tokens_per_verify"] = (accepted + steps) / steps if steps else 0.0
            row["verify_steps_per_round"] = steps / repeats
            row["same_tokens"] = outs["plain"] == outs["speculative"]
            result["runs"][f"{name}_c{c}"] = row
            print(f"{name:11s} c={c}: plain {row['plain']['tok_s']:6.1f} tok/s, speculative "
                  f"{row['speculative']['tok_s']:6.1f} tok/s = {row['ratio']:.2f}x; drafts confirmed "
                  f"{row['accepted_share']:.0%}, {row['tokens_per_verify']:.2f} tokens a verify step; "
                  f"same tokens: {row['same_tokens']}", flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()
    return result


def cases(model: LoadedModel, table: dict[str, tuple[str, dict]], concurrency: list[int],
          chosen: list[str] | None) -> Iterator[tuple[int, str, list[int], dict]]:
    """Each (concurrency, workload name, its chat prompt's tokens, its sampling) of `table`, the `chosen` ones."""
    for c in concurrency:
        for name, (text, sampling) in table.items():
            if not chosen or name in chosen:
                yield c, name, chat_prompt(model, text), sampling


def rounds_parser(doc: str | None, concurrency: list[int]) -> argparse.ArgumentParser:
    """The options of a benchmark that runs rounds of one engine's modes in turns (`generate_round`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=concurrency)
    ap.add_argument("--max-tokens", type=int, default=160)
    return ap


def main() -> None:
    ap = rounds_parser(__doc__, [1, 4])
    ap.add_argument("--speculative-tokens", type=int, default=4)
    ap.add_argument("--ngram", type=int, nargs=2, default=[2, 3], metavar=("MIN", "MAX"),
                    help="the n-gram lengths matched (`--speculative-ngram`)")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), help="default: all of them")
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    args = ap.parse_args()
    result = run(args.model, args.speculative_tokens, args.repeats, args.concurrency, args.max_tokens,
                 args.workloads, tuple(args.ngram))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
