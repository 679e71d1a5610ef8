"""Start-up benchmark: `parrot serve` on the default model from a cold compilation cache, then warm
(the same cache again), measured from process launch:

- listening: `/health` first answers (the server accepts requests; shapes may still be compiling);
- first answer: a chat completion sent at once after listening has returned;
- warm: `/health` says "ok" (every shape compiled);
- resident memory of the server process then.

    python -m benchmarks.startup [--layers-per-call N ...] [--first-start] [--out benchmarks/results/startup.json]

Each configuration in `--layers-per-call` (1: one decoder layer per compiled call, the default; 0: the
whole model in one call) gets its own fresh cache directory. With `--first-start` it also gets a fresh
directory for the native kernels' library (`PARROT_KERNEL_DIR`), so the cold start builds them as a new
user's very first start does; the warm start finds both. Every server is started here and stopped
here (SIGINT to its PID); nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.report import write_json
from parrot import procinfo

CHAT = {"model": "smollm2", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _get(url: str, timeout: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_once(port: int, cache_dir: str, layers_per_call: int, timeout: float, log_path: Path,
               kernel_dir: str | None = None) -> dict:
    """Launch one server, measure, stop it. `kernel_dir`: the native kernels' library directory (default:
    the user's cache)."""
    cmd = [sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), "--compilation-cache-dir", cache_dir,
           "--layers-per-call", str(layers_per_call)]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        env = dict(os.environ, **({"PARROT_KERNEL_DIR": kernel_dir} if kernel_dir else {}))
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    out: dict = {"layers_per_call": layers_per_call, "kernels_built": bool(kernel_dir) and not any(
        Path(kernel_dir).glob("*.so"))}
    try:
        while (health := _get(base + "/health")) is None:
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not come up; see {log_path}")
            time.sleep(0.2)
        out["listening_s"] = time.monotonic() - t0
        answer = _post(base + "/v1/chat/completions", CHAT, timeout)
        out["first_answer_s"] = time.monotonic() - t0
        out["first_answer"] = answer["choices"][0]["message"]["content"]
        while health is None or health.get("status") != "ok":
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not finish warming up; see {log_path}")
            time.sleep(0.5)
            health = _get(base + "/health")
        out["warm_s"] = time.monotonic() - t0
        out["rss_gb"] = (procinfo.rss_bytes(proc.pid) or 0) / 1e9
    finally:
        stop(proc)
    return out


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a server this benchmark started: SIGINT to its PID, killed if it is still there after `grace_s`."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(layers: list[int], port: int, timeout: float, log_dir: Path, first_start: bool = False) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"cpu": procinfo.cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "first_start": first_start, "runs": [],
                    # without bytecode files (PYTHONDONTWRITEBYTECODE), every start compiles Parrot's modules again
                    "writes_bytecode": not os.environ.get("PYTHONDONTWRITEBYTECODE")}
    for lpc in layers:
        with (tempfile.TemporaryDirectory(prefix="parrot-jax-cache-") as cache,
              tempfile.TemporaryDirectory(prefix="parrot-kernels-") as kernels):
            for phase in ("cold", "warm"):
                r = start_once(port, cache, lpc, timeout, log_dir / f"startup-{lpc}-{phase}.log",
                               kernels if first_start else None)
                r["cache"] = phase
                print(format_run(r), flush=True)
                result["runs"].append(r)
    return result


def format_run(r: dict) -> str:
    name = "whole model per call" if r["layers_per_call"] == 0 else f"{r['layers_per_call']} layer(s) per call"
    built = ", kernels built" if r.get("kernels_built") else ""
    return (f"{name}, {r['cache']} cache{built}: listening {r['listening_s']:.1f} s, "
            f"first answer {r['first_answer_s']:.1f} s, all shapes compiled {r['warm_s']:.1f} s, "
            f"resident {r['rss_gb']:.2f} GB ({r['first_answer']!r})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers-per-call", type=int, nargs="+", default=[1])
    ap.add_argument("--first-start", action="store_true",
                    help="the cold start also builds the native kernels (a fresh PARROT_KERNEL_DIR)")
    ap.add_argument("--port", type=int, default=9290)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one server may take to warm up")
    ap.add_argument("--out", default="benchmarks/results/startup.json")
    args = ap.parse_args()
    r = run(args.layers_per_call, args.port, args.timeout, Path("benchmarks/results/logs"), args.first_start)
    print(f"CPU: {r['cpu']} ({r['cores']} cores)"
          + ("" if r["writes_bytecode"] else "; PYTHONDONTWRITEBYTECODE is set: each start compiles the modules again"))
    write_json(r, args.out)


if __name__ == "__main__":
    main()
