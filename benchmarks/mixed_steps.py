"""Decodes beside long prompts, four ways side by side on the default model: chats decode while long prompts
fill (the `mixed` app workload's situation, inside one engine).
- bursts: steps of up to `--bursts` prompt tokens alone alternate with a decode-only multi-step call of the
  chats (decode bursts, the default where multi-step decode runs);
- mixed: a chunk of `--beside` prompt tokens beside every decode step, one pass over the weights for both;
- two_passes: the same steps as two passes;
- held: decode bursts, the prompts sent as throughput work (priority 1) beside latency-critical chats, with the
  throughput hold (`--hold-ms`): the prompts wait while the chats decode.

For each mode, in turns (`--repeats`): `--chats` chats (distinct ~100-token prompts) decode `--tokens` tokens
each; once all are decoding, `--prompts` prompts of ~`--prompt-tokens` tokens are filled (a batch job's
maps). Reported per mode (medians over the repeats): the chats' time per output token while the prompts fill
(the fill's time over the tokens each chat got meanwhile) and the p99 gap between two of a chat's tokens then,
the prompts' fill time and prompt tokens per second, when the last chat finished (from the prompts' arrival)
and the whole run's wall time; and the ratios. Greedy
outputs are checked equal between the modes. This machine's floors are measured in the same run.

    python -m benchmarks.mixed_steps [--chats 8] [--tokens 96] [--prompts 2] [--prompt-tokens 1000]
        [--beside 128] [--bursts 256] [--hold-ms 1000] [--repeats 3] [--out benchmarks/results/mixed_steps.json]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine import kernels
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import load_model
from parrot.engine.scheduler import AUTO_DECODE_BURSTS, AUTO_THROUGHPUT_HOLD_MS
from parrot.protocol import FillRequest, GenerateRequest, SamplingParams

DATA = Path(__file__).resolve().parents[1] / "parrot" / "bench" / "data" / "gpl-3.0.txt"


def _texts(n: int, chars: int, offset: int = 0) -> list[str]:
    text = DATA.read_text()
    return [text[offset + i * chars: offset + (i + 1) * chars] for i in range(n)]


def run_once(eng: LLMEngine, chats: list[list[int]], prompts: list[list[int]], tokens: int, tag: str,
             priority: int = 0) -> dict:
    """One run: the chats decode, the prompts (at `priority`) fill beside them. Times in seconds."""
    arrivals: dict[int, list[float]] = {i: [] for i in range(len(chats))}
    decoding = threading.Semaphore(0)
    futs = []
    t0 = time.perf_counter()
    for i, ids in enumerate(chats):
        eng.fill_future(FillRequest(context_id=f"{tag}c{i}", token_ids=ids)).result(600)

        def on_chunk(_c: object, i: int = i) -> None:
            if not arrivals[i]:
                decoding.release()
            arrivals[i].append(time.perf_counter())

        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        futs.append(eng.generate_future(GenerateRequest(context_id=f"{tag}c{i}", sampling=sp), on_chunk=on_chunk))
    for _ in chats:
        decoding.acquire()
    f0 = time.perf_counter()
    fills = [eng.fill_future(FillRequest(context_id=f"{tag}p{j}", token_ids=ids, priority=priority))
             for j, ids in enumerate(prompts)]
    for f in fills:
        f.result(600)
    f1 = time.perf_counter()
    outs = [f.result(600).token_ids for f in futs]
    t1 = time.perf_counter()
    gaps = [float(g) for times in arrivals.values() for a, g in zip(times[1:], np.diff(times), strict=True)
            if f0 <= a <= f1]
    during = sum(1 for times in arrivals.values() for a in times if f0 <= a <= f1)
    for c in [f"{tag}c{i}" for i in range(len(chats))] + [f"{tag}p{j}" for j in range(len(prompts))]:
        eng.free_future(c).result(60)
    return {"fill_s": f1 - f0, "prompt_tok_s": sum(map(len, prompts)) / (f1 - f0), "wall_s": t1 - t0,
            "chats_done_s": max(times[-1] for times in arrivals.values()) - f0,
            "chat_ms_per_token_during_fill": 1e3 * (f1 - f0) * len(chats) / during if during else None,
            "chat_p99_ms_during_fill": 1e3 * float(np.percentile(gaps, 99)) if gaps else None, "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--beside", type=int, default=EngineConfig.prefill_tokens_beside_decodes,
                    help="prefill tokens in a step that decodes (--prefill-tokens-beside-decodes)")
    ap.add_argument("--bursts", type=int, default=AUTO_DECODE_BURSTS,
                    help="prompt tokens a step between decode bursts (--decode-bursts)")
    ap.add_argument("--hold-ms", type=int, default=AUTO_THROUGHPUT_HOLD_MS,
                    help="the longest the held mode's prompts wait at a time (--throughput-hold-ms)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/mixed_steps.json")
    args = ap.parse_args()

    fl = floors.measure()
    model = load_model(progress=False)
    tok = model.tokenizer
    cfg = EngineConfig(prefill_tokens_beside_decodes=args.beside, kv_buckets=[256, 512, 1024, 2048])
    eng = LLMEngine(model, cfg).start(precompile=True)
    if not eng.runner.mixed:
        raise SystemExit(f"mixed steps do not run here (native kernels: {kernels.unavailable_reason() or 'on'})")
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Summarize: {t}"}]))
             for t in _texts(args.chats, 400)]
    prompts = [tok.encode(t)[: args.prompt_tokens] for t in _texts(args.prompts, 6 * args.prompt_tokens, 20_000)]
    run_once(eng, chats[:2], prompts[:1], 8, "warm")  # first-use paths
    runs: dict[str, list[dict]] = {"bursts": [], "mixed": [], "two_passes": [], "held": []}
    for r in range(args.repeats):
        for mode in runs:
            eng.runner.mixed = mode != "two_passes"
            eng.scheduler.burst_tokens = args.bursts if mode in ("bursts", "held") else 0
            eng.scheduler.hold_s = args.hold_ms / 1000 if mode == "held" else 0
            steps, bursts, held = eng.runner.mixed_steps, eng.scheduler.decode_bursts, eng.scheduler.held_steps
            res = run_once(eng, chats, prompts, args.tokens, f"{mode}{r}", priority=int(mode == "held"))
            res["mixed_steps"] = eng.runner.mixed_steps - steps
            res["decode_bursts"] = eng.scheduler.decode_bursts - bursts
            res["held_steps"] = eng.scheduler.held_steps - held
            runs[mode].append(res)
    eng.runner.mixed = True
    eng.shutdown()
    same = all(a["outputs"] == b["outputs"] == c["outputs"] == d["outputs"]
               for a, b, c, d in zip(runs["bursts"], runs["mixed"], runs["two_passes"], runs["held"], strict=True))
    keys = ["chat_ms_per_token_during_fill", "chat_p99_ms_during_fill", "fill_s", "prompt_tok_s", "chats_done_s",
            "wall_s"]
    summary = {mode: {k: float(np.median(v)) if (v := [x[k] for x in rs if x[k] is not None]) else None for k in keys}
               | {c: int(np.median([x[c] for x in rs])) for c in ("mixed_steps", "decode_bursts", "held_steps")}
               for mode, rs in runs.items()}
    b, m, t, h = summary["bursts"], summary["mixed"], summary["two_passes"], summary["held"]
    ratios = {"chat_tpot_two_over_mixed": t["chat_ms_per_token_during_fill"] / m["chat_ms_per_token_during_fill"],
              "prompt_tok_s_mixed_over_two": m["prompt_tok_s"] / t["prompt_tok_s"],
              "wall_two_over_mixed": t["wall_s"] / m["wall_s"],
              "chat_tpot_mixed_over_bursts": m["chat_ms_per_token_during_fill"] / b["chat_ms_per_token_during_fill"],
              "prompt_tok_s_bursts_over_mixed": b["prompt_tok_s"] / m["prompt_tok_s"],
              "wall_mixed_over_bursts": m["wall_s"] / b["wall_s"],
              "chats_done_bursts_over_held": b["chats_done_s"] / h["chats_done_s"],
              "fill_held_over_bursts": h["fill_s"] / b["fill_s"], "wall_held_over_bursts": h["wall_s"] / b["wall_s"]}
    cpu = procinfo.cpu_name()
    print(f"CPU {cpu}; floors: read {fl['memory_read_gbs']:.1f} GB/s, fp32 GEMM {fl['gemm_fp32_gflops']:.0f} GFLOP/s")
    print(f"{args.chats} chats x {args.tokens} tokens; {args.prompts} prompts x {len(prompts[0])} tokens filled beside "
          f"them, {args.beside} prompt tokens a mixed step, {args.bursts} between bursts; medians of {args.repeats} "
          "runs, in turns")
    for mode, s in summary.items():
        during = ("no chat token while the prompts fill" if s["chat_ms_per_token_during_fill"] is None else
                  f"chat {s['chat_ms_per_token_during_fill']:.1f} ms/token (gap p99 "
                  f"{s['chat_p99_ms_during_fill'] or 0:.1f}) while the prompts fill")
        print(f"{mode:>10}: {during}; fill {s['fill_s']:.2f} s = {s['prompt_tok_s']:.0f} prompt tok/s; chats done "
              f"{s['chats_done_s']:.2f} s; run {s['wall_s']:.2f} s; mixed steps {s['mixed_steps']}, decode bursts "
              f"{s['decode_bursts']}, held steps {s['held_steps']}")
    print(f"mixed / two passes: chat time per token {ratios['chat_tpot_two_over_mixed']:.2f}x better, prompt tok/s "
          f"{ratios['prompt_tok_s_mixed_over_two']:.2f}x, run {ratios['wall_two_over_mixed']:.2f}x")
    print(f"bursts / mixed: chat time per token {ratios['chat_tpot_mixed_over_bursts']:.2f}x better, prompt tok/s "
          f"{ratios['prompt_tok_s_bursts_over_mixed']:.2f}x, run {ratios['wall_mixed_over_bursts']:.2f}x; "
          f"greedy outputs equal: {same}")
    print(f"held / bursts: chats done {ratios['chats_done_bursts_over_held']:.2f}x sooner, prompts filled "
          f"{ratios['fill_held_over_bursts']:.2f}x the time, run {ratios['wall_held_over_bursts']:.2f}x the time")
    for rs in runs.values():
        for x in rs:
            del x["outputs"]
    path = write_json({"machine": cpu, "floors": fl, "args": vars(args), "summary": summary, "ratios": ratios,
                       "outputs_equal": same, "runs": runs}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
