"""ShapeCompiler: compiles step shapes on worker threads, the most needed first, while the engine
already serves. A step whose shape is still queued moves it to the front and waits for it; a shape is
never compiled twice. XLA compiles one shape on one core, so one worker per core.

While the engine has work (`serving(True)`), queued shapes wait: compiling takes the cores the steps
run on (on 2 cores a decode step went from ~20 ms to 0.5-0.7 s beside two compiling threads), so only
shapes a step is waiting for compile then; the rest of the queue goes on whenever the engine is idle.

Tracing a program leaves its jaxpr in JAX's tracing caches for the life of the process, although the
compiled executable never needs it again: `forget_traces` drops them (`on_drained`, when the queue
runs dry)."""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from parrot import procinfo

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

log = logging.getLogger(__name__)


def forget_traces() -> None:
    """Drop the jaxprs JAX keeps of every program traced so far, and give the C heap's free memory back.
    A multi-step decode loop traces the whole model: ~8 MB of Python objects per loop, kept although its
    executable is compiled (or loaded) and held by its caller; a server's traces came to 0.1-0.17 GB.
    Executables and jit's dispatch caches stay: a function called again with new shapes is traced again."""
    from jax._src import pjit  # JAX's own caches: pinned JAX version (pyproject), checked by a test
    from jax._src.interpreters import partial_eval

    for cache in (getattr(pjit, "_infer_params_cached", None), getattr(partial_eval, "trace_to_jaxpr", None)):
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()
    procinfo.release_free_memory()


class ShapeCompiler(Generic[K, V]):
    def __init__(self, compile_fn: Callable[[K], V], workers: int | None = None,
                 on_drained: Callable[[], None] | None = None) -> None:
        """`on_drained`: called on a worker thread after a compile that leaves nothing queued or compiling,
        before that shape is handed out (see `_done_one`)."""
        self._compile = compile_fn
        self._on_drained = on_drained
        self._in_flight = 0  # compiles under way (workers' and inline ones)
        self._workers = max(1, workers or os.cpu_count() or 1)
        self._lock = threading.Condition()
        self._heap: list[tuple[int, K]] = []
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)  # promoted shapes go before every queued one
        self._futures: dict[K, concurrent.futures.Future[V]] = {}
        self._started: set[K] = set()
        self._running_workers = 0
        self._threads: list[threading.Thread] = []  # the workers started (`join`)
        self._serving = False

    # ---- queueing -------------------------------------------------------------------------------
    def submit(self, keys: Iterable[K]) -> None:
        """Queue shapes to compile in the given order (first = most needed); known ones are skipped."""
        with self._lock:
            for key in keys:
                if key not in self._futures:
                    self._futures[key] = concurrent.futures.Future()
                    heapq.heappush(self._heap, (next(self._order), key))
            self._spawn()

    def get(self, key: K) -> tuple[V, bool]:
        """The compiled value for `key`: (value, compiled_now). A queued shape is moved to the front and
        waited for; an unknown one is compiled on this thread (compiled_now: True)."""
        with self._lock:
            fut = self._futures.get(key)
            if fut is None:
                fut = self._futures[key] = concurrent.futures.Future()
                self._started.add(key)
                self._in_flight += 1
                inline = True
            else:
                inline = False
                if key not in self._started:
                    heapq.heappush(self._heap, (next(self._front), key))
                    self._spawn()
                    self._lock.notify_all()  # a worker held back while serving takes it
        if inline:
            self._run(key, fut, inline=True)
        return fut.result(), inline

    def serving(self, busy: bool) -> None:
        """The engine has work (True: only shapes a step waits for compile) or is idle (False)."""
        with self._lock:
            if self._serving != busy:
                self._serving = busy
                self._lock.notify_all()

    def cancel(self) -> None:
        """Drop every queued shape (shutting down): waiting workers exit; compiles under way finish."""
        with self._lock:
            while self._heap:
                _, key = heapq.heappop(self._heap)
                fut = self._futures.get(key)
                if key not in self._started and fut is not None and not fut.done():
                    fut.set_exception(RuntimeError(f"shape {key} was not compiled: the engine shut down"))
            self._lock.notify_all()

    def ready(self, key: K) -> bool:
        fut = self._futures.get(key)
        return fut is not None and fut.done() and fut.exception() is None

    def status(self) -> tuple[int, int]:
        """(shapes compiled, shapes known)."""
        with self._lock:
            return sum(f.done() for f in self._futures.values()), len(self._futures)

    def wait(self, keys: Iterable[K] | None = None,
             on_done: Callable[[], None] | None = None) -> None:
        """Block until the given shapes (default: all known) are compiled; re-raises the first error."""
        with self._lock:
            futures = list(self._futures.values()) if keys is None else [self._futures[k] for k in keys]
        for fut in concurrent.futures.as_completed(futures):
            fut.result()
            if on_done is not None:
                on_done()

    # ---- workers --------------------------------------------------------------------------------
    def _spawn(self) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        while self._running_workers < min(self._workers, len(self._heap)):
            self._running_workers += 1
            worker = threading.Thread(target=self._work, name="parrot-compile", daemon=True)
            self._threads.append(worker)
            worker.start()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the workers to end (after `cancel`: once the compiles under way
        finish); True if they all did. A process must not exit while a worker is inside XLA's compiler: the
        interpreter's end would stop that thread mid-way through native code, and the process would abort."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def _work(self) -> None:
        while True:
            with self._lock:
                key = None
                # a queued (not promoted) shape waits while the engine serves; promoted ones go at once
                while self._serving and self._heap and self._heap[0][0] >= 0:
                    self._lock.wait(timeout=1.0)
                while self._heap:
                    _, candidate = heapq.heappop(self._heap)
                    if candidate not in self._started:
                        key = candidate
                        self._started.add(key)
                        self._in_flight += 1
                        break
                if key is None:
                    self._running_workers -= 1
                    return
                fut = self._futures[key]
            self._run(key, fut)

    def _run(self, key: K, fut: concurrent.futures.Future[V], inline: bool = False) -> None:
        try:
            value = self._compile(key)
        except BaseException as exc:  # the waiting step reports it; the worker goes on
            log.exception("compiling %s failed", key)
            self._done_one(inline)
            fut.set_exception(exc)
            return
        self._done_one(inline)
        fut.set_result(value)

    def _done_one(self, inline: bool) -> None:
        """One compile ended. `on_drained` runs after a worker's compile that leaves nothing queued or
        compiling; not after an inline one (a shape nobody queued, compiled on the step's thread: an engine
        that compiles every shape that way, e.g. without precompiling, would drop and trace again its
        shared programs after each)."""
        with self._lock:
            self._in_flight -= 1
            drained = self._in_flight == 0 and all(k in self._started for _, k in self._heap)
        if drained and not inline and self._on_drained is not None:
            try:
                self._on_drained()
            except Exception:
                log.exception("after compiling: on_drained failed")
