"""KV memory after a peak: `parrot serve` on the default model takes bursts of long concurrent requests, then
idles. A CPU's KV pool is resident where its pages were written; with `--kv-release-idle-s S` the engine gives
its free pages back to the OS once it has idled S seconds. Two servers, one after the other, in one run: the
first gives pages back (S = `--idle-s`), the second never does (S = 0), so their rows compare directly.

Each server takes two bursts of `--requests` requests at once, each a distinct prompt of about
`--prompt-words` words and `--max-tokens` out, and idles `--idle-s` + `--settle-s` seconds after each:

- `sessions`: each request is an app's session (the SDK's `VirtualMachine`, one `@semantic_function` call over
  a document variable); the sessions end once all have read their answers: the server frees their contexts,
  and their pages are free in the engine;
- `openai`: each request is a chat completion: automatic prefix caching keeps every prompt's context (up to
  `max_global_contexts`, and as long as the pool has room), so its pages stay in use, and resident.

Reported per burst: resident memory (the server and its engine processes) before it, right after it and after
idling, the KV pages written (`parrot:kv_cache_written_pages`) and given back
(`parrot:kv_cache_released_pages_total`; both as the engines last reported them to the core, which can lag a
burst of a few requests by a report); at the end, the first chat request once more, its answer compared with
the first one's (pages given back read as zeros again; the engine writes a page before it reads it).

    python -m benchmarks.kv_release [--requests 32] [--prompt-words 700] [--idle-s 5]
        [--out benchmarks/results/kv_release.json]

Every server is started here and stopped here (SIGINT to its PID); nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import parrot as P
from benchmarks.report import write_json
from benchmarks.serve_differential import http_get
from benchmarks.soak import free_port, rss_mb
from benchmarks.startup import stop

WORDS = ("river", "garden", "engine", "violet", "castle", "harbor", "lantern", "meadow", "copper", "window",
         "thunder", "pepper", "island", "marble", "falcon", "winter", "saddle", "orchard", "candle", "bridge")


def _chat(base: str, text: str, max_tokens: int, timeout: float) -> str:
    body = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples over engines in Prometheus text."""
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def prompt(i: int, words: int) -> str:
    """A distinct long prompt: it starts with the request's number (no cached prefix of a whole block is shared
    with another request's), then `words` words."""
    seq = [WORDS[(i * 7 + j * (i % 5 + 1) + j // 3) % len(WORDS)] for j in range(words)]
    return f"Request {i}. Count how many times 'river' appears in this list: " + " ".join(seq)


@P.semantic_function
def _count(document: P.Input, answer: P.Output(max_tokens=16)):  # noqa: ANN201 (the SDK's declaration)
    """<|im_start|>user
    {{document}}<|im_end|>
    <|im_start|>assistant
    {{answer}}"""


def _session(base: str, text: str, timeout: float, together: threading.Barrier) -> str:
    """One app session: a semantic call over the document, read; once every session of the burst has its answer,
    the sessions end (their contexts go)."""
    with P.VirtualMachine(base, timeout=timeout):
        answer = _count(text).get()
        together.wait(timeout)
        return answer


def _burst(base: str, pid: int, kind: str, requests: int, words: int, max_tokens: int, wait_s: float,
           timeout: float) -> tuple[dict, list[str]]:
    out: dict = {"rss_mb_before": rss_mb(pid)}
    t0 = time.monotonic()
    first = 0 if kind == "openai" else requests  # distinct prompts in each burst
    if kind == "openai":
        def one(i: int) -> str:
            return _chat(base, prompt(first + i, words), max_tokens, timeout)
    else:
        together = threading.Barrier(requests)

        def one(i: int) -> str:
            return _session(base, prompt(first + i, words), timeout, together)
    with ThreadPoolExecutor(requests) as pool:
        answers = list(pool.map(one, range(requests)))
    out["burst_s"] = time.monotonic() - t0
    out["rss_mb_peak"] = rss_mb(pid)
    metrics = (http_get(base + "/metrics") or b"").decode()
    out["written_pages_peak"] = _metric(metrics, "parrot:kv_cache_written_pages")
    released = _metric(metrics, "parrot:kv_cache_released_pages_total")
    time.sleep(wait_s)
    out["rss_mb_idle"] = rss_mb(pid)
    metrics = (http_get(base + "/metrics") or b"").decode()
    out["written_pages_idle"] = _metric(metrics, "parrot:kv_cache_written_pages")
    out["released_pages"] = _metric(metrics, "parrot:kv_cache_released_pages_total") - released
    return out, answers


def serve_once(port: int, cache_dir: str, idle_s: float, requests: int, words: int, max_tokens: int,
               settle_s: float, timeout: float, log_path: Path) -> dict:
    cmd = [sys.executable, "-m", "parrot.cli", "serve", "--port", str(port), "--compilation-cache-dir", cache_dir,
           "--kv-release-idle-s", str(idle_s)]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {"kv_release_idle_s": idle_s}
    try:
        while (health := http_get(base + "/health")) is None or json.loads(health).get("status") != "ok":
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the server did not warm up; see {log_path}")
            time.sleep(0.5)
        out["warm_s"] = time.monotonic() - t0
        for kind in ("sessions", "openai"):
            out[kind], answers = _burst(base, proc.pid, kind, requests, words, max_tokens, idle_s + settle_s,
                                        timeout)
        again = _chat(base, prompt(0, words), max_tokens, timeout)
        out["same_answer_after"] = again == answers[0]
    finally:
        stop(proc, 60.0)
    return out


def run(requests: int, words: int, max_tokens: int, idle_s: float, settle_s: float, timeout: float,
        log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    from parrot import procinfo

    result: dict = {"cpu": procinfo.cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "requests": requests, "prompt_words": words, "max_tokens": max_tokens, "runs": []}
    with tempfile.TemporaryDirectory(prefix="parrot-jax-cache-") as cache:
        for s in (idle_s, 0.0):
            r = serve_once(free_port(), cache, s, requests, words, max_tokens, settle_s, timeout,
                           log_dir / f"kv_release-{s:g}.log")
            print(format_run(r), flush=True)
            result["runs"].append(r)
    give, keep = result["runs"]
    for kind in ("sessions", "openai"):
        result[f"{kind}_idle_rss_ratio"] = give[kind]["rss_mb_idle"] / keep[kind]["rss_mb_idle"]
    return result


def format_run(r: dict) -> str:
    lines = [f"--kv-release-idle-s {r['kv_release_idle_s']:g} (warm after {r['warm_s']:.0f} s):"]
    for kind in ("sessions", "openai"):
        b = r[kind]
        lines.append(f"  {kind}: {b['rss_mb_before']:.0f} MiB before; after the burst ({b['burst_s']:.1f} s) "
                     f"{b['rss_mb_peak']:.0f} MiB, {b['written_pages_peak']:.0f} pages written; idle "
                     f"{b['rss_mb_idle']:.0f} MiB, {b['written_pages_idle']:.0f} written, "
                     f"{b['released_pages']:.0f} given back")
    lines.append(f"  the first chat again: same answer {r['same_answer_after']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--idle-s", type=float, default=5.0, help="the first server's --kv-release-idle-s")
    ap.add_argument("--settle-s", type=float, default=3.0, help="seconds waited beyond --idle-s")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one server may take to warm up")
    ap.add_argument("--out", default="benchmarks/results/kv_release.json")
    args = ap.parse_args()
    r = run(args.requests, args.prompt_words, args.max_tokens, args.idle_s, args.settle_s, args.timeout,
            Path("benchmarks/results/logs"))
    for kind in ("sessions", "openai"):
        print(f"resident after the {kind} burst and idling, giving pages back / keeping them: "
              f"{r[f'{kind}_idle_rss_ratio']:.2f}x")
    print(f"CPU: {r['cpu']} ({r['cores']} cores)")
    write_json(r, args.out)


if __name__ == "__main__":
    main()
