"""Soak / chaos run: N client sessions x M minutes of mixed apps against a real `parrot serve`, with hostile
and unlucky clients, then a report of what happened to every request.

    python -m benchmarks.soak --sessions 8 --minutes 3 [--url http://127.0.0.1:9000] [--out FILE]

Without --url it starts `parrot serve` on a free loopback port (the default model, small buckets and a
small KV pool so that KV exhaustion happens) and stops it at the end. Traffic goes only to 127.0.0.1.
With `--engines N` the engines are separate processes, and `--kill-engine-every S` kills one of them
(SIGKILL) every S seconds; the server starts it again (parrot/serve/engine_processes.py): its work must be
re-run elsewhere, never lost.
Each client loops over random operations until the time is up:

  chain        two dependent semantic calls, read the second (latency)
  map_reduce   three map calls and a reduce, read the reduce (throughput)
  chat         an OpenAI chat completion (non-streaming)
  chat_cut     a streamed chat with max_tokens 300 whose client disconnects after a few chunks
  stream_cut   a variable stream whose reader disconnects after the first delta
  malformed    a malformed body or nonsense values on a random route (must be 4xx)
  regex        a native regex_extract with a catastrophic pattern (must fail with a clear 424)
  big          a long prompt that fills the KV pool (sessions are kept open a while: KV pressure)

Every operation ends as exactly one of: finished (the answer), failed_with_error (a 4xx with a reason,
or an SSE error event), cancelled (the client itself walked away: chat_cut / stream_cut), rejected (a
malformed request answered 4xx), lost (no answer by the end of the run plus a grace period of three
client timeouts -- a long poll that times out is asked again -- or the connection broke): lost must be
0, and 5xx answers are counted separately (must be 0). Traffic starts once every engine is warm.
Reports p50/p99 latency per operation and the server's RSS over time;
writes JSON (default benchmarks/results/soak.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

from parrot import procinfo
from parrot.sse import sse_lines

ROOT = Path(__file__).resolve().parents[1]
OPS = ["chain", "map_reduce", "chat", "chat_cut", "stream_cut", "malformed", "regex", "big"]
WEIGHTS = [3, 2, 3, 2, 2, 3, 1, 1]
SYSTEM = "You are a concise assistant. Answer in one short sentence.\n"


class Outcome(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(detail)
        self.kind = kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    """Resident memory of the process and its children (engine processes), MiB."""
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
        pids += [int(p) for p in out.split()]
    except OSError:
        pass
    total = sum(procinfo.rss_bytes(p) or 0 for p in pids)
    return total / 2**20 if total else None


class Soak:
    def __init__(self, url: str, seconds: float, clients: int, timeout: float, seed: int) -> None:
        self.url = url
        self.deadline = time.monotonic() + seconds
        self.clients = clients
        self.timeout = timeout
        self.grace = 3 * timeout  # after the run: how long unanswered work may still finish
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.by_op: dict[str, Counter[str]] = defaultdict(Counter)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.status_5xx: Counter[str] = Counter()
        self.lost: list[str] = []
        self.failed: dict[str, list[str]] = defaultdict(list)  # a few failure reasons per operation
        self.accepted = 0

    # ---- helpers ----------------------------------------------------------------------------------
    def check(self, r: httpx.Response, op: str, ok: tuple[int, ...] = (200, 201)) -> dict:
        if r.status_code >= 500:
            self.status_5xx[f"{op} {r.status_code}"] += 1
            raise Outcome("server_error", f"{r.status_code} {r.text[:200]}")
        if r.status_code not in ok:
            raise Outcome("failed_with_error", f"{r.status_code} {r.text[:200]}")
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else {}

    async def session(self, c: httpx.AsyncClient) -> tuple[str, dict]:
        body = self.check(await c.post("/v1/session", json={}), "session")
        self.accepted += 1
        return body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}

    async def call(self, c: httpx.AsyncClient, sid: str, auth: dict, template: str, params: list[dict],
                   **kw: Any) -> dict[str, str]:
        body = self.check(await c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": template, "parameters": params, **kw}), "semantic_call")
        self.accepted += 1
        return {p["name"]: p["var_id"] for p in body["param_info"]}

    async def get(self, c: httpx.AsyncClient, sid: str, auth: dict, var: str, criteria: str = "latency") -> str:
        t0 = time.monotonic()
        while True:  # a slow answer is not a lost one: poll again until the run's grace period ends
            r = await c.get(f"/v1/semantic_var/{var}", headers=auth,
                            params={"session_id": sid, "criteria": criteria, "timeout": self.timeout})
            if r.status_code != 408:
                return self.check(r, "get")["content"]
            if time.monotonic() > self.deadline + self.grace:
                raise Outcome("lost", f"variable {var} not ready after {time.monotonic() - t0:.0f}s")

    # ---- operations -------------------------------------------------------------------------------
    async def op_chain(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        s = {"max_tokens": self.rng.randint(4, 24)}
        a = await self.call(c, sid, auth, SYSTEM + "Topic: {{topic}}\nQuestion: {{q}}",
                            [{"name": "topic", "value": self.rng.choice(["rivers", "cats", "tea", "maps"])},
                             {"name": "q", "is_output": True, "sampling_config": s}])
        b = await self.call(c, sid, auth, SYSTEM + "Q: {{q}}\nA: {{a}}",
                            [{"name": "q", "var_id": a["q"]}, {"name": "a", "is_output": True, "sampling_config": s}])
        await self.get(c, sid, auth, b["a"])

    async def op_map_reduce(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        s = {"max_tokens": 12}
        maps = [await self.call(c, sid, auth, SYSTEM + "Summarize: {{doc}}\nSummary: {{s}}",
                                [{"name": "doc", "value": f"part {i}: " + "lorem ipsum " * self.rng.randint(5, 40)},
                                 {"name": "s", "is_output": True, "sampling_config": s}]) for i in range(3)]
        params = [{"name": f"s{i}", "var_id": m["s"]} for i, m in enumerate(maps)]
        params.append({"name": "all", "is_output": True, "sampling_config": s})
        red = await self.call(c, sid, auth, SYSTEM + "Parts: {{s0}} {{s1}} {{s2}}\nOverall: {{all}}", params)
        await self.get(c, sid, auth, red["all"], "throughput")

    async def op_chat(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        self.check(await c.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": self.rng.randint(4, 32), "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Say something about {self.rng.random():.4f}"}]}), "chat")
        self.accepted += 1

    async def op_chat_cut(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        body = {"model": "m", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Tell me a very long story."}]}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.check(r, "chat_cut")
            self.accepted += 1
            n, stop = 0, self.rng.randint(1, 8)
            async for line in sse_lines(r.aiter_text()):
                if line.startswith("data: "):
                    if line == "data: [DONE]":
                        return
                    if '"error"' in line:
                        raise Outcome("failed_with_error", line[:200])
                    n += 1
                    if n >= stop:
                        raise Outcome("cancelled")  # walk away mid-stream

    async def op_stream_cut(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        v = await self.call(c, sid, auth, "Write a long poem: {{p}}",
                            [{"name": "p", "is_output": True, "sampling_config": {"max_tokens": 200,
                                                                                  "ignore_eos": True}}])
        async with c.stream("GET", f"/v1/semantic_var/{v['p']}/stream", headers=auth,
                            params={"session_id": sid}) as r:
            if r.status_code != 200:
                await r.aread()
                self.check(r, "stream_cut")
            async for line in sse_lines(r.aiter_text()):
                if line.startswith("event: error"):
                    raise Outcome("failed_with_error", line)
                if line.startswith("data: "):
                    raise Outcome("cancelled")  # walk away after the first delta

    async def op_malformed(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        choice = self.rng.randrange(7)
        if choice == 0:
            r = await c.post("/v1/semantic_call", headers={**auth, "content-type": "application/json"},
                             content=b'{"session_id": "' + os.urandom(8).hex().encode() + b'", "template": ')
        elif choice == 1:
            r = await c.post("/v1/semantic_call", headers=auth, json={"session_id": sid, "template": "{{a}} {{a",
                                                                      "parameters": []})
        elif choice == 2:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [], "n": 10**6})
        elif choice == 3:
            r = await c.post("/v1/native_call", headers=auth, json={"session_id": sid, "transform": "nope",
                                                                    "inputs": {}, "outputs": ["x"]})
        elif choice == 4:
            r = await c.get("/v1/semantic_var/var-nothing", headers=auth, params={"session_id": sid})
        elif choice == 5:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": -5,
                                                      "temperature": "hot"})
        else:
            r = await c.post("/v1/semantic_var", headers={"Authorization": "Bearer forged"},
                             json={"session_id": sid, "name": "x"})
        if r.status_code >= 500:
            self.check(r, "malformed")
        if not 400 <= r.status_code < 500:
            raise Outcome("failed_with_error", f"malformed request accepted: {r.status_code}")
        raise Outcome("rejected")

    async def op_regex(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        pattern = self.rng.choice([r"(a|aa)+$", r"^(a+)+$", r"(x+x+)+y", r"^(\w+\s?)*$"])
        body = self.check(await c.post("/v1/native_call", headers=auth, json={
            "session_id": sid, "transform": "regex_extract", "params": {"pattern": pattern},
            "inputs": {"text": {"value": "a" * 60 + "!"}}, "outputs": ["output"]}), "native_call")
        self.accepted += 1
        var = next(p["var_id"] for p in body["param_info"] if p["is_output"])
        await self.get(c, sid, auth, var)

    async def op_big(self, c: httpx.AsyncClient, sid: str, auth: dict) -> None:
        doc = " ".join(f"w{self.rng.randint(0, 9999)}" for _ in range(self.rng.randint(40, 120)))
        v = await self.call(c, sid, auth, "Document: {{doc}}\nOne word: {{w}}",
                            [{"name": "doc", "value": doc}, {"name": "w", "is_output": True,
                                                            "sampling_config": {"max_tokens": 8}}])
        await self.get(c, sid, auth, v["w"])

    # ---- the run ----------------------------------------------------------------------------------
    async def client(self, idx: int) -> None:
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout + 30, limits=limits,
                                     trust_env=False) as c:
            while time.monotonic() < self.deadline:
                try:
                    sid, auth = await self.session(c)
                except Outcome as o:
                    self.record("session", o.kind, 0.0, str(o))
                    await asyncio.sleep(1)
                    continue
                except httpx.HTTPError as exc:
                    self.record("session", "lost", 0.0, repr(exc))
                    await asyncio.sleep(1)
                    continue
                for _ in range(self.rng.randint(1, 6)):  # a few operations per session, then a new one
                    if time.monotonic() >= self.deadline:
                        break
                    op = self.rng.choices(OPS, WEIGHTS)[0]
                    t0 = time.perf_counter()
                    try:
                        await asyncio.wait_for(getattr(self, f"op_{op}")(c, sid, auth),
                                               max(self.timeout, self.deadline + self.grace - time.monotonic()))
                        kind, detail = "finished", ""
                    except Outcome as o:
                        kind, detail = o.kind, str(o)
                    except (TimeoutError, httpx.HTTPError) as exc:
                        kind, detail = "lost", repr(exc)
                    self.record(op, kind, time.perf_counter() - t0, detail)
                if self.rng.random() < 0.8:  # most clients clean up; the rest leave sessions to expire
                    try:
                        await c.delete(f"/v1/session/{sid}", headers=auth)
                    except httpx.HTTPError as exc:
                        self.record("delete", "lost", 0.0, repr(exc))

    def record(self, op: str, kind: str, seconds: float, detail: str) -> None:
        self.outcomes[kind] += 1
        self.by_op[op][kind] += 1
        if kind in ("finished", "failed_with_error", "rejected"):
            self.latency[op].append(seconds)
        if kind == "lost" and len(self.lost) < 20:
            self.lost.append(f"{op}: {detail[:300]}")
        if kind == "failed_with_error" and len(self.failed[op]) < 3 and detail[:80] not in str(self.failed[op]):
            self.failed[op].append(detail[:300])

    async def chaos(self, pid: int, every: float, log: list[dict]) -> None:
        """Every `every` seconds: SIGKILL one engine process of the server (which starts it again)."""
        while time.monotonic() + every < self.deadline:
            await asyncio.sleep(every)
            out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
            engines = [int(p) for p in out.split()
                       if Path(f"/proc/{p}/cmdline").exists() and "engine" in Path(f"/proc/{p}/cmdline").read_text()]
            if not engines:
                continue
            victim = self.rng.choice(engines)
            os.kill(victim, signal.SIGKILL)
            log.append({"t_s": round(time.monotonic() - self.t_start, 1), "killed_pid": victim})

    async def run(self, pid: int | None, kill_every: float | None = None) -> dict:
        rss: list[tuple[float, float]] = []
        t_start = self.t_start = time.monotonic()
        kills: list[dict] = []

        async def sample() -> None:
            while True:
                if pid is not None and (m := rss_mb(pid)) is not None:
                    rss.append((round(time.monotonic() - t_start, 1), round(m, 1)))
                await asyncio.sleep(5)

        sampler = asyncio.create_task(sample())
        chaos = (asyncio.create_task(self.chaos(pid, kill_every, kills))
                 if pid is not None and kill_every else None)
        try:
            await asyncio.gather(*(self.client(i) for i in range(self.clients)))
        finally:
            sampler.cancel()
            if chaos is not None:
                chaos.cancel()
        async with httpx.AsyncClient(base_url=self.url, timeout=10, trust_env=False) as c:
            metrics = (await c.get("/metrics")).text
        aborted = next((float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("parrot:aborted_requests_total")), None)
        # how the engines stepped (summed over engines): multi-step calls, ahead launches, mixed steps, decode
        # bursts (multi-step calls between prompt steps)
        engine_counts = {name: sum(float(line.split()[-1]) for line in metrics.splitlines()
                                   if line.startswith(f"parrot:engine_{name}_total"))
                         for name in ("multi_step_launches", "ahead_steps", "mixed_steps", "decode_bursts")}

        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)

        all_lat = [x for xs in self.latency.values() for x in xs]
        return {
            "url": self.url, "clients": self.clients, "seconds": round(time.monotonic() - t_start, 1),
            "accepted": self.accepted, "outcomes": dict(self.outcomes),
            "lost": self.outcomes.get("lost", 0), "server_5xx": sum(self.status_5xx.values()),
            "server_5xx_by_op": dict(self.status_5xx), "lost_examples": self.lost,
            "failed_examples": dict(self.failed),
            "by_op": {op: dict(c) for op, c in self.by_op.items()},
            "latency_s": {op: {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99)}
                          for op, xs in sorted(self.latency.items())},
            "latency_all_p99_s": pct(all_lat, 0.99), "aborted_requests_total": aborted,
            "rss_mb": rss, "engine_kills": kills, "engine_counts": engine_counts,
        }


def start_server(port: int, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "parrot.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", args.model, "--kv-memory-mb", str(args.kv_memory_mb), "--max-model-len", "1024",
           "--precompile-bs-paddings", "1", "2", "4", "8", "16", "--max-batch-size", "16",
           "--precompile-token-paddings", "16", "32", "64", "128", "256", "--session-ttl", "180",
           "--transform-timeout", "0.5", "--engines", str(args.engines)]
    log = open(args.server_log, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"parrot serve exited ({proc.returncode}); see {args.server_log}")
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).json()
            if len(health.get("engines", [])) >= max(1, args.engines) and health.get("status") == "ok":
                return proc  # every engine registered and warm (its shapes compiled)
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    raise SystemExit(f"parrot serve did not start within {args.start_timeout}s; see {args.server_log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=8, help="concurrent clients, each opening sessions in turn")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--url", default=None, help="a running server on 127.0.0.1 (default: start one)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv-memory-mb", type=int, default=24, help="small: KV exhaustion is part of the run")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before an unanswered operation is lost")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=int, default=0, help="0: the engine inside the server; N: N engine processes")
    p.add_argument("--kill-engine-every", type=float, default=None, metavar="SECONDS",
                   help="with --engines: SIGKILL an engine process this often (the server starts it again)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    p.add_argument("--server-log", default=str(ROOT / "benchmarks" / "results" / "logs" / "soak-server.log"))
    args = p.parse_args(argv)
    proc = None
    if args.url is None:
        Path(args.server_log).parent.mkdir(parents=True, exist_ok=True)
        port = free_port()
        proc = start_server(port, args)
        url = f"http://127.0.0.1:{port}"
    else:
        url = args.url.rstrip("/")
        if httpx.URL(url).host not in ("127.0.0.1", "localhost"):
            raise SystemExit("the soak run only sends traffic to 127.0.0.1")
    try:
        soak = Soak(url, args.minutes * 60, args.sessions, args.timeout, args.seed)
        result = asyncio.run(soak.run(proc.pid if proc else None, args.kill_engine_every))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    rss = result["rss_mb"]
    first, last = (rss[0][1], rss[-1][1]) if rss else ("?", "?")
    print(f"{result['seconds']} s, {args.sessions} clients: accepted {result['accepted']}, outcomes "
          f"{result['outcomes']}, lost {result['lost']}, 5xx {result['server_5xx']}, "
          f"p99 {result['latency_all_p99_s']} s, aborted {result['aborted_requests_total']}, "
          f"RSS {first} -> {last} MiB; engine steps {result.get('engine_counts')}")
    print(f"wrote {args.out}")
    return 0 if result["lost"] == 0 and result["server_5xx"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
