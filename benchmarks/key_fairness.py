"""Two API keys at one full server: one floods it, the other asks for a little, with the keys taking turns at
the engine (the default) and with one queue order for both (`--no-fair-share`), in turns.

`parrot serve --api-key key-a,key-b` on the default model with a small batch (`--max-batch-size`, 8 by
default), so that the server is full and work waits in its scheduler: key A sends `--flood` streamed chat
completions at once; a second later, while most of them still wait, key B sends `--polite` at once. Printed
per mode: key B's time to the first token and to the end of its requests (medians), key A's output tokens per
second and the time to drain its backlog, the engine's preemptions (and of them those for a key's share of the
batch, `parrot:engine_fair_preemptions_total`), and the ratios of the two modes. With one queue order B's requests
wait behind A's backlog; with turns they go first, and up to B's share of the batch at once, in the place of
A's newest (preempted). Greedy, `ignore_eos`, distinct prompts,
the real `openai` client. The floors are measured in the same run.

    python -m benchmarks.key_fairness [--flood 24] [--polite 3] [--tokens 32] [--rounds 1]

Every server is started and stopped here (SIGINT to its own PID).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import floors
from benchmarks.kv_release import _metric
from benchmarks.report import write_json
from benchmarks.serve_differential import http_get
from benchmarks.serve_stream import Server, _free_port, _prompts, _stream
from parrot import procinfo

KEYS = ("key-a", "key-b")
MODES = {"turns": [], "one order": ["--no-fair-share"]}


def measure(port: int, flood: int, polite: int, tokens: int, prompts: list[str]) -> dict:
    """Key A's flood and key B's requests after it, on the server at `port`."""
    import openai

    a, b = (openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=k, timeout=1800) for k in KEYS)
    _stream(b, "smollm2", prompts[-1], 4)  # warm-up: first request paths
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(flood) as pool:
        floods = [pool.submit(_stream, a, "smollm2", p, tokens) for p in prompts[:flood]]
        time.sleep(1.0)  # A's requests are in: the batch is full and the rest wait

        def polite_run(p: str) -> tuple[float, float]:
            start = time.perf_counter()
            ttft, times, _ = _stream(b, "smollm2", p, tokens)
            return ttft, (times[-1] if times else time.perf_counter()) - start
        with cf.ThreadPoolExecutor(polite) as polite_pool:  # B's all at once, while A's backlog waits
            polite_runs = list(polite_pool.map(polite_run, prompts[flood:flood + polite]))
        results = [f.result() for f in floods]
    drained = max(r[1][-1] for r in results if r[1]) - t0
    produced = sum(r[2] for r in results)
    metrics = (http_get(f"http://127.0.0.1:{port}/metrics") or b"").decode()
    return {"preemptions": _metric(metrics, "parrot:engine_preemptions_total"),
            "fair_preemptions": _metric(metrics, "parrot:engine_fair_preemptions_total"),
            "polite_ttft_s": [r[0] for r in polite_runs], "polite_latency_s": [r[1] for r in polite_runs],
            "polite_ttft_s_median": float(np.median([r[0] for r in polite_runs])),
            "polite_latency_s_median": float(np.median([r[1] for r in polite_runs])),
            "flood_drained_s": drained, "flood_output_tokens": produced, "flood_output_tok_s": produced / drained}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=24, help="key A's requests, all at once")
    ap.add_argument("--polite", type=int, default=3, help="key B's requests, at once, a second after A's")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens of every request")
    ap.add_argument("--max-batch-size", type=int, default=8, help="the server's batch (small: the server is full)")
    ap.add_argument("--rounds", type=int, default=1, help="each mode this many times, in turns (medians)")
    ap.add_argument("--out", default="benchmarks/results/key_fairness.json")
    args = ap.parse_args()
    fl = floors.measure()
    cpu = procinfo.cpu_name()
    print(f"CPU {cpu}; floors: read {fl['memory_read_gbs']:.1f} GB/s, fp32 GEMM {fl['gemm_fp32_gflops']:.0f} GFLOP/s",
          flush=True)
    prompts = _prompts(args.flood + args.polite + 1, chars=250)
    logs = Path(tempfile.mkdtemp(prefix="parrot-key-fairness-"))
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode, extra in MODES.items():
            port = _free_port()
            cmd = [sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), "--api-key", ",".join(KEYS),
                   "--max-batch-size", str(args.max_batch_size), "--max-model-len", "2048", *extra]
            with Server(mode, cmd, port, "/health", lambda h: h.get("status") == "ok",
                        logs / f"{mode.replace(' ', '-')}-{r}.log"):
                run = measure(port, args.flood, args.polite, args.tokens, prompts)
            runs[mode].append(run)
            print(f"[{mode}] key B: TTFT {run['polite_ttft_s_median']:.2f} s, latency "
                  f"{run['polite_latency_s_median']:.2f} s (medians of {args.polite}); key A: "
                  f"{run['flood_output_tok_s']:.1f} output tok/s, drained in {run['flood_drained_s']:.1f} s; "
                  f"{run['preemptions']:.0f} preempted, {run['fair_preemptions']:.0f} of them for a key's share",
                  flush=True)
    summary = {m: {k: float(np.median([run[k] for run in rs])) for k in
                   ("polite_ttft_s_median", "polite_latency_s_median", "flood_output_tok_s", "flood_drained_s")}
               for m, rs in runs.items()}
    turns, one = summary["turns"], summary["one order"]
    ratios = {"polite_latency_one_order_over_turns": one["polite_latency_s_median"] / turns["polite_latency_s_median"],
              "polite_ttft_one_order_over_turns": one["polite_ttft_s_median"] / turns["polite_ttft_s_median"],
              "flood_tok_s_turns_over_one_order": turns["flood_output_tok_s"] / one["flood_output_tok_s"]}
    print(f"key B's latency: one order / turns {ratios['polite_latency_one_order_over_turns']:.2f}x, TTFT "
          f"{ratios['polite_ttft_one_order_over_turns']:.2f}x; key A's output tok/s: turns / one order "
          f"{ratios['flood_tok_s_turns_over_one_order']:.2f}x")
    write_json({"cpu": cpu, "floors": fl, "args": vars(args), "runs": runs, "summary": summary, "ratios": ratios},
               args.out)


if __name__ == "__main__":
    main()
