"""Real servers for tests: uvicorn on a free loopback port in a thread, and the serve core on top."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from parrot.engine.engine import LLMEngine
from parrot.engine.tokenizer import Tokenizer
from parrot.frontend.http_api import create_app
from parrot.serve.core import ParrotServeCore
from parrot.serve.engine_processes import ephemeral_ports, ports_in_use
from parrot.serve.engines import LocalEngineClient
from parrot.serve.tokenizers import TokenizerManager

_PORTS = random.Random()


def free_ports(n: int = 1) -> int:
    """The first of `n` consecutive loopback ports that are all free now, below the system's ephemeral range
    where it can be read: a port from that range, once its server stops (an engine process killed and
    restarted), can be taken at any moment as the local port of some outgoing connection."""
    eph = ephemeral_ports()
    low, high = (20000, eph.start - 1) if eph is not None and eph.start - 20000 >= 1000 else (None, None)
    for _ in range(200):
        if low is None:  # no room below the range, or no range known: what the system hands out
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
        else:
            base = _PORTS.randrange(low, high - n + 2)
        if base + n <= 65535 and not ports_in_use("127.0.0.1", range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def free_port() -> int:
    """A loopback port that is free now (see free_ports)."""
    return free_ports(1)


@contextmanager
def running(app: FastAPI, timeout: float = 30.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 in a thread; yields its base URL; stops it on exit."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not srv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def make_core(engine: LLMEngine | None, model_name: str, tokenizer: Tokenizer | None, **core_kw) -> ParrotServeCore:
    """A serve core whose tokenizer for `model_name` is `tokenizer` and whose one engine is `engine`."""
    tokenizers = TokenizerManager()
    if tokenizer is not None:
        tokenizers.register(model_name, tokenizer)
    core = ParrotServeCore(model=model_name, tokenizers=tokenizers, **core_kw)
    if engine is not None:
        core.engines.register(LocalEngineClient(engine, name="local"))
    return core


@contextmanager
def serving_core(engine: LLMEngine, model_name: str, tokenizer: Tokenizer, **core_kw) -> Iterator[
        tuple[str, ParrotServeCore]]:
    """The Parrot app (REST, OpenAI, metrics) over a core with `engine`, on loopback: (url, core)."""
    core = make_core(engine, model_name, tokenizer, **core_kw)
    with running(create_app(core)) as url:
        yield url, core


@contextmanager
def tiny_serving_core() -> Iterator[tuple[str, ParrotServeCore]]:
    """A serve core over the tests' tiny random model on a loopback port: (url, core)."""
    from tests.conftest import tiny_engine_config, tiny_model

    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    try:
        with serving_core(engine, "tiny", model.tokenizer) as (url, core):
            yield url, core
    finally:
        engine.shutdown()


def endless_chunked_body(url: str, method: str, path: str, headers: dict[str, str] | None = None,
                         most: int = 64 * 2**20) -> tuple[bytes, int]:
    """Send `method path` with a chunked body that does not end: wait for the answer (a route that reads no
    body gives it at once), then send on (up to `most` bytes or 30 s) until the server closes the connection or
    stops reading. Returns (the answer's first bytes, the body bytes the server took)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n{head}\r\n".encode()
                     + chunk)
        sent, t0 = len(chunk), time.monotonic()
        answer = sock.recv(65536)  # (before a reset could drop it)
        with contextlib.suppress(ConnectionError, TimeoutError):  # reset by the server, or no longer read
            while time.monotonic() - t0 < 30 and sent < most:
                sock.sendall(chunk)
                sent += len(chunk)
    return answer, sent
