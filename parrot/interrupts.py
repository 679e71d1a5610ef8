"""How a command stops on signals: Ctrl-C while a server starts, never lost; SIGTERM as Ctrl-C while it serves;
an engine process that ends with its parent.

Python turns SIGINT into a KeyboardInterrupt raised in whatever Python code runs at that moment. While a model
loads and JAX starts, that is often a garbage-collector callback (JAX registers one), where CPython drops the
exception with an "Exception ignored in" warning: the server then went on loading and served, the Ctrl-C lost.
`remember_sigint` keeps Python's behaviour and also notes the signal (and keeps such a dropped KeyboardInterrupt
from printing its traceback); `stop_if_interrupted`, called where a command moves from one stage of its
start-up to the next, raises the KeyboardInterrupt again if one was noted. Once uvicorn serves, it handles SIGINT
itself (a graceful shutdown), and `sigterm_as_interrupt` makes SIGTERM take the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sys import UnraisableHookArgs

log = logging.getLogger("parrot.serve")

_seen = threading.Event()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _seen.set()
    signal.default_int_handler(signum, frame)


def _unraisable(previous: Callable[[UnraisableHookArgs], object]) -> Callable[[UnraisableHookArgs], object]:
    def hook(info: UnraisableHookArgs) -> object:
        if isinstance(info.exc_value, KeyboardInterrupt) and _seen.is_set():
            return None  # noted: `stop_if_interrupted` raises it again
        return previous(info)

    hook.parrot_interrupts = True  # type: ignore[attr-defined]
    return hook


def remember_sigint() -> None:
    """Note each SIGINT from now on (on the main thread, where Python's own handler is installed: a SIGINT
    ignored, as by `nohup` or a non-interactive shell's background job, stays ignored); forget earlier ones."""
    _seen.clear()
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        if not getattr(sys.unraisablehook, "parrot_interrupts", False):
            sys.unraisablehook = _unraisable(sys.unraisablehook)


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a SIGINT came since `remember_sigint` (whether or not its own was lost)."""
    if _seen.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (systemd, docker stop, kill) handled as Ctrl-C while the server runs. uvicorn shuts down gracefully
    on either, then raises the signal again with the process's own handler: SIGTERM's default one would end the
    process there, its engine not shut down and `--engines N`'s processes left running; this one raises
    KeyboardInterrupt, so the server's own stop runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


PARENT_POLL_S = 1.0  # how often an engine process started with --exit-with-parent checks its parent


def exit_with_parent(pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Send this process SIGTERM (a graceful stop: `sigterm_as_interrupt`) once `pid` is no longer its parent:
    the parent ended, however (SIGKILL included), and the process was handed to another."""
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(poll_s)
        log.warning("parent process %d ended: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parrot-parent-watch", daemon=True).start()
