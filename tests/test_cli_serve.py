"""`parrot serve --engines N` starts engine processes with the settings they need: the compilation cache,
the log format and the serve core's API key; `--api-key` / PARROT_API_KEY reach the serve core; the server
says where it listens once it does."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI

from parrot import cli
from parrot.engine.model_files import default_model_path
from parrot.errors import ModelLoadError, ParrotError
from parrot.serve import tokenizers
from tests.conftest import tiny_tokenizer
from tests.servers import free_port, free_ports


def test_serve_passes_engine_settings_and_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[list[str], dict]] = []
    apps: list[object] = []

    class FakePopen:
        def __init__(self, cmd: list[str], env: dict | None = None, **kw: object) -> None:
            started.append((cmd, env or {}))

            self.pid, self.code = 4242, None

        def poll(self) -> int | None:
            return self.code

        def terminate(self) -> None:
            self.code = -15

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    class FakeServer:
        def __init__(self, app: object) -> None:
            apps.append(app)

        def run(self, sockets: list | None = None) -> None:
            assert sockets and sockets[0].getsockname()[1] == port  # the port taken before anything loaded

    monkeypatch.setattr(cli, "http_server", lambda app, host, port, *more, **kw: FakeServer(app))
    registered: dict[str, object] = {}
    monkeypatch.setattr(tokenizers.TokenizerManager, "get",
                        lambda self, model: registered.get(model, tiny_tokenizer()))
    monkeypatch.setattr(tokenizers.TokenizerManager, "register",
                        lambda self, model, tok: registered.update({model: tok}))
    monkeypatch.delenv("PARROT_API_KEY", raising=False)
    port = free_port()
    args = cli.build_parser().parse_args(["serve", "--port", str(port), "--engines", "2",
                                          "--engine-base-port", str(free_ports(2)),
                                          "--compilation-cache-dir", "/tmp/cc",
                                          "--log-format", "json", "--api-key", "k3y", "--max-sessions", "5",
                                          "--speculative-tokens", "3", "--speculative-ngram", "1", "4",
                                          "--kv-cache-dtype", "bfloat16", "--v-dtype", "fp8_e4m3", "--dtype", "Q8_0",
                                          "--seed", "7", "--chat-template", "{{ messages[0]['content'] }}!"])
    assert cli.cmd_serve(args) == 0
    assert len(started) == 2 and len(apps) == 1
    # the chats are rendered with the template given (the serve core renders them, not the engines)
    assert registered["smollm2"].apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    for i, (cmd, env) in enumerate(started):
        engine_args = cli.build_parser().parse_args(cmd[cmd.index("engine"):])  # the engine's own command line
        engine = cli.engine_config_from_args(engine_args)
        assert (engine.speculative_tokens, engine.speculative_min_ngram, engine.speculative_ngram) == (3, 1, 4)
        assert (engine.kv_dtype, engine.v_dtype, engine.weights) == ("bf16", "fp8", "q8_0")
        assert cmd[cmd.index("--compilation-cache-dir") + 1] == "/tmp/cc"
        assert cmd[cmd.index("--log-format") + 1] == "json"
        assert cmd[cmd.index("--name") + 1] == f"engine-{i}"
        # an engine key of its own, not the clients' API key: a client cannot register an engine
        assert env["PARROT_ENGINE_KEY"] == started[0][1]["PARROT_ENGINE_KEY"] != "k3y"
        assert len(env["PARROT_ENGINE_KEY"]) >= 32
        monkeypatch.setenv("PARROT_ENGINE_KEY", env["PARROT_ENGINE_KEY"])
        assert cli.build_parser().parse_args(cmd[cmd.index("engine"):]).serve_core_api_key == env["PARROT_ENGINE_KEY"]
        monkeypatch.delenv("PARROT_ENGINE_KEY")
    config = cli.serve_config_from_args(args)
    assert config.api_key == "k3y" and config.max_sessions == 5 and config.seed == 7  # the core seeds sampled calls
    monkeypatch.setenv("PARROT_API_KEY", "from-env")
    assert cli.serve_config_from_args(cli.build_parser().parse_args(["serve"])).api_key == "from-env"
    assert config.fair_share
    assert not cli.serve_config_from_args(cli.build_parser().parse_args(["serve", "--no-fair-share"])).fair_share


def test_a_port_in_use_or_a_foreign_host_fails_before_the_model_loads(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import parrot.engine.loader as loader

    def no_load(*args: object, **kw: object) -> None:
        raise AssertionError("the model loaded before the port was taken")

    monkeypatch.setattr(loader, "load_model", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert cli.main(["serve", "--host", "999.1.1.1", "--port", str(free_port())]) == 2
    assert "cannot listen on 999.1.1.1" in capsys.readouterr().err
    # two servers started together: the second fails (its socket bound with SO_REUSEADDR while the first's had
    # not listened yet shared the address, and never listened)
    port = free_port()
    first = cli.listening_socket("127.0.0.1", port)
    try:
        with pytest.raises(ParrotError, match="cannot listen"):
            cli.listening_socket("127.0.0.1", port)
    finally:
        first.close()


def test_the_server_says_where_it_listens(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    port = free_port()
    server = cli.http_server(app, "127.0.0.1", port)
    with caplog.at_level(logging.INFO, logger="parrot.serve"):
        thread = threading.Thread(target=server.run)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not any("listening on" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline and thread.is_alive(), "no 'listening on' line"
                time.sleep(0.05)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:  # it does listen
                assert r.status == 200
        finally:
            server.should_exit = True
            thread.join(30)
    said = next(r.getMessage() for r in caplog.records if "listening on" in r.getMessage())
    url = f"http://127.0.0.1:{port}"
    assert said.startswith(f"listening on {url}:") and f"{url}/v1," in said and f"{url}/ui" in said


def _need_the_default_model() -> None:
    try:
        default_model_path()
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")


def _serve(args: list[str], log_path: Path) -> subprocess.Popen:
    """`parrot serve ARGS` as a process, its output to `log_path` (a file, not a pipe: an engine process
    left running would hold a pipe open)."""
    with open(log_path, "w") as log_file:
        return subprocess.Popen([sys.executable, "-m", "parrot.cli", "serve", *args], stdout=log_file,
                                stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _health_when(proc: subprocess.Popen, port: int, ready: Callable[[dict], bool], timeout: float = 120) -> dict:
    """The server's /health once `ready` says so."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "parrot serve did not get ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                health = json.loads(r.read())
            if ready(health):
                return health
        except OSError:
            pass
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, sig: signal.Signals, timeout: float = 150) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.mark.model
def test_ctrl_c_while_shapes_compile_exits_cleanly(tmp_path: Path) -> None:
    """`parrot serve` with the default model, interrupted (SIGINT, as Ctrl-C) right after it listens, while its
    shapes still compile in the background: it waits for the compile under way and exits with 0; no
    traceback, no abort (a process ending while a thread is inside XLA's compiler aborts)."""
    _need_the_default_model()
    port, log_path = free_port(), tmp_path / "serve.log"
    proc = _serve(["--port", str(port), "--compilation-cache-dir", str(tmp_path / "cache")], log_path)  # fresh
    try:
        health = _health_when(proc, port, lambda h: True)
        assert health["status"] == "warming_up"  # interrupted while compiling
    finally:
        _stop(proc, signal.SIGINT)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "terminate called" not in out, out[-3000:]


SLOW_LOAD = """
import gc, pathlib, sys, time
import parrot.engine.loader as loader
def load_model(*args, **kw):  # a model that takes seconds to load: the marker says it has begun
    pathlib.Path(sys.argv[1]).touch()
    if sys.argv[3] == "plain":
        time.sleep(60)
    gc.callbacks.append(lambda *a: time.sleep(0.2))  # as JAX's: a Ctrl-C raised in it is dropped by Python
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:
        gc.collect()
    gc.callbacks.pop()
    return None  # the interrupt is noted: nothing reads this model
loader.load_model = load_model
from parrot import cli
sys.exit(cli.main(["serve", "--port", sys.argv[2]]))
"""


@pytest.mark.parametrize("where", ["plain", "gc-callback"])
def test_ctrl_c_while_the_model_loads_says_interrupted(where: str, tmp_path: Path) -> None:
    """Ctrl-C before the server runs (its model loading): `parrot: interrupted` and exit code 130, no traceback
    (before, Python's KeyboardInterrupt traceback); also where Python drops the KeyboardInterrupt, raised in a
    garbage-collector callback (JAX has one; before, the server went on to serve)."""
    marker = tmp_path / "loading"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, str(marker), str(free_port()), where],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.monotonic()
        _stop(proc, signal.SIGINT, timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 130, out[-3000:]
    assert "parrot: interrupted" in out and "Traceback" not in out, out[-3000:]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read().lower()
    except OSError:
        return False


def _ends_within(pid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"engine process {pid} still running after the serve core stopped")
        time.sleep(0.1)


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_engine_processes_end_with_the_serve_core(sig: signal.Signals, tmp_path: Path) -> None:
    """`parrot serve --engines 1` sent SIGTERM (systemd, docker stop): as with Ctrl-C, it shuts down gracefully,
    stops its engine process and exits with 0 (the signal's default action would leave the engine running).
    Killed (SIGKILL: nothing of it runs), its engine process sees its parent gone and stops by itself."""
    _need_the_default_model()
    port, log_path = free_port(), tmp_path / "serve.log"
    proc = _serve(["--port", str(port), "--engines", "1", "--engine-base-port", str(free_ports(1)),
                   "--disable-precompile"], log_path)
    child = None
    try:
        health = _health_when(proc, port, lambda h: "engine-0" in h.get("engines", []))  # registered: it runs
        child = health["engine_processes"][0]["pid"]
    finally:
        try:
            _stop(proc, sig, timeout=120)
        finally:
            if child is not None:
                _ends_within(child, 30)  # killed if not: no test leaves an engine behind
    if sig == signal.SIGTERM:
        assert proc.returncode == 0, log_path.read_text()[-3000:]


def test_behind_a_proxy_prefix_and_the_ping_route() -> None:
    """--root-path: the proxy strips its prefix; the open routes stay open (/health, and /ping as SageMaker and
    vLLM name it, GET or POST), the others guarded, errors in each API's shape, the page's assets relative."""
    from parrot.config import ServeConfig
    from parrot.engine.engine import LLMEngine
    from parrot.frontend.http_api import create_app
    from tests.conftest import tiny_engine_config, tiny_model
    from tests.servers import make_core

    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    core = make_core(engine, "tiny", model.tokenizer, config=ServeConfig(model="tiny", api_key="k"))
    port = free_port()
    server = cli.http_server(create_app(core), "127.0.0.1", port, root_path="/parrot")
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        import httpx

        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            deadline = time.monotonic() + 60
            while not server.started:
                assert time.monotonic() < deadline and thread.is_alive()
                time.sleep(0.05)
            for r in (c.get("/health"), c.get("/ping"), c.post("/ping")):
                assert r.status_code == 200 and r.json()["status"] == "ok", r.text
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "tiny"
            missing = c.get("/v1/nothing", headers={"Authorization": "Bearer k"})
            assert missing.status_code == 404 and "error" in missing.json()  # the OpenAI shape under /v1/
            page = c.get("/ui")
            assert page.status_code == 200 and 'src="ui/ui.js"' in page.text
            spec = c.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
            assert spec["servers"] == [{"url": "/parrot"}]  # the docs page calls the API through the proxy
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_https_with_a_key_and_certificate(tmp_path: Path) -> None:
    """--ssl-keyfile / --ssl-certfile: the server speaks TLS."""
    import httpx

    key, cert = _certificate(tmp_path)
    args = cli.build_parser().parse_args(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    assert cli._tls(args) == (str(key), str(cert))
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    port = free_port()
    server = cli.http_server(app, "127.0.0.1", port, ssl=(str(key), str(cert)))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        import ssl

        trusted = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(f"https://127.0.0.1:{port}/health", verify=trusted).json() == {"status": "ok"}
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not answered
    finally:
        server.should_exit = True
        thread.join(30)


def _certificate(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key: (key file, certificate file)."""
    key, cert = where / "key.pem", where / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_bad_tls_settings_fail_before_anything_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing or mismatched file, one without the other, or TLS with engine processes: a clear error."""
    key, cert = _certificate(tmp_path)
    port = str(free_port())
    for argv, said in ((["--ssl-keyfile", str(key)], "both --ssl-keyfile and --ssl-certfile"),
                       (["--ssl-keyfile", str(cert), "--ssl-certfile", str(cert)], "cannot use the TLS key"),
                       (["--ssl-keyfile", str(tmp_path / "no"), "--ssl-certfile", str(cert)], "cannot use the TLS key"),
                       (["--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--engines", "2"], "at a proxy")):
        assert cli.main(["serve", "--port", port, *argv]) == 2
        assert said in capsys.readouterr().err


def test_engine_processes_reach_the_core_at_a_local_url(capsys: pytest.CaptureFixture[str]) -> None:
    """`--host ::` or `0.0.0.0`: engines register at loopback (an IPv6 address in brackets); engine ports past 65535
    are a usage error, not a traceback."""
    assert cli.local_url("0.0.0.0", 9000) == "http://127.0.0.1:9000"
    assert cli.local_url("::", 9000) == "http://[::1]:9000"
    assert cli.local_url("fe80::1", 9) == "http://[fe80::1]:9" and cli.local_url("10.0.0.2", 9) == "http://10.0.0.2:9"
    assert cli.main(["serve", "--port", str(free_port()), "--engines", "2", "--engine-base-port", "65535"]) == 2
    assert "past 65535" in capsys.readouterr().err


def test_health_is_503_once_every_engine_process_is_given_up() -> None:
    """With --engines N, every process down for good (given up, or refused its settings): nothing can serve again,
    so a liveness probe must see it (it said 200 "degraded" for good)."""
    import httpx

    from parrot.frontend.http_api import create_app
    from tests.servers import make_core, running

    class Processes:
        all_given_up = True
        state = "given_up"

        def status(self) -> list[dict]:
            return [{"name": "engine-0", "state": self.state, "last_exit_code": 2}]

    core = make_core(None, "tiny", tiny_tokenizer())
    procs = Processes()
    core.engine_processes = procs  # type: ignore[assignment]
    with running(create_app(core)) as url:
        r = httpx.get(f"{url}/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "engine_dead" and "engine-0" in r.json()["dead"]
        assert r.json()["engine_processes"][0]["state"] == "given_up"  # what each process did, there too
        procs.all_given_up, procs.state = False, "restarting"  # none live, one coming back: no_engine, not degraded
        r = httpx.get(f"{url}/health", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "no_engine"
