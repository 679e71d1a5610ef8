"""Differential run: every job of a random concurrent mix gives what it gives alone.

    python -m benchmarks.differential [--rounds 8] [--seed 0] [--kv-memory-mb 10] [--speculative-tokens 4]
                                      [--max-batch-size N]

Each round submits 4-14 jobs to one engine at once (staggered by 0-200 ms), drawn from: greedy plain, stop
strings, seeded sampling (temperature, top-p, top-k), a JSON schema, a regex, a choice, logprobs, presence and
frequency penalties, a text to repeat (prompt-lookup drafts, with `--speculative-tokens`), forks of one shared
prompt, and two-turn conversations whose contexts wait idle between the turns. Then it runs each job alone on
the same engine and compares: the tokens, the finish reason and the logprobs, bit for bit where the native CPU
kernels compute the steps (a row's bits do not depend on its batch), within 1e-4 on XLA's paths. A small KV pool
(`--kv-memory-mb`) makes the engine preempt running jobs and evict idle contexts, whose KV is then recomputed;
each job is latency-critical (priority 0) or throughput work (1) at random, so a small batch (`--max-batch-size`)
makes the engine preempt throughput jobs for latency-critical ones too (priority preemption).
Prints each round and every job that differed (where its tokens first did); writes JSON; exits 1 if any did.
A correctness check under load, not a speed test: it guards batching, forks, preemption, eviction, drafts and
constraints together (docs/benchmarks.md, "Recomputed contexts fed as they were first fed").
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import jax

from benchmarks.report import write_json
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine import kernels
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import load_model
from parrot.protocol import FillRequest, GenerateRequest, GenerateResponse, SamplingParams

TOPICS = ["the sea", "a cat named Tom", "prime numbers", "Paris in winter", "how bread is made", "a robot",
          "the moon landing", "a short poem about rain"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
KINDS = ["plain", "stop", "seeded", "json", "regex", "choice", "logprobs", "penalty", "repeat", "fork", "conversation"]
PARENT = "differential-parent"  # the forks' shared prompt
FOLLOW_UP = "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
TIMEOUT = 600


@dataclass
class Case:
    """One job of a round: what it asks, and what it gave (a list of replies: two for a conversation)."""

    kind: str
    prompt: list[int]
    sampling: dict
    parent: str | None = None
    priority: int = 0  # the engine queue priority of its primitives (0 latency-critical, 1 throughput)
    replies: dict[str, list[GenerateResponse] | str] = field(default_factory=dict)  # "together" / "alone"


def make_case(rng: random.Random, eng: LLMEngine, i: int) -> Case:
    tok = eng.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    kind = rng.choice(KINDS)
    topic = rng.choice(TOPICS)
    case = Case(kind, chat(f"Tell me about {topic}."), {"max_tokens": rng.randint(8, 70)}, priority=rng.randint(0, 1))
    sp = case.sampling
    if kind == "stop":
        sp["stop"] = [rng.choice([".", ",", " the", "\n"])]
    elif kind == "seeded":
        sp.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 40]),
                  seed=rng.randint(0, 1000))
    elif kind == "json":
        case.prompt = chat(f"Describe {topic} as a JSON object with name, age and tags.")
        sp.update(json_schema=SCHEMA, max_tokens=80)
    elif kind == "regex":
        sp["regex"] = r"[A-Z][a-z]+( [a-z]+){2,6}\."
    elif kind == "choice":
        case.prompt = chat(f"Is {topic} nice? Answer yes or no.")
        sp["choice"] = ["yes", "no", "maybe not"]
    elif kind in ("logprobs", "conversation"):
        sp["logprobs"] = rng.choice([0, 2])
    elif kind == "penalty":
        sp.update(presence_penalty=0.8, frequency_penalty=0.3)
    elif kind == "repeat":
        case.prompt = chat(f"Repeat exactly: {topic} is blue and {topic} is red and {topic} is blue and {topic} "
                           "is red.")
        sp["max_tokens"] = 40
    elif kind == "fork":
        case.parent = PARENT
        case.prompt = tok.encode(f" Question {i}: what about {topic}? Answer:")
    return case


def run_case(eng: LLMEngine, case: Case, ctx: str, label: str, pause_s: float) -> None:
    """Fill, generate (and for a conversation: wait, fill the follow-up, generate again), free; the replies or
    the error go to `case.replies[label]`."""
    try:
        eng.fill_future(FillRequest(context_id=ctx, parent_context_id=case.parent, token_ids=case.prompt,
                                    priority=case.priority)).result(TIMEOUT)
        sampling = SamplingParams(**case.sampling)
        replies = [eng.generate_future(GenerateRequest(context_id=ctx, sampling=sampling,
                                                       priority=case.priority)).result(TIMEOUT)]
        if case.kind == "conversation":
            time.sleep(pause_s)  # idle: other jobs may take its KV
            follow = eng.tokenizer.encode(FOLLOW_UP)
            eng.fill_future(FillRequest(context_id=ctx, token_ids=follow, priority=case.priority)).result(TIMEOUT)
            replies.append(eng.generate_future(GenerateRequest(context_id=ctx, sampling=sampling,
                                                               priority=case.priority)).result(TIMEOUT))
        case.replies[label] = replies
    except Exception as exc:  # noqa: BLE001  (a failure is a difference to report, not a crash of the run)
        case.replies[label] = repr(exc)
    finally:
        eng.free_future(ctx).result(TIMEOUT)


def difference(together: list[GenerateResponse] | str, alone: list[GenerateResponse] | str,
               exact: bool) -> str | None:
    """Where two runs of a case differ (None: they agree)."""
    if isinstance(together, str) or isinstance(alone, str):
        return None if together == alone else f"errors: {together!r} / {alone!r}"
    for turn, (a, b) in enumerate(zip(together, alone, strict=True)):
        if a.token_ids != b.token_ids:
            first = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                         min(len(a.token_ids), len(b.token_ids)))
            return f"reply {turn}: tokens differ from token {first} ({len(a.token_ids)} / {len(b.token_ids)} tokens)"
        if a.finish_reason != b.finish_reason:
            return f"reply {turn}: finish {a.finish_reason} / {b.finish_reason}"
        for k, (x, y) in enumerate(zip(a.logprobs or [], b.logprobs or [], strict=True)):
            values = [(x.logprob, y.logprob)] + [(p.logprob, q.logprob) for p, q in zip(x.top, y.top, strict=True)]
            far = max((abs(p - q) for p, q in values if p is not None and q is not None), default=0.0)
            if (far > 0 if exact else far > 1e-4) or [p.token_id for p in x.top] != [q.token_id for q in y.top]:
                return f"reply {turn}: logprobs differ at token {k} (by {far:.3g})"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-memory-mb", type=int, default=10, help="a small pool: preemption and eviction")
    ap.add_argument("--speculative-tokens", type=int, default=4, help="0: no prompt-lookup drafts")
    ap.add_argument("--max-batch-size", type=int, default=None, help="a small batch: priority preemption")
    ap.add_argument("--out", default="benchmarks/results/differential.json")
    args = ap.parse_args()
    batch = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
    eng = LLMEngine(load_model(args.model), EngineConfig(model=args.model, kv_memory_mb=args.kv_memory_mb,
                                                         speculative_tokens=args.speculative_tokens,
                                                         precompile=False, **batch)).start()
    exact = kernels.available()
    print(f"CPU {procinfo.cpu_name()}, backend {jax.default_backend()}; logprobs compared "
          f"{'bit for bit' if exact else 'within 1e-4'}; KV pool {args.kv_memory_mb} MB, "
          f"speculative tokens {args.speculative_tokens}, batch {eng.cfg.max_batch_size}", flush=True)
    rounds: list[dict] = []
    differed = 0
    try:
        tok = eng.tokenizer
        parent_prompt = tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": "You are a helpful assistant that answers in one sentence. " * 6}]))
        for rnd in range(args.rounds):
            rng = random.Random(args.seed * 1000 + rnd)
            cases = [make_case(rng, eng, i) for i in range(rng.randint(4, 14))]
            eng.fill_future(FillRequest(context_id=PARENT, token_ids=parent_prompt)).result(TIMEOUT)
            threads = [threading.Thread(target=run_case, args=(eng, c, f"r{rnd}-t{i}", "together", 0.3))
                       for i, c in enumerate(cases)]
            for t in threads:
                t.start()
                time.sleep(rng.choice([0, 0, 0.01, 0.05, 0.2]))
            for t in threads:
                t.join()
            for i, c in enumerate(cases):
                run_case(eng, c, f"r{rnd}-a{i}", "alone", 0.0)
            eng.free_future(PARENT).result(TIMEOUT)
            found = [(i, c, difference(c.replies["together"], c.replies["alone"], exact)) for i, c in enumerate(cases)]
            found = [(i, c, d) for i, c, d in found if d is not None]
            differed += len(found)
            for i, c, d in found:
                print(f"  round {rnd}, job {i} ({c.kind}, {c.sampling}): {d}", flush=True)
            ping = eng.ping()
            rounds.append({"jobs": [c.kind for c in cases], "differed": [{"job": i, "kind": c.kind, "where": d}
                                                                          for i, c, d in found]})
            print(f"round {rnd}: {len(cases)} jobs, {len(found)} differed; so far {ping.preemptions} preemptions "
                  f"({ping.priority_preemptions} for priority), {ping.evictions} evictions, {ping.spec_steps} verify "
                  "steps", flush=True)
        ping = eng.ping()
    finally:
        eng.shutdown()
    jobs = sum(len(r["jobs"]) for r in rounds)
    print(f"{differed} of {jobs} jobs differed from their runs alone")
    write_json({"model": args.model, "backend": jax.default_backend(), "machine": procinfo.cpu_name(),
                "exact_logprobs": exact, "kv_memory_mb": args.kv_memory_mb,
                "speculative_tokens": args.speculative_tokens, "seed": args.seed, "jobs": jobs, "differed": differed,
                "max_batch_size": eng.cfg.max_batch_size, "preemptions": ping.preemptions,
                "priority_preemptions": ping.priority_preemptions, "evictions": ping.evictions,
                "spec_steps": ping.spec_steps,
                "rounds": rounds}, args.out)
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
