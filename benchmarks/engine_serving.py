"""Engine serving benchmark: many concurrent primitives on the real model through LLMEngine.

    python -m benchmarks.engine_serving [--quick] [--multi-step K] [--decode-bursts N] [--compare-bursts R]
                                        [--compare-multi-step K [K ...] [--rounds R]] [--compare-prefill R]
                                        [--temperature T [--top-p P] [--top-k K] [--min-p M]]
                                        [--out benchmarks/results/engine_serving.json]

1. Throughput vs concurrency: c clients each fill a ~256-token prompt and generate 128 tokens
   (ignore_eos; greedy, or sampled with `--temperature`, one seed per client), c in 1, 4, 16, 64.
   Aggregate output tokens/s, TTFT, inter-token latency p50/p99 and time per output token p50/p99
   (first token to last, per request).
2. Shared prefix: 16 forks of one 1,000-token context, each filling a short question and generating,
   vs 16 independent contexts holding a copy of the prefix. Wall time of each, side by side.
3. Structured output (`--structured`, or alone with `--structured-only`): c clients (c in 1, 16) ask for
   a JSON object of a schema with fixed keys, greedy; then the same clients generate as many tokens
   without a constraint; three such pairs in turns. Output tok/s of both (medians), the host time of
   each step's constraint work (masks, or on a CPU the checks of greedy tokens and the masks of those
   rejected; mean, p99), the decode steps fast-forward saved (tokens the grammar forced, fed as one
   chunk) and the sampled tokens that needed no mask.
With `--compare-bursts R`, part 1 runs with decode bursts off and on in turns (the order alternating), R
rounds of each, on one engine (the scheduler's setting switched between runs: one precompile), and reports
each mode's medians and the on/off ratios. With `--compare-multi-step 1 2 4 8` (and `--multi-step 8`), part 1
runs with each count of decode steps per call in turns, `--rounds` rounds, on the loops compiled for the
engine's count (a loop stops after its plan's steps): one precompile, each count's medians. With
`--compare-prefill R`, part 1 runs with the prefill settings of the GPU runs of 2026-11-24 and 11-27 and the
engine's own in turns (`compare_prefill`; they differ on accelerators only). The prefill budget is the
device's: 512 tokens a step on a CPU, 2048 on accelerators (before 2026-11-28, 512 everywhere).
All shapes are precompiled first; shape misses during the runs are reported (should be 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from collections.abc import Callable

import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import load_model
from parrot.engine.scheduler import AUTO_DECODE_BURSTS
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams, StreamChunk


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Client:
    """One simulated user: fill a context (optionally forked), then stream a generation."""

    def __init__(self, eng: LLMEngine, ctx: str, tokens: list[int], max_tokens: int, parent: str | None = None,
                 schema: dict | None = None, sampling: dict | None = None):
        self.eng, self.ctx, self.tokens, self.max_tokens, self.parent = eng, ctx, tokens, max_tokens, parent
        self.schema = schema  # a JSON schema the output must match (greedy, ends with the object)
        self.sampling = sampling or {}  # temperature, top_p, top_k, min_p, seed (default: greedy)
        self.text = ""
        self.token_times: list[float] = []
        self.start = 0.0
        self.end = 0.0
        self.error: BaseException | None = None  # what ended the client, if anything did

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by run_clients, after every client ended
            self.error = exc

    def _run(self) -> None:
        self.start = time.perf_counter()
        self.eng.fill_future(FillRequest(context_id=self.ctx, parent_context_id=self.parent,
                                         token_ids=self.tokens)).result()

        def on_chunk(c: StreamChunk) -> None:
            if c.token_id is not None:
                self.token_times.append(time.perf_counter())

        sp = (SamplingParams(max_tokens=self.max_tokens, json_schema=self.schema) if self.schema is not None
              else SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, **self.sampling))
        out = self.eng.generate_future(GenerateRequest(context_id=self.ctx, sampling=sp), on_chunk=on_chunk).result()
        self.text = out.text
        self.end = time.perf_counter()
        self.eng.free_future(self.ctx).result()


def run_clients(clients: list[Client]) -> float:
    """Run the clients at once; their wall time. A client that failed fails the run (no figure is taken
    from requests that were refused)."""
    threads = [threading.Thread(target=c.run) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    failed = [c for c in clients if c.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(clients)} clients failed, e.g. {failed[0].ctx}: "
                           f"{failed[0].error!r}") from failed[0].error
    return wall


def throughput(eng: LLMEngine, rng: np.random.Generator, conc: int, prompt_len: int, out_len: int,
               sampling: dict | None = None) -> dict:
    vocab = eng.vocab_size
    clients = [Client(eng, f"t{conc}-{i}", rng.integers(100, vocab, prompt_len).tolist(), out_len,
                      sampling=None if not sampling else {**sampling, "seed": i}) for i in range(conc)]
    before = eng.ping()
    wall = run_clients(clients)
    after = eng.ping()  # the engine's own medians of its last steps (the run's end: its decode batch)
    ttft = [c.token_times[0] - c.start for c in clients]
    itl = [b - a for c in clients for a, b in zip(c.token_times, c.token_times[1:], strict=False)]
    # time per output token of each request, first token to last: multi-step decode streams its tokens in
    # bursts (small gaps inside one, one long gap between two), so ITL percentiles alone mislead there
    tpot = [(c.token_times[-1] - c.token_times[0]) / (len(c.token_times) - 1) for c in clients
            if len(c.token_times) > 1]
    out_tokens = sum(len(c.token_times) for c in clients)
    return {"concurrency": conc, "requests": conc, "wall_s": wall, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50) * 1e3, "itl_p99_ms": _pct(itl, 99) * 1e3,
            "tpot_p50_ms": _pct(tpot, 50) * 1e3, "tpot_p99_ms": _pct(tpot, 99) * 1e3,
            "engine_step_ms": after.recent_step_ms, "engine_host_ms": after.recent_host_ms,
            "engine_steps": after.steps - before.steps,
            "loop_calls": after.multi_step_launches - before.multi_step_launches,
            "preemptions": after.preemptions - before.preemptions}


MEDIAN_KEYS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
               "tpot_p99_ms", "engine_step_ms", "engine_host_ms")


def compare(eng: LLMEngine, rng: np.random.Generator, conc: int, prompt_len: int, out_len: int, rounds: int,
            modes: dict[str, Callable[[], None]]) -> dict:
    """Part 1 at one concurrency in each of `modes` (a name and what sets it on the engine), in turns, the
    order reversed every other round; each mode's medians."""
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for r in range(rounds):
        for name in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            modes[name]()
            runs[name].append(throughput(eng, rng, conc, prompt_len, out_len))
    med = {name: {k: float(np.median([x[k] for x in rs])) for k in MEDIAN_KEYS} for name, rs in runs.items()}
    return {"concurrency": conc, "rounds": rounds, **med, "runs": runs}


def compare_bursts(eng: LLMEngine, rng: np.random.Generator, conc: int, prompt_len: int, out_len: int,
                   rounds: int, on: int) -> dict:
    """Part 1 at one concurrency with decode bursts off (0) and on (`on` prompt tokens), in turns."""
    def burst(tokens: int) -> Callable[[], None]:
        return lambda: setattr(eng.scheduler, "burst_tokens", tokens)

    r = compare(eng, rng, conc, prompt_len, out_len, rounds, {"off": burst(0), "on": burst(on)})
    eng.scheduler.burst_tokens = on
    return {**r, "burst_tokens": on, "on_over_off": {k: r["on"][k] / r["off"][k] if r["off"][k] else float("nan")
                                                     for k in MEDIAN_KEYS}}


def compare_multi_step(eng: LLMEngine, rng: np.random.Generator, conc: int, prompt_len: int, out_len: int,
                       rounds: int, values: list[int]) -> dict:
    """Part 1 at one concurrency with each of `values` decode steps per call, in turns. Each runs on the
    loops compiled for the engine's own multi-step count (a loop stops after its plan's steps), so one
    precompile serves all; 1 means one step a call (the overlap alone)."""
    own = eng.runner.multi_step

    def steps(k: int) -> Callable[[], None]:
        return lambda: setattr(eng.runner, "multi_step", k)

    r = compare(eng, rng, conc, prompt_len, out_len, rounds, {f"multi_step_{k}": steps(k) for k in values})
    eng.runner.multi_step = own
    return r


def print_compared(conc: int, what: str, r: dict, modes: list[str], rounds: int) -> None:
    """One line of medians per mode of a comparison at one concurrency."""
    for mode in modes:
        m = r[mode]
        print(f"concurrency {conc:3d}, {what} {mode}: {m['output_tokens_per_s']:7.1f} output tok/s, "
              f"TTFT p50 {m['ttft_p50_s']:.3f}s p99 {m['ttft_p99_s']:.3f}s, ITL p50 {m['itl_p50_ms']:.0f}ms "
              f"p99 {m['itl_p99_ms']:.0f}ms, TPOT p50 {m['tpot_p50_ms']:.1f}ms p99 {m['tpot_p99_ms']:.1f}ms; engine "
              f"step {m['engine_step_ms']:.2f}ms, host {m['engine_host_ms']:.2f}ms (medians of {rounds})", flush=True)


# the buckets every run of this benchmark fixes (the prefill budget stays the device's); max_batch_size: the
# largest concurrency level
SERVING_BUCKETS = {"bs_buckets": [1, 2, 4, 8, 16, 32, 64], "kv_buckets": [256, 512, 1024, 2048],
                   "cascade_suffix_buckets": [256]}


# the prefill settings of the GPU runs of 2026-11-24 and 2026-11-27 (this benchmark then fixed 512-token steps):
# prompt steps of up to 512 tokens, prompts batched 1 or 4 to a step, 256 prompt tokens a step between bursts
FIXED_PREFILL = {"max_num_batched_tokens": 512, "prefill_bs_buckets": [1, 4], "decode_bursts": AUTO_DECODE_BURSTS}


def compare_prefill(eng: LLMEngine, rng: np.random.Generator, conc: int, prompt_len: int, out_len: int,
                    rounds: int) -> dict:
    """Part 1 at one concurrency with the prefill settings of earlier GPU runs (`FIXED_PREFILL`) and the
    engine's own (on accelerators: 2048-token prompt steps, prompts batched 1, 2 or 4 to a step, the chunk
    beside decodes between bursts), in turns. The scheduler's settings and the runner's shape book are
    switched between runs (the fixed settings' shapes are among those compiled); on a CPU both are alike."""
    own_cfg, own_shapes, own_bursts = eng.scheduler.cfg, eng.runner.shapes, eng.scheduler.burst_tokens
    fixed_cfg = dataclasses.replace(own_cfg, max_num_batched_tokens=FIXED_PREFILL["max_num_batched_tokens"],
                                    prefill_bs_buckets=FIXED_PREFILL["prefill_bs_buckets"])

    def use(cfg: EngineConfig, bursts: int) -> Callable[[], None]:
        def apply() -> None:
            eng.scheduler.cfg, eng.scheduler.burst_tokens = cfg, bursts
            eng.scheduler.max_prefill_batch = max(cfg.prefill_bs_buckets)
            eng.runner.shapes = dataclasses.replace(own_shapes, ecfg=cfg)
        return apply

    fixed_bursts = FIXED_PREFILL["decode_bursts"] if own_bursts else 0
    try:
        r = compare(eng, rng, conc, prompt_len, out_len, rounds,
                    {"fixed": use(fixed_cfg, fixed_bursts), "device": use(own_cfg, own_bursts)})
    finally:
        use(own_cfg, own_bursts)()
    return {**r, "fixed_settings": {**FIXED_PREFILL, "decode_bursts": fixed_bursts},
            "device_settings": {"max_num_batched_tokens": own_cfg.max_num_batched_tokens,
                                "prefill_bs_buckets": own_cfg.prefill_bs_buckets, "decode_bursts": own_bursts},
            "device_over_fixed": {k: r["device"][k] / r["fixed"][k] if r["fixed"][k] else float("nan")
                                  for k in MEDIAN_KEYS}}


def shared_prefix(eng: LLMEngine, rng: np.random.Generator, n: int, prefix_len: int, q_len: int, out_len: int) -> dict:
    """`n` forks of one `prefix_len`-token context (shorter where the model's context would not hold it with
    the question and the output) against `n` independent copies of it."""
    vocab = eng.vocab_size
    prefix_len = min(prefix_len, eng.runner.max_len - q_len - out_len)
    prefix = rng.integers(100, vocab, prefix_len).tolist()
    questions = [rng.integers(100, vocab, q_len).tolist() for _ in range(n)]
    # independent: every client holds its own copy of the prefix
    indep = [Client(eng, f"ind{i}", prefix + questions[i], out_len) for i in range(n)]
    t_indep = run_clients(indep)
    # forks: the prefix is filled once, every client forks it
    t0 = time.perf_counter()
    eng.fill_future(FillRequest(context_id="shared-root", token_ids=prefix)).result()
    forks = [Client(eng, f"fork{i}", questions[i], out_len, parent="shared-root") for i in range(n)]
    run_clients(forks)
    t_forks = time.perf_counter() - t0
    eng.free_future("shared-root").result()
    return {"forks": n, "prefix_tokens": prefix_len, "question_tokens": q_len, "output_tokens": out_len,
            "independent_s": t_indep, "forked_s": t_forks, "speedup": t_indep / t_forks}


# fixed keys (what fast-forward feeds without a decode step each) and bounded values
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "occupation": {"type": "string", "maxLength": 32},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "hobbies", "married"],
    "additionalProperties": False,
}
PERSON_PROMPTS = ["an engineer from Lyon", "a retired teacher", "a young painter in Kyoto", "a fisherman in Norway",
                  "a nurse from Lagos", "a chess player", "a baker in Vienna", "a student of physics"]


def structured(eng: LLMEngine, conc: int, max_tokens: int, repeats: int = 3) -> dict:
    """JSON-schema outputs at concurrency `conc`, then as many unconstrained tokens per client; `repeats`
    such pairs, run in turns, and the medians."""
    tok = eng.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content":
               f"Describe {PERSON_PROMPTS[i % len(PERSON_PROMPTS)]} (person {i}) as a JSON object with the keys "
               "name, age, city, occupation, hobbies, married."}])) for i in range(conc)]
    before = eng.ping()
    eng.grammars.mask_ms.clear()
    runs: list[dict] = []
    for rep in range(repeats):
        clients = [Client(eng, f"json{conc}-{rep}-{i}", prompts[i], max_tokens, schema=PERSON_SCHEMA)
                   for i in range(conc)]
        wall = run_clients(clients)
        out_tokens = sum(len(c.token_times) for c in clients)
        valid = 0
        for c in clients:
            try:
                valid += isinstance(json.loads(c.text), dict)
            except ValueError:
                pass
        per_client = max(1, round(out_tokens / conc))
        plain = [Client(eng, f"plain{conc}-{rep}-{i}", prompts[i], per_client) for i in range(conc)]
        plain_wall = run_clients(plain)
        plain_tokens = sum(len(c.token_times) for c in plain)
        runs.append({"tps": out_tokens / wall, "plain_tps": plain_tokens / plain_wall, "tokens": out_tokens,
                     "valid": valid, "example": clients[0].text})
    after = eng.ping()
    masks = eng.grammars.mask_stats()
    tps = float(np.median([r["tps"] for r in runs]))
    plain_tps = float(np.median([r["plain_tps"] for r in runs]))
    return {"concurrency": conc, "repeats": repeats, "output_tokens": runs[0]["tokens"],
            "valid_json": min(r["valid"] for r in runs),
            "output_tokens_per_s": tps, "unconstrained_tokens_per_s": plain_tps,
            "ratio_vs_unconstrained": tps / plain_tps,
            "ratios_per_run": [r["tps"] / r["plain_tps"] for r in runs],
            "mask_ms_mean": masks["mask_ms_mean"], "mask_ms_p99": masks["mask_ms_p99"],
            "masked_steps": (after.constrained_steps - before.constrained_steps) // repeats,
            "fast_forward_tokens": (after.fast_forward_tokens - before.fast_forward_tokens) // repeats,
            "unmasked_tokens": (after.unmasked_tokens - before.unmasked_tokens) // repeats,
            "walked_tokens": (after.walked_tokens - before.walked_tokens) // repeats,
            "example": runs[0]["example"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quick", action="store_true", help="fewer levels and tokens (a few minutes)")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights of --model's shape (a preset such as llama-3-8b or smollm2-1.7b, "
                         "or a directory with a config.json)")
    ap.add_argument("--structured", action="store_true", help="also the structured-output comparison")
    ap.add_argument("--structured-only", action="store_true", help="only the structured-output comparison")
    ap.add_argument("--multi-step", type=int, default=None,
                    help="decode steps per call for a stable batch (EngineConfig.multi_step; default: the engine's)")
    ap.add_argument("--multi-step-max-batch", type=int, default=None, metavar="B",
                    help="the largest decode batch a multi-step loop runs (EngineConfig.multi_step_max_batch; "
                         "default: the engine's, 4 on accelerators)")
    ap.add_argument("--kv-memory-mb", type=int, default=2048,
                    help="the KV pool (MB; 2048 by default: 64 clients' 384 tokens of a 1.7B-shaped MHA model need "
                         "~4.8 GB, so that level preempts)")
    ap.add_argument("--decode-attention", choices=["auto", "xla", "kernel", "fused"], default="auto",
                    help="decode attention on GPUs (EngineConfig.decode_attention)")
    ap.add_argument("--decode-bursts", type=int, default=None, metavar="N",
                    help="prompt steps of up to N tokens alone alternating with decode-only bursts "
                         "(EngineConfig.decode_bursts; default: the engine's)")
    ap.add_argument("--compare-bursts", type=int, default=0, metavar="R",
                    help="part 1 with decode bursts off and on, in turns, R rounds each (medians); bursts on means "
                         "--decode-bursts N, else the engine's own setting, else 256")
    ap.add_argument("--compare-multi-step", type=int, nargs="+", default=None, metavar="K",
                    help="part 1 with each of these decode steps per call (1: one step a call; each at most "
                         "--multi-step, whose loops serve them all), in turns, --rounds rounds (medians)")
    ap.add_argument("--compare-prefill", type=int, default=0, metavar="R",
                    help="part 1 with the prefill settings of earlier GPU runs (512-token prompt steps, prompts "
                         "batched 1 or 4, 256-token prompt steps between bursts) and the engine's own, in turns, R "
                         "rounds each (medians); alike on a CPU")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of --compare-multi-step")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="part 1 samples at this temperature (default 0: greedy), with the three options below")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/engine_serving[_structured].json")
    args = ap.parse_args()
    sampling = ({"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
                if args.temperature > 0 else None)
    quick = args.quick
    levels = [1, 16] if args.structured_only else [1, 4, 16] if quick else [1, 4, 16, 64]
    prompt_len, out_len = 256, (32 if quick else 128)
    # the prefill budget is the device's (512 tokens a step on a CPU, 2048 on accelerators)
    cfg = EngineConfig(model=args.model, kv_memory_mb=args.kv_memory_mb, max_batch_size=max(levels),
                       **SERVING_BUCKETS, multi_step=args.multi_step,
                       multi_step_max_batch=args.multi_step_max_batch, decode_attention=args.decode_attention,
                       decode_bursts=args.decode_bursts,
                       explicit=("max_batch_size", "bs_buckets"))
    model = load_model(args.model, load_format=args.load_format)
    eng = LLMEngine(model, cfg)
    t0 = time.perf_counter()
    eng.runner.precompile()
    compile_s = time.perf_counter() - t0
    eng.start(precompile=False)
    rng = np.random.default_rng(0)
    result: dict = {"model": model.source, "precompile_s": compile_s, "shapes": len(eng.runner.compiled),
                    "multi_step": eng.runner.multi_step, "multi_step_max_batch": eng.runner.multi_max_batch,
                    "decode_attention": args.decode_attention,
                    "decode_bursts": cfg.decode_bursts,
                    "sampling": sampling or "greedy", "throughput": [], "quick": quick}
    try:
        if args.structured or args.structured_only:
            result["structured"] = []
            for c in (1, 16):
                r = structured(eng, c, 96)
                result["structured"].append(r)
                print(f"structured, concurrency {c:2d}: {r['output_tokens_per_s']:6.1f} tok/s vs "
                      f"{r['unconstrained_tokens_per_s']:6.1f} unconstrained ({r['ratio_vs_unconstrained']:.2f}x); "
                      f"{r['valid_json']}/{c} valid (medians of {r['repeats']}); "
                      f"mask per step mean {r['mask_ms_mean']:.3f} ms, p99 "
                      f"{r['mask_ms_p99']:.3f} ms over {r['masked_steps']} steps; fast-forward fed "
                      f"{r['fast_forward_tokens']} of {r['output_tokens']} tokens; {r['unmasked_tokens']} sampled "
                      f"tokens needed no mask; {r['walked_tokens']} rejected argmaxes found their masked argmax "
                      "among the next candidates", flush=True)
        if args.compare_bursts:
            on = eng.scheduler.burst_tokens or args.decode_bursts or AUTO_DECODE_BURSTS
            result["compare_bursts"] = []
            for c in levels:
                r = compare_bursts(eng, rng, c, prompt_len, out_len, args.compare_bursts, on)
                result["compare_bursts"].append(r)
                print_compared(c, "bursts", r, ["off", "on"], args.compare_bursts)
        if args.compare_multi_step:
            if max(args.compare_multi_step) > eng.runner.multi_step or min(args.compare_multi_step) < 1:
                raise SystemExit(f"--compare-multi-step takes 1 to the engine's multi-step count "
                                 f"({eng.runner.multi_step}: set it with --multi-step)")
            result["compare_multi_step"] = []
            for c in levels:
                r = compare_multi_step(eng, rng, c, prompt_len, out_len, args.rounds, args.compare_multi_step)
                result["compare_multi_step"].append(r)
                print_compared(c, "steps a call", r, [f"multi_step_{k}" for k in args.compare_multi_step], args.rounds)
            first = result["compare_multi_step"][0]
            result["compare_multi_step_ratio_vs_c1"] = {
                f"multi_step_{k}": {r["concurrency"]: r[f"multi_step_{k}"]["output_tokens_per_s"]
                                    / first[f"multi_step_{k}"]["output_tokens_per_s"]
                                    for r in result["compare_multi_step"]} for k in args.compare_multi_step}
            print(f"ratios vs concurrency 1: {result['compare_multi_step_ratio_vs_c1']}")
        if args.compare_prefill:
            result["compare_prefill"] = []
            for c in levels:
                r = compare_prefill(eng, rng, c, prompt_len, out_len, args.compare_prefill)
                result["compare_prefill"].append(r)
                print_compared(c, "prefill", r, ["fixed", "device"], args.compare_prefill)
                print(f"concurrency {c:3d}: device / fixed output tok/s "
                      f"{r['device_over_fixed']['output_tokens_per_s']:.3f}x", flush=True)
            print(f"fixed: {result['compare_prefill'][0]['fixed_settings']}; "
                  f"device: {result['compare_prefill'][0]['device_settings']}")
        compared = args.compare_bursts or args.compare_multi_step or args.compare_prefill
        for c in [] if args.structured_only or compared else levels:
            r = throughput(eng, rng, c, prompt_len, out_len, sampling)
            result["throughput"].append(r)
            print(f"concurrency {c:3d}: {r['output_tokens_per_s']:7.1f} output tok/s, "
                  f"TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s, "
                  f"ITL p50 {r['itl_p50_ms']:.0f}ms p99 {r['itl_p99_ms']:.0f}ms, "
                  f"TPOT p50 {r['tpot_p50_ms']:.1f}ms p99 {r['tpot_p99_ms']:.1f}ms; engine step "
                  f"{r['engine_step_ms']:.2f}ms, host {r['engine_host_ms']:.2f}ms; {r['engine_steps']} steps, "
                  f"{r['loop_calls']} loop calls, {r['preemptions']} preemptions", flush=True)
        if result["throughput"]:
            base = result["throughput"][0]["output_tokens_per_s"]
            result["throughput_ratio_vs_c1"] = {
                r["concurrency"]: r["output_tokens_per_s"] / base for r in result["throughput"]}
            print(f"ratios vs concurrency 1: {result['throughput_ratio_vs_c1']}")
            sp = shared_prefix(eng, rng, 16, 1000, 16, 16 if quick else 64)
            result["shared_prefix"] = sp
            print(f"16 forks of a {sp['prefix_tokens']}-token prefix: {sp['forked_s']:.1f}s vs 16 independent copies "
                  f"{sp['independent_s']:.1f}s: {sp['speedup']:.2f}x")
        info = eng.ping()
        result["runtime"] = info.model_dump()
        print(f"shape misses: {info.shape_misses}; cascade steps: {info.cascade_steps}; decode bursts: "
              f"{info.decode_bursts}; precompile {compile_s:.0f}s for {result['shapes']} shapes")
    finally:
        eng.shutdown()
    fl = floors.measure()  # this machine's floors, in the same run
    result["machine"], result["floors"] = procinfo.cpu_name(), fl
    print(f"CPU {result['machine']}; floors: read {fl['memory_read_gbs']:.1f} GB/s, "
          f"fp32 GEMM {fl['gemm_fp32_gflops']:.0f} GFLOP/s")
    name = "engine_serving_structured" if args.structured_only else "engine_serving"
    write_json(result, args.out or f"benchmarks/results/{name}.json")


if __name__ == "__main__":
    main()
