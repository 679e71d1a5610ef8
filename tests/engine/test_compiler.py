"""ShapeCompiler with a fake compile function: order, promotion of a shape a step waits for, never
compiling a shape twice, unknown shapes compiled inline, errors reaching the waiting step."""

from __future__ import annotations

import threading
import time

import pytest

from parrot.engine.compiler import ShapeCompiler


class FakeCompile:
    def __init__(self, seconds: float = 0.0, fail: set[int] | None = None) -> None:
        self.seconds, self.fail = seconds, fail or set()
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, key: int) -> str:
        with self.lock:
            self.calls.append(key)
        time.sleep(self.seconds)
        if key in self.fail:
            raise RuntimeError(f"cannot compile {key}")
        return f"exe-{key}"


def test_compiles_in_the_given_order_each_once() -> None:
    fake = FakeCompile()
    c = ShapeCompiler(fake, workers=1)
    c.submit([3, 1, 2])
    c.submit([1, 4])  # known shapes are not queued again
    c.wait()
    assert fake.calls == [3, 1, 2, 4]
    assert c.status() == (4, 4) and c.ready(2)


def test_a_waiting_step_moves_its_shape_to_the_front() -> None:
    fake = FakeCompile(seconds=0.05)
    c = ShapeCompiler(fake, workers=1)
    c.submit(list(range(20)))
    value, compiled_now = c.get(19)
    assert value == "exe-19" and not compiled_now
    assert fake.calls.index(19) <= 2  # compiled right after the shape(s) already being worked on
    c.wait()
    assert sorted(fake.calls) == list(range(20))  # nothing twice


def test_unknown_shapes_compile_inline_once_for_concurrent_callers() -> None:
    fake = FakeCompile(seconds=0.1)
    c = ShapeCompiler(fake, workers=2)
    results: list[tuple[str, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(c.get(7))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.calls == [7]
    assert sorted(r[1] for r in results) == [False, False, True]  # one compiled it, two waited


def test_a_failed_shape_fails_its_waiters_and_not_the_others() -> None:
    fake = FakeCompile(fail={2})
    c = ShapeCompiler(fake, workers=2)
    c.submit([1, 2, 3])
    with pytest.raises(RuntimeError, match="cannot compile 2"):
        c.get(2)
    assert c.get(3) == ("exe-3", False) and not c.ready(2)
    c.wait([1])  # its worker may still be finishing it on a loaded machine
    assert c.ready(1)


def test_queued_shapes_wait_while_the_engine_serves() -> None:
    """Serving: only a shape a step waits for compiles; the queue goes on once the engine is idle."""
    fake = FakeCompile()
    c = ShapeCompiler(fake, workers=1)
    c.serving(True)
    c.submit([1, 2, 3])
    time.sleep(0.2)
    assert fake.calls == []  # held back: the cores belong to the steps
    assert c.get(3) == ("exe-3", False)  # a step waits for 3: compiled at once
    time.sleep(0.1)
    assert fake.calls == [3]
    c.serving(False)
    c.wait()
    assert fake.calls == [3, 1, 2]


def test_cancel_drops_the_queue() -> None:
    fake = FakeCompile()
    c = ShapeCompiler(fake, workers=1)
    c.serving(True)
    c.submit([1, 2])
    c.cancel()
    c.serving(False)
    time.sleep(0.1)
    assert fake.calls == []
    with pytest.raises(RuntimeError, match="engine shut down"):  # waiters learn the shapes will not come
        c.wait()


def test_on_drained_runs_when_the_last_queued_shape_is_compiled() -> None:
    fake = FakeCompile(seconds=0.02)
    drained: list[list[int]] = []
    c = ShapeCompiler(fake, workers=2, on_drained=lambda: drained.append(sorted(fake.calls)))
    c.submit(list(range(6)))
    c.get(5)  # promoted: its stale heap entry must not keep the queue from counting as drained
    c.wait()
    assert drained and drained[0] == list(range(6))  # not before every shape was compiled
    assert c.status() == (6, 6) and len(drained) == 1
    c.get(9)  # compiled inline later, on the caller's thread: not a drained queue
    c.submit([10])
    c.wait()
    assert len(drained) == 2 and drained[-1] == list(range(6)) + [9, 10]


def test_on_drained_runs_before_the_last_shape_is_handed_out() -> None:
    order: list[str] = []
    c = ShapeCompiler(lambda k: order.append("compiled") or k, workers=1, on_drained=lambda: order.append("drained"))
    c.submit([1])
    c.wait(on_done=lambda: order.append("handed out"))
    assert order == ["compiled", "drained", "handed out"]


def test_on_drained_errors_do_not_fail_the_shape() -> None:
    c = ShapeCompiler(lambda k: k * 2, workers=1, on_drained=lambda: 1 / 0)
    c.submit([4])
    assert c.get(4) == (8, False)


def test_forget_traces_drops_the_jaxprs_of_compiled_programs() -> None:
    import gc

    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import partial_eval

    from parrot.engine.compiler import forget_traces

    def program(x: jax.Array) -> jax.Array:
        return jnp.sin(x) * 2.0

    fn = jax.jit(program)
    exe = fn.lower(jax.ShapeDtypeStruct((8,), jnp.float32)).compile()
    assert partial_eval.trace_to_jaxpr.cache_info().currsize > 0
    forget_traces()
    gc.collect()
    assert partial_eval.trace_to_jaxpr.cache_info().currsize == 0
    assert float(exe(jnp.ones(8, jnp.float32))[0]) == pytest.approx(2 * 0.8414709848)  # the executable still runs
    assert float(fn(jnp.ones(8, jnp.float32))[0]) == pytest.approx(2 * 0.8414709848)  # and the function traces again
