"""Streaming through the servers, side by side on the same GGUF: `parrot serve` and, when installed,
llama.cpp's `llama-server` (parrot/bench/peers/install_llama_server.sh). With the real `openai` client:

- one stream: time per output token (TPOT: from the first streamed token to the last, over the tokens after
  the first; median of three streams), the median and p99 gap between streamed chunks (a server that decodes
  several steps per call streams its tokens in bursts: small median gaps, a larger p99), and TTFT;
- c concurrent streams of distinct ~250-token prompts: output tokens per second, for each c in
  `--concurrency` (default 1 and 16), and the ratio to c = 1.

Greedy, `ignore_eos`, the same prompts everywhere. This machine's floors are measured in the same run
(the float32 decode floor: the model's float32 weights over the measured read bandwidth).

    python -m benchmarks.serve_stream [--tokens 128] [--concurrency 1 16] [--avx2-too] [--exact-fills-too]
        [--single-step-too] [--out benchmarks/results/serve_stream.json]

`--avx2-too` adds a second `parrot serve` with `PARROT_CPU_MATMUL=avx2`: on a CPU with AVX-512 VNNI or AMX,
the AVX2 products side by side with the default integer ones. `--exact-fills-too` adds one with
`PARROT_BF16_FILLS=0`: prompt tokens on the integer path instead of in bfloat16.

Every server is started and stopped here (SIGINT to its own PID).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from parrot import procinfo
from parrot.engine.model_files import default_model_path

DATA = Path(__file__).resolve().parents[1] / "parrot" / "bench" / "data" / "gpl-3.0.txt"
LLAMA_SERVER = Path(os.environ.get("PARROT_PEERS_DIR", Path.home() / ".cache" / "parrot" / "peers")) / "llama-server"
SMOLLM2_PARAMS = 134_515_008


def _prompts(n: int, chars: int = 1000) -> list[str]:
    """Distinct prompts: consecutive ~250-token slices of the GPL-3.0 text."""
    text = DATA.read_text()
    return [f"Summarize this passage:\n{text[i * chars:(i + 1) * chars]}" for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, ready: Callable[[dict], bool], timeout: float) -> None:
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if ready(json.loads(r.read() or b"{}")):
                    return
        except (OSError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            raise RuntimeError(f"server at {url} did not become ready")
        time.sleep(0.5)


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, health: str, ready: Callable[[dict], bool],
                 log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port, self.health, self.ready, self.log = name, cmd, port, health, ready, log
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log, "w") as log:
            env = os.environ | self.env if self.env else None
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _wait(f"http://127.0.0.1:{self.port}{self.health}", self.proc, self.ready, timeout=1800)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _stream(client, model: str, prompt: str, tokens: int) -> tuple[float, list[float], int]:  # noqa: ANN001
    """(TTFT, chunk arrival times, tokens) of one streamed chat completion."""
    t0 = time.perf_counter()
    times: list[float] = []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    used = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return (times[0] - t0 if times else float("nan")), times, used


def measure(server: Server, model: str, tokens: int, levels: list[int]) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=1800)
    prompts = _prompts(max(*levels, 3) + 1)  # three single-stream prompts, one per level's stream, a warm-up
    _stream(client, model, prompts[-1], 16)  # warm-up: first request paths, any lazy work
    out: dict = {"rss_gb": (procinfo.rss_bytes(server.proc.pid) or 0) / 1e9}
    # one stream, three times: per-token time
    gaps, ttfts, tpots = [], [], []
    for i in range(3):
        ttft, times, used = _stream(client, model, prompts[i], tokens)
        ttfts.append(ttft)
        gaps += list(np.diff(times))
        tpots.append((times[-1] - times[0]) / (max(used, len(times)) - 1))
    out["single"] = {"ms_per_token_median": float(np.median(tpots) * 1e3),
                     "gap_ms_median": float(np.median(gaps) * 1e3), "gap_ms_p99": float(np.percentile(gaps, 99) * 1e3),
                     "ttft_s_median": float(np.median(ttfts))}
    out["concurrency"] = {}
    for c in levels:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(c) as pool:
            results = list(pool.map(lambda p: _stream(client, model, p, tokens), prompts[:c]))
        wall = time.perf_counter() - t0
        produced = sum(r[2] for r in results)
        out["concurrency"][c] = {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall}
    base = out["concurrency"].get(levels[0], {}).get("output_tok_s")
    for c in levels:
        out["concurrency"][c]["vs_first_level"] = out["concurrency"][c]["output_tok_s"] / base if base else None
    out["rss_gb_after"] = (procinfo.rss_bytes(server.proc.pid) or 0) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--port", type=int, default=0, help="first of two ports (default: free ones)")
    ap.add_argument("--parrot-args", default="--max-model-len 2048",
                    help="extra `parrot serve` arguments (quoted), e.g. '--weights f32'")
    ap.add_argument("--no-peer", action="store_true", help="skip llama-server even if installed")
    ap.add_argument("--avx2-too", action="store_true",
                    help="also a `parrot serve` with PARROT_CPU_MATMUL=avx2 (on a CPU with AVX-512 VNNI or AMX: its "
                         "AVX2 products, side by side)")
    ap.add_argument("--exact-fills-too", action="store_true",
                    help="also a `parrot serve` with PARROT_BF16_FILLS=0 (on a CPU with bf16 units: prompts "
                         "multiplied on the integer path instead of in bfloat16, side by side)")
    ap.add_argument("--single-step-too", action="store_true",
                    help="also a `parrot serve --multi-step 1` (one decode step per call, side by side with the "
                         "default multi-step decode)")
    ap.add_argument("--out", default="benchmarks/results/serve_stream.json")
    args = ap.parse_args()
    gguf = str(default_model_path())
    ports = [args.port, args.port + 1] if args.port else [_free_port(), _free_port()]
    logs = Path(tempfile.mkdtemp(prefix="parrot-serve-stream-"))
    fl = floors.measure()
    result: dict = {"machine": procinfo.cpu_name(), "model": gguf, "tokens": args.tokens, "floors": fl,
                    "decode_floor_fp32_ms": SMOLLM2_PARAMS * 4 / (fl["memory_read_gbs"] * 1e9) * 1e3, "systems": {}}
    parrot_cmd = [sys.executable, "-m", "parrot.cli", "serve", "--port", str(ports[0]), *args.parrot_args.split()]
    healthy: Callable[[dict], bool] = lambda h: h.get("status") == "ok"  # noqa: E731
    servers = [Server("parrot", parrot_cmd, ports[0], "/health", healthy, logs / "parrot.log")]
    if args.avx2_too:
        servers.append(Server("parrot-avx2", parrot_cmd, ports[0], "/health", healthy, logs / "parrot-avx2.log",
                              env={"PARROT_CPU_MATMUL": "avx2"}))
    if args.exact_fills_too:
        servers.append(Server("parrot-exact-fills", parrot_cmd, ports[0], "/health", healthy,
                              logs / "parrot-exact-fills.log", env={"PARROT_BF16_FILLS": "0"}))
    if args.single_step_too:
        servers.append(Server("parrot-single-step", [*parrot_cmd, "--multi-step", "1"], ports[0], "/health", healthy,
                              logs / "parrot-single-step.log"))
    if LLAMA_SERVER.is_file() and not args.no_peer:
        servers.append(Server("llama-server", [str(LLAMA_SERVER), "-m", gguf, "--port", str(ports[1]), "-t", "2",
                                               "-np", str(max(args.concurrency)), "-c", "32768", "--cont-batching"],
                              ports[1], "/health", lambda h: h.get("status") == "ok", logs / "llama-server.log"))
    for s in servers:
        t0 = time.monotonic()
        with s:
            started = time.monotonic() - t0
            result["systems"][s.name] = measure(s, "smollm2", args.tokens, args.concurrency) | {"ready_s": started}
        print(f"{s.name}: {json.dumps(result['systems'][s.name])}", flush=True)
    print(report(result))
    write_json(result, args.out)


def report(r: dict) -> str:
    fl = r["floors"]
    lines = [f"CPU {r['machine']}; floors: read {fl['memory_read_gbs']:.1f} GB/s, fp32 GEMM "
             f"{fl['gemm_fp32_gflops']:.0f} GFLOP/s; float32 decode floor {r['decode_floor_fp32_ms']:.1f} ms/token"]
    for name, s in r["systems"].items():
        one = s["single"]
        gaps = (f", chunk gaps p50 {one['gap_ms_median']:.1f} / p99 {one['gap_ms_p99']:.1f} ms"
                if "gap_ms_p99" in one else "")
        lines.append(f"{name}: one stream {one['ms_per_token_median']:.1f} ms/token "
                     f"({one['ms_per_token_median'] / r['decode_floor_fp32_ms']:.2f}x the float32 floor){gaps}, TTFT "
                     f"{one['ttft_s_median']:.2f} s; resident {s['rss_gb_after']:.2f} GB")
        for c, v in s["concurrency"].items():
            lines.append(f"{name}: {c} concurrent: {v['output_tok_s']:.1f} output tok/s "
                         f"({v['vs_first_level']:.2f}x the first level)")
    if "llama-server" in r["systems"]:
        ll = r["systems"]["llama-server"]["single"]
        for name, s in r["systems"].items():
            if name.startswith("parrot"):
                ratio = s["single"]["ms_per_token_median"] / ll["ms_per_token_median"]
                lines.append(f"{name} / llama-server per-token time: {ratio:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
