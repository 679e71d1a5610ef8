"""The engine processes `parrot serve --engines N` starts, watched while the server runs.

Each engine process registers itself with the serve core and heartbeats (parrot.serve.engines); this
module only owns the processes:
- before anything starts, every engine port must be free: a port held by another program is a clear
  error at start (`PortsInUseError`), not an engine that dies at once and a server that serves with fewer
  engines than asked for. An engine port inside the system's ephemeral range (the local ports outgoing
  connections are given) gets a warning: while its engine restarts, any outgoing connection on the
  machine may take the port, and the restarted engine cannot bind it;
- a watcher thread notices an engine process that exits while the server runs, logs its exit code, tells
  the serve core at once (`on_exit`: the core marks the engine dead and re-runs its unfinished tasks
  elsewhere without waiting for its heartbeats to time out) and starts it again (it registers again),
  after a back-off that doubles with each exit within `window_s` seconds (`backoff_s`, 2 `backoff_s`,
  ... at most `max_backoff_s`), so an engine that dies at start does not spin. An engine that exits more
  than `max_restarts` times within `window_s` seconds is left down, with an error in the log, instead of
  being restarted in a loop; one whose first run exits with a usage error (code 2: it refused its settings,
  e.g. a --max-model-len past the model's context) is never restarted;
- `status()` says what each process is doing (running, restarting and when, given up; its restarts and
  last exit code): `/health` and `/metrics` show it;
- `stop()` ends them all (SIGTERM, then SIGKILL after `grace_s`).

No JAX here: only processes.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
USAGE_ERROR = 2  # the exit code of a `parrot` command that refused its arguments or settings


class PortsInUseError(RuntimeError):
    """Some engine ports are held by other programs."""


def ephemeral_ports() -> range | None:
    """The local ports the system gives outgoing connections (Linux's ip_local_port_range), or None where
    it cannot be read. A listener on such a port that stops for a moment can lose it to any connect()."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def ports_in_use(host: str, ports: Sequence[int]) -> list[int]:
    """The ports of `ports` that cannot be bound on `host` now."""
    taken = []
    for port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no clash
            try:
                s.bind((host, port))
            except OSError:
                taken.append(port)
    return taken


@dataclass
class EngineProcess:
    """One engine process: its name, port and command, and what happened to it."""

    name: str
    port: int
    command: list[str]
    proc: subprocess.Popen | None = None
    exits: list[float] = field(default_factory=list)  # time.monotonic() of each unexpected exit
    restarts: int = 0
    given_up: bool = False
    refused: bool = False  # its first run exited with a usage error (its settings): never restarted
    last_exit_code: int | None = None
    restart_at: float | None = None  # time.monotonic() when it is started again (after an exit)


class EngineProcesses:
    """Start, watch and stop a set of engine processes (see the module docstring).

    `popen` builds a process from a command and an environment (subprocess.Popen by default; tests pass
    their own to keep the output). `on_exit(name, exit code)` is called on the watcher thread for every
    exit it notices, before any restart."""

    def __init__(self, engines: Sequence[tuple[str, int, list[str]]], *, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", max_restarts: int = 3, window_s: float = 60.0,
                 backoff_s: float = 1.0, max_backoff_s: float = 8.0, poll_s: float = 0.5, grace_s: float = 30.0,
                 popen: Callable[[list[str], dict[str, str] | None], subprocess.Popen] | None = None,
                 on_exit: Callable[[str, int], None] | None = None) -> None:
        self.engines = [EngineProcess(name, port, list(cmd)) for name, port, cmd in engines]
        self.env, self.host = env, host
        self.max_restarts, self.window_s, self.poll_s, self.grace_s = max_restarts, window_s, poll_s, grace_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._popen = popen or (lambda cmd, env: subprocess.Popen(cmd, env=env))
        self._on_exit = on_exit
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self) -> EngineProcesses:
        """Check the ports, start every process and the watcher. PortsInUseError if a port is taken."""
        taken = ports_in_use(self.host, [e.port for e in self.engines])
        if taken:
            names = ", ".join(f"{e.name} on {e.port}" for e in self.engines if e.port in taken)
            raise PortsInUseError(f"engine port(s) already in use: {names}; choose other ports with "
                                  "--engine-base-port (engine i listens on it + i)")
        eph = ephemeral_ports()
        if eph is not None and (inside := [e.port for e in self.engines if e.port in eph]):
            log.warning("engine port(s) %s lie in the ephemeral port range %d-%d: an engine restarted there can "
                        "find its port taken by an outgoing connection; a --engine-base-port below %d avoids it",
                        ", ".join(map(str, inside)), eph.start, eph.stop - 1, eph.start)
        with self._lock:
            for e in self.engines:
                e.proc = self._popen(e.command, self.env)
        self._watcher = threading.Thread(target=self._watch, name="engine-processes", daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for e in self.engines:
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._check(e)

    def _check(self, e: EngineProcess) -> None:
        """With the lock held: start `e` again once its back-off has passed; if its process exited, tell
        `on_exit` and set when it starts again (or give it up if it exited too often)."""
        if e.given_up or e.proc is None:
            return
        now = time.monotonic()
        if e.restart_at is not None:
            if now >= e.restart_at:
                e.restart_at = None
                e.restarts += 1
                e.proc = self._popen(e.command, self.env)
            return
        if (code := e.proc.poll()) is None:
            return
        e.last_exit_code = code
        first_run = not e.exits and e.restarts == 0
        e.exits = [t for t in e.exits if now - t < self.window_s] + [now]
        if first_run and code == USAGE_ERROR:  # `parrot engine` refused its settings: a restart would too
            e.given_up = e.refused = True
            log.error("engine process %r (port %d) refused its settings (exit code %d, its error above): not "
                      "restarting it", e.name, e.port, code)
        elif len(e.exits) > self.max_restarts:
            e.given_up = True
            log.error("engine process %r (port %d) exited with code %s, %d times in %.0f s: not restarting it; "
                      "the server runs on without it", e.name, e.port, code, len(e.exits), self.window_s)
        else:
            delay = min(self.backoff_s * 2 ** (len(e.exits) - 1), self.max_backoff_s)
            e.restart_at = now + delay
            log.error("engine process %r (port %d) exited with code %s; starting it again in %.1f s", e.name,
                      e.port, code, delay)
        if self._on_exit is not None:
            try:
                self._on_exit(e.name, code)
            except Exception:  # noqa: BLE001 (a callback's failure must not stop the watcher)
                log.exception("engine process %r: the exit callback failed", e.name)

    @property
    def all_given_up(self) -> bool:
        """Every process is down for good: none will serve again."""
        return all(e.given_up for e in self.engines)

    @property
    def all_refused(self) -> bool:
        """Every process refused its settings at its first start (`parrot engine` exited with a usage error)."""
        return all(e.refused for e in self.engines)

    def status(self) -> list[dict[str, object]]:
        """Each process: name, port, pid, state ("running", "restarting", "given_up" or "exited": stopped
        with the server), restarts, last_exit_code, and restart_in_s while it waits to start again."""
        now = time.monotonic()
        out: list[dict[str, object]] = []
        with self._lock:
            for e in self.engines:
                running = e.proc is not None and e.restart_at is None and e.proc.poll() is None
                state = ("given_up" if e.given_up else "restarting" if e.restart_at is not None
                         else "running" if running else "exited")
                row: dict[str, object] = {"name": e.name, "port": e.port, "pid": e.proc.pid if e.proc else None,
                                          "state": state, "restarts": e.restarts, "last_exit_code": e.last_exit_code}
                if e.restart_at is not None:
                    row["restart_in_s"] = round(max(0.0, e.restart_at - now), 2)
                out.append(row)
        return out

    def stop(self) -> None:
        """Stop watching, then end every process: SIGTERM, SIGKILL after `grace_s` seconds."""
        self._stopping.set()
        with self._lock:
            for e in self.engines:
                e.restart_at = None  # a restart still waiting for its back-off never comes
            procs = [e.proc for e in self.engines if e.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + self.grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("engine process %d did not stop within %.0f s: killing it", p.pid, self.grace_s)
                p.kill()
                p.wait()
        if self._watcher is not None:
            self._watcher.join(timeout=self.poll_s * 4)
