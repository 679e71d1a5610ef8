"""The request head's deadline (parrot.header_deadline) on a real uvicorn server on loopback: silent and slow
connections are closed, while a request whose head came in time may take as long as it needs, and a kept-alive
connection gets a new deadline for each next request."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from parrot.header_deadline import HeaderDeadlineH11
from tests.servers import free_port

DEADLINE = 0.6


class _Short(HeaderDeadlineH11):
    header_timeout_s = DEADLINE


@pytest.fixture(scope="module")
def url() -> Iterator[tuple[str, int]]:
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(3 * DEADLINE)  # an answer longer than the deadline: the head came in time
        return {"ok": True}

    @app.get("/fast")
    async def fast() -> dict:
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=_Short))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (reads end) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_silent_or_trickling_connection_is_closed(url: tuple[str, int]) -> None:
    silent = socket.create_connection(url)
    trickle = socket.create_connection(url)
    trickle.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
    t0 = time.monotonic()
    assert _closed_within(silent, 10 * DEADLINE) and _closed_within(trickle, 10 * DEADLINE)
    assert time.monotonic() - t0 >= DEADLINE * 0.9
    silent.close(), trickle.close()


def test_a_request_in_time_answers_however_long_it_takes_and_the_next_has_its_own_deadline(
        url: tuple[str, int]) -> None:
    with socket.create_connection(url) as s:
        s.settimeout(10 * DEADLINE)
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b'{"ok":true}' not in answer:
            answer += s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive: a second request
        answer = b""
        while b'{"ok":true}' not in answer:
            answer += s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /fast HTTP/1.1\r\n")  # the third's head never ends: closed again
        assert _closed_within(s, 10 * DEADLINE)


def test_the_servers_take_the_deadline() -> None:
    from parrot.cli import http_server

    assert http_server(FastAPI(), "127.0.0.1", free_port()).config.http is HeaderDeadlineH11
