"""The serve layer's own time per task, and the same app through the DAG against plain completions on the
same server, one app at a time (an otherwise idle server).

    python -m benchmarks.serve_overhead [--url URL] [--steps 5] [--apps 3]

Without --url it starts `parrot serve` (quick shapes) on a free port and stops it afterwards; with
--tiny it serves the tests' tiny random-weight model in process instead (a fast engine's stand-in). Each app is
a chain of `--steps` dependent calls (`parrot.bench.workloads.refine_summary` over ~130-token pieces of
the benchmark texts, outputs of 8 tokens): once as semantic variables (the server runs the chain, the
client reads the last output) and once with the control flow in the client over `/v1/completions`,
alternating. Every app reads its own pieces, so no app finds another's prompts cached (plain
completions' prompts stay cached across apps; a session's do not). Reported per
path: the median app time, and the serve layer's own time per task from `/metrics`
(`parrot:serve_first_primitive_seconds`, `parrot:serve_between_primitives_seconds`): mean and count.
Writes benchmarks/results/serve_overhead.json."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import parrot as P
from parrot.bench import corpus, workloads
from parrot.bench.run import serve_histograms, serve_time_summary, wait_compiled, warm_up
from parrot.bench.runtime import OpenAIRuntime, ParrotRuntime, Recorder, Runtime
from parrot.bench.systems import System, build

RESULTS = Path(__file__).resolve().parent / "results"


@P.semantic_function(template=workloads.refine_summary.template)
def refine_short(summary: P.Input, chunk: P.Input, new_summary: workloads.out(8)): ...


async def one_app(rt: Runtime, chunks: list[str]) -> float:
    async def logic(app) -> None:  # noqa: ANN001
        summary: object = "(nothing yet)"
        for chunk in chunks:
            summary = await app.call(refine_short, summary=summary, chunk=chunk)
        await app.get(summary, "latency")

    rec = Recorder()
    await rt.run_app("chain", rec, logic)
    return rec.apps[0].jct_s  # the app's own time: not its session's opening (clients built) or closing


def texts_of(n: int, chars: int = 600) -> list[str]:
    """`n` distinct pieces of `chars` characters (600: ~130 tokens) of the benchmark texts."""
    out = []
    for name in ("gpl-2.0.txt", "gpl-3.0.txt", "lgpl-2.1.txt", "mpl-2.0.txt"):
        for chunk in corpus.chunks(corpus.text(name)):
            out += [chunk[i:i + chars] for i in range(0, len(chunk) - chars // 2, chars)]
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct pieces for {n} calls: fewer --apps or --steps")
    return out[:n]


def measure(system: System, steps: int, apps: int, offset: int = 0, chars: int = 600) -> dict:
    pieces = iter(texts_of(offset + 2 * apps * steps, chars)[offset:])  # every app its own text: none finds another's
    runtimes = {"dag": lambda: ParrotRuntime(system.url),
                "plain": lambda: OpenAIRuntime("plain", system.url, system.model, system.extra_body)}
    out: dict = {name: {"app_s": [], "serve": []} for name in runtimes}
    for _ in range(apps):
        for name, make in runtimes.items():
            chunks = [next(pieces) for _ in range(steps)]
            before = serve_histograms(system)
            out[name]["app_s"].append(asyncio.run(one_app(make(), chunks)))
            out[name]["serve"].append(serve_time_summary(before, serve_histograms(system)))
    for name in runtimes:
        runs = out[name]["serve"]
        out[name]["app_median_s"] = statistics.median(out[name]["app_s"])
        for key in ("serve_first", "serve_gap"):
            n = sum(r[f"{key}_n"] for r in runs)
            total = sum((r[f"{key}_mean_s"] or 0) * r[f"{key}_n"] for r in runs)
            out[name][f"{key}_n"] = n
            out[name][f"{key}_mean_ms"] = 1000 * total / n if n else None
    out["dag_over_plain_speedup"] = out["plain"]["app_median_s"] / out["dag"]["app_median_s"]
    return out


def _on_tiny_engine(system: System, steps: int, apps: int) -> dict:
    from parrot.engine.engine import LLMEngine
    from tests.conftest import tiny_engine_config, tiny_model
    from tests.servers import serving_core

    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    try:
        with serving_core(engine, "tiny", model.tokenizer) as (url, _):
            system.port = int(url.rsplit(":", 1)[1])
            system.model = "tiny"
            # ~40-token pieces: the tiny model holds 512 tokens; a warm-up (shapes compile) on other texts first
            measure(system, steps, 1, offset=2 * apps * steps, chars=200)
            return measure(system, steps, apps, chars=200)
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running parrot serve (default: start one)")
    ap.add_argument("--port", type=int, default=9390)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--apps", type=int, default=3, help="apps per path, alternating")
    ap.add_argument("--tiny", action="store_true",
                    help="serve the tests' tiny random-weight model in process (tests/conftest.py): a stand-in for a "
                         "fast engine, where the serve layer's and the client's own costs dominate")
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_overhead.json")
    args = ap.parse_args(argv)
    system = build(["parrot"], args.port, quick=True)[0]
    if args.tiny:
        result = _on_tiny_engine(system, args.steps, args.apps)
    else:
        started = args.url is None
        if started:
            system.start(args.out.parent / "logs" / "serve_overhead.log")
            wait_compiled(system)
        else:
            system.port = int(args.url.rsplit(":", 1)[1].strip("/"))
        try:
            warm_up(system)
            result = measure(system, args.steps, args.apps)
        finally:
            if started:
                system.stop()
    result["params"] = {"steps": args.steps, "apps": args.apps, "max_tokens": 8,
                        "engine": "tiny random-weight model in process" if args.tiny else "parrot serve"}
    for name in ("dag", "plain"):
        r = result[name]
        print(f"{name:5s} app median {r['app_median_s']:.2f} s  serve first {r['serve_first_mean_ms']:.2f} ms "
              f"(n={r['serve_first_n']:.0f})  between primitives {r['serve_gap_mean_ms'] or 0:.2f} ms "
              f"(n={r['serve_gap_n']:.0f})")
    print(f"DAG / plain speedup: {result['dag_over_plain_speedup']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
