"""The engine processes of `parrot serve --engines N`: ports checked first, exits restarted, then given up."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from parrot.serve.engine_processes import EngineProcesses, PortsInUseError, ephemeral_ports, ports_in_use
from tests.servers import free_port, free_ports

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
EXIT3 = [sys.executable, "-c", "import sys; sys.exit(3)"]


def _until(cond, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _timed_popen():  # noqa: ANN202
    """A popen that notes when it starts each process."""
    starts: list[float] = []

    def popen(cmd: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        starts.append(time.monotonic())
        return subprocess.Popen(cmd, env=env)

    return starts, popen


def test_ports_in_use_names_a_listening_port() -> None:
    base = free_ports(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))
        s.listen()
        assert ports_in_use("127.0.0.1", [base, base + 1]) == [base + 1]
    assert ports_in_use("127.0.0.1", [base, base + 1]) == []


def test_a_taken_port_is_a_clear_error_before_anything_starts() -> None:
    base = free_ports(2)
    started: list[list[str]] = []

    def popen(cmd: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        started.append(cmd)
        return subprocess.Popen(cmd, env=env)

    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))
        s.listen()
        procs = EngineProcesses([("engine-0", base, SLEEP), ("engine-1", base + 1, SLEEP)], popen=popen)
        with pytest.raises(PortsInUseError, match=f"engine-1 on {base + 1}"):
            procs.start()
    assert started == []  # nothing was started


def test_an_engine_that_exits_is_started_again_and_others_keep_running(tmp_path) -> None:  # noqa: ANN001
    base = free_ports(2)
    # engine-1 exits once (a marker file tells the second run to stay up)
    marker = str(tmp_path / "started-once")
    flaky = [sys.executable, "-c",
             f"import os, sys, time\nif not os.path.exists({marker!r}):\n    open({marker!r}, 'w').close()\n"
             "    sys.exit(7)\ntime.sleep(60)"]
    exits: list[tuple[str, int]] = []
    procs = EngineProcesses([("engine-0", base, SLEEP), ("engine-1", base + 1, flaky)], poll_s=0.05, grace_s=5,
                            backoff_s=0.05, on_exit=lambda name, code: exits.append((name, code))).start()
    try:
        first = procs.status()[0]["pid"]
        _until(lambda: procs.status()[1]["restarts"] == 1 and procs.status()[1]["state"] == "running")
        status = procs.status()
        assert status[0]["pid"] == first and status[0]["state"] == "running" and status[0]["restarts"] == 0
        assert status[1]["last_exit_code"] == 7 and status[0]["last_exit_code"] is None
        assert exits == [("engine-1", 7)]  # told once, before the restart
    finally:
        procs.stop()
    assert all(s["state"] == "exited" for s in procs.status())


def test_an_engine_that_keeps_exiting_is_given_up(caplog: pytest.LogCaptureFixture) -> None:
    base = free_ports(1)
    procs = EngineProcesses([("engine-0", base, EXIT3)], max_restarts=2, window_s=60, backoff_s=0.05, poll_s=0.05,
                            grace_s=5)
    with caplog.at_level("ERROR", logger="parrot.serve.engine_processes"):
        procs.start()
        try:
            _until(lambda: procs.status()[0]["state"] == "given_up")
        finally:
            procs.stop()
    status = procs.status()[0]
    assert status["restarts"] == 2 and status["last_exit_code"] == 3
    assert "exited with code 3" in caplog.text and "not restarting it" in caplog.text


def test_restarts_back_off_doubling_with_each_exit() -> None:
    base = free_ports(1)
    starts, popen = _timed_popen()

    procs = EngineProcesses([("engine-0", base, EXIT3)], max_restarts=3, window_s=60, backoff_s=1.0,
                            max_backoff_s=2.0, poll_s=0.02, grace_s=5, popen=popen).start()
    waits: dict[int, float] = {}  # restarts so far -> the longest back-off seen left before the next
    try:
        def seen() -> bool:
            s = procs.status()[0]
            if s["state"] == "restarting":
                waits[s["restarts"]] = max(waits.get(s["restarts"], 0.0), s["restart_in_s"])
            return s["state"] == "given_up"

        _until(seen)
    finally:
        procs.stop()
    assert sorted(waits) == [0, 1, 2]
    assert 0.5 < waits[0] <= 1.0 and 1.5 < waits[1] <= 2.0 and 1.5 < waits[2] <= 2.0  # 1 s, 2 s, capped at 2 s
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(gaps) == 3 and gaps[0] >= 1.0 and gaps[1] >= 2.0 and gaps[2] >= 2.0  # first start, three restarts


def test_a_port_an_outgoing_connection_holds_cannot_be_listened_on() -> None:
    """Why engine ports belong below the ephemeral range: the local port connect() gave a client is
    refused to a listener (as uvicorn binds it) for as long as that connection lives."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", free_port()))
        srv.listen()
        with socket.create_connection(srv.getsockname()) as client:
            local = client.getsockname()[1]
            eph = ephemeral_ports()
            assert eph is None or local in eph
            assert ports_in_use("127.0.0.1", [local]) == [local]


def test_engine_ports_inside_the_ephemeral_range_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    eph = ephemeral_ports()
    if eph is None:
        pytest.skip("no ephemeral port range to read on this system")
    inside = next(p for p in range(eph.start + 1000, eph.stop) if not ports_in_use("127.0.0.1", [p]))
    outside = free_ports(1)
    assert outside not in eph  # the test helper keeps below the range
    for port, warned in ((outside, False), (inside, True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="parrot.serve.engine_processes"):
            procs = EngineProcesses([("engine-0", port, SLEEP)], poll_s=0.05, grace_s=5).start()
            procs.stop()
        assert ("ephemeral port range" in caplog.text) is warned, caplog.text
        if warned:
            assert f"{port}" in caplog.text and f"below {eph.start}" in caplog.text


def test_stop_ends_every_process() -> None:
    base = free_ports(2)
    procs = EngineProcesses([("engine-0", base, SLEEP), ("engine-1", base + 1, SLEEP)], poll_s=0.05, grace_s=5).start()
    pids = [s["pid"] for s in procs.status()]
    procs.stop()
    assert all(isinstance(p, int) for p in pids)
    assert all(s["state"] == "exited" for s in procs.status())


def test_stop_during_a_back_off_starts_nothing_more() -> None:
    base = free_ports(1)
    starts, popen = _timed_popen()

    procs = EngineProcesses([("engine-0", base, EXIT3)], backoff_s=30, poll_s=0.02, grace_s=5, popen=popen).start()
    _until(lambda: procs.status()[0]["state"] == "restarting")
    procs.stop()
    time.sleep(0.2)
    assert len(starts) == 1 and procs.status()[0]["state"] == "exited"


def test_an_engine_that_refuses_its_settings_is_not_restarted(caplog: pytest.LogCaptureFixture) -> None:
    """A first run that exits with a usage error (code 2: e.g. --max-model-len past the model's context) would
    exit so again: given up at once, and `all_refused` says the server has nothing to run."""
    exits: list[tuple[str, int]] = []
    exit2 = [sys.executable, "-c", "import sys; sys.exit(2)"]
    base = free_ports(2)
    procs = EngineProcesses([("engine-0", base, exit2), ("engine-1", base + 1, EXIT3)], poll_s=0.02,
                            backoff_s=0.01, on_exit=lambda name, code: exits.append((name, code))).start()
    try:
        _until(lambda: procs.status()[0]["state"] == "given_up" and ("engine-1", 3) in exits)
        assert procs.status()[0]["restarts"] == 0 and "refused its settings" in caplog.text
        assert not procs.all_refused and not procs.all_given_up  # engine-1's exit 3 is restarted
    finally:
        procs.stop()
    procs = EngineProcesses([("engine-0", base, exit2)], poll_s=0.02).start()
    try:
        _until(lambda: procs.all_refused and procs.all_given_up)
    finally:
        procs.stop()
