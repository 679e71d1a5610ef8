"""Kill an engine process in the middle of an app: its unfinished tasks run again on the other engine
and the app's outputs still come. Real processes: the serve core behind uvicorn in this process, two
`parrot engine` processes on loopback that register themselves and send heartbeats."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from parrot.engine.models.llama import random_weights
from parrot.frontend.http_api import create_app
from parrot.serve.core import ParrotServeCore
from tests.conftest import TINY
from tests.engine.test_loader import write_hf_dir
from tests.servers import free_port, free_ports, running


def _wait(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path: Path):
    model_dir = write_hf_dir(tmp_path / "tiny", TINY, random_weights(TINY, seed=3))
    core = ParrotServeCore(model=str(model_dir), dead_after=2.0, default_max_tokens=8)
    with running(create_app(core)) as url:
        yield from _with_engines(core, url, model_dir)


def _with_engines(core: ParrotServeCore, url: str, model_dir: Path):  # noqa: ANN202
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "parrot.cli", "engine", "--model", str(model_dir), "--port", str(free_port()),
               "--serve-core", url, "--name", f"e{i}", "--disable-precompile", "--compilation-cache-dir", "",
               "--kv-memory-mb", "16"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env={**os.environ, "JAX_PLATFORMS": "cpu"}))
    try:
        _wait(lambda: len(core.engines.live_engines()) == 2, 120, "two engines to register")
        yield url, core, procs
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_killing_an_engine_mid_app_still_delivers_outputs(cluster) -> None:
    url, core, procs = cluster
    with httpx.Client(base_url=url, timeout=120) as c:
        body = c.post("/v1/session", json={}).json()
        sid, auth = body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}
        sampling = {"max_tokens": 120, "ignore_eos": True}
        outs = []
        for i in range(6):
            r = c.post("/v1/semantic_call", headers=auth, json={
                "session_id": sid, "template": f"Document {i}: " + "words " * (10 + i) + "\nSummary: {{s}}",
                "parameters": [{"name": "s", "is_output": True, "sampling_config": sampling}],
                "output_criteria": "throughput"})
            assert r.status_code == 201, r.text
            outs.append(r.json()["param_info"][0]["var_id"])
        # wait until both engines run tasks, then kill one of them hard
        _wait(lambda: len({t.engine for t in core.scheduler.running.values()}) == 2, 60, "tasks on both engines")
        victim = procs[0]
        victim.send_signal(signal.SIGKILL)
        results = [c.get(f"/v1/semantic_var/{v}", params={"session_id": sid, "timeout": 120}, headers=auth)
                   for v in outs]
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        assert all(isinstance(r.json()["content"], str) for r in results)
        assert [e.name for e in core.engines.live_engines()] == ["e1"]
        assert core.scheduler.requeued > 0  # the killed engine's unfinished tasks ran again on e1


def test_parrot_serve_with_engine_processes(tmp_path: Path) -> None:
    """`parrot serve --engines 2`: the serve core starts two engine processes that register themselves."""
    model_dir = write_hf_dir(tmp_path / "tiny", TINY, random_weights(TINY, seed=4))
    port, base = free_port(), free_ports(2)
    cmd = [sys.executable, "-m", "parrot.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--engines", "2", "--engine-base-port", str(base), "--disable-precompile",
           "--compilation-cache-dir", "", "--kv-memory-mb", "16"]
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def engines() -> list[str]:
            try:
                return httpx.get(f"{url}/health", timeout=2).json()["engines"]
            except httpx.HTTPError:
                return []

        try:
            _wait(lambda: len(engines()) == 2, 120, "parrot serve and its two engines")
        except AssertionError as exc:  # say why: the server's and the engines' own logs
            raise AssertionError(f"{exc}; its log ends:\n{log_path.read_text(errors='replace')[-4000:]}") from None
        with httpx.Client(base_url=url, timeout=60) as c:
            body = c.post("/v1/session", json={}).json()
            sid, auth = body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}
            r = c.post("/v1/semantic_call", headers=auth, json={
                "session_id": sid, "template": "Hello {{x}}",
                "parameters": [{"name": "x", "is_output": True, "sampling_config": {"max_tokens": 4}}]})
            var = r.json()["param_info"][0]["var_id"]
            got = c.get(f"/v1/semantic_var/{var}", params={"session_id": sid, "timeout": 60}, headers=auth)
            assert got.status_code == 200, got.text
        # an engine process killed: the server marks it dead at once (heartbeats would take 5 s, by when the
        # restarted engine has registered again: it would never be seen dead), starts it again, and it
        # registers anew
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        victim = next(int(p) for p in children if "engine-1" in Path(f"/proc/{p}/cmdline").read_text())
        os.kill(victim, signal.SIGKILL)
        try:
            _wait(lambda: "engine-1" not in engines(), 10, "engine-1 to be marked dead")
            _wait(lambda: len(engines()) == 2, 120, "engine-1 to be started again")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log ends:\n{log_path.read_text(errors='replace')[-4000:]}") from None
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    time.sleep(0.5)
    for i in range(2):  # the engine processes went down with the serve core
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", base + i)) != 0


def test_parrot_serve_refuses_engine_ports_in_use(tmp_path: Path) -> None:
    """A port another program holds is a clear error at start, not an engine that dies while the server
    serves with fewer engines than asked for."""
    model_dir = write_hf_dir(tmp_path / "tiny", TINY, random_weights(TINY, seed=4))
    base = free_ports(2)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 1))
        blocker.listen()
        done = subprocess.run([sys.executable, "-m", "parrot.cli", "serve", "--model", str(model_dir), "--port",
                               str(free_port()), "--engines", "2", "--engine-base-port", str(base),
                               "--disable-precompile"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"engine-1 on {base + 1}" in done.stderr and "--engine-base-port" in done.stderr
