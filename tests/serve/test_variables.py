"""Semantic variables: set-once state, waiting and streaming across loops and threads; the manager."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from parrot.errors import ConflictError, InvalidRequestError, NotFoundError, ParrotError, RateLimitError
from parrot.serve.variables import (
    SemanticVariable,
    SemanticVariableManager,
    VariableFailedError,
    VariableState,
    constant_id,
)


def run(coro):
    return asyncio.run(coro)


def test_set_once():
    v = SemanticVariable("v1", "x", "s1")
    assert v.state is VariableState.PENDING and v.content is None and v.is_pending
    v.set("hello")
    assert v.is_ready and v.content == "hello"
    with pytest.raises(ConflictError, match="already set"):
        v.set("again")
    with pytest.raises(ConflictError, match="already set"):
        v.fail("nope")
    with pytest.raises(ConflictError):
        v.append_stream("more")
    assert not v.fail_if_pending("late")
    assert v.content == "hello"


def test_fail_once():
    v = SemanticVariable("v1", "x", "s1")
    v.fail("engine died")
    assert v.is_failed and v.error == "engine died"
    with pytest.raises(ConflictError, match="failed"):
        v.set("x")
    with pytest.raises(ConflictError):
        v.fail("again")


def test_set_rejects_non_string():
    with pytest.raises(InvalidRequestError):
        SemanticVariable("v1", "x", "s1").set(3)  # type: ignore[arg-type]


def test_wait_ready_failed_timeout():
    async def main():
        v = SemanticVariable("v1", "x", "s1")
        waiter = asyncio.create_task(v.wait(5))
        await asyncio.sleep(0.01)
        v.set("done")
        assert await waiter == "done"
        assert await v.wait(0) == "done"

        f = SemanticVariable("v2", "y", "s1")
        waiter = asyncio.create_task(f.wait())
        await asyncio.sleep(0)
        f.fail("boom")
        with pytest.raises(VariableFailedError, match="boom") as info:
            await waiter
        assert isinstance(info.value, ParrotError) and info.value.var_id == "v2"

        p = SemanticVariable("v3", "z", "s1")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await p.wait(0.05)
        assert time.monotonic() - t0 < 1
        assert p._waiters == []  # the timed-out waiter left no trace
        with pytest.raises(TimeoutError):
            await p.wait(0)
    run(main())


def test_wait_survives_stream_updates_and_keeps_deadline():
    async def main():
        v = SemanticVariable("v1", "x", "s1")

        async def feed():
            for i in range(5):
                await asyncio.sleep(0.01)
                v.append_stream(str(i))
        feeder = asyncio.create_task(feed())
        with pytest.raises(TimeoutError):
            await v.wait(0.03)
        await feeder
        v.set("01234")
        assert await v.wait(1) == "01234"
    run(main())


def test_wait_from_other_threads_and_loops():
    v = SemanticVariable("v1", "x", "s1")
    results: list[str] = []

    def reader():
        results.append(asyncio.run(v.wait(5)))

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    threading.Thread(target=v.set, args=("cross-thread",)).start()
    for t in threads:
        t.join(5)
    assert results == ["cross-thread"] * 4


def test_closed_loop_waiter_does_not_break_set():
    v = SemanticVariable("v1", "x", "s1")
    with pytest.raises(TimeoutError):
        run(v.wait(0.01))
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    v._waiters.append((loop, fut))  # a waiter whose loop went away
    loop.close()
    v.set("ok")
    assert v.content == "ok"


def test_stream_live_and_late_subscriber():
    async def main():
        v = SemanticVariable("v1", "x", "s1")

        async def collect():
            return [d async for d in v.stream()]
        early = asyncio.create_task(collect())
        await asyncio.sleep(0)
        for piece in ["Hel", "lo", " world"]:
            v.append_stream(piece)
            await asyncio.sleep(0)
        late = asyncio.create_task(collect())
        await asyncio.sleep(0)
        v.set("Hello world!")  # the final content extends the stream: the rest arrives as a last delta
        assert "".join(await early) == "Hello world!"
        assert "".join(await late) == "Hello world!"
        assert "".join([d async for d in v.stream()]) == "Hello world!"
    run(main())


def test_stream_of_set_variable_and_failure():
    async def main():
        v = SemanticVariable("v1", "x", "s1", content="whole")
        assert [d async for d in v.stream()] == ["whole"]

        f = SemanticVariable("v2", "y", "s1")
        f.append_stream("part")
        f.fail("engine lost")
        got = []
        with pytest.raises(VariableFailedError, match="engine lost"):
            async for d in f.stream():
                got.append(d)
        assert got == ["part"]

        m = SemanticVariable("v3", "z", "s1")
        m.append_stream("abc")
        m.set("xyz")  # does not extend the stream: no correction delta
        assert [d async for d in m.stream()] == ["abc"]
    run(main())


def test_stream_from_producer_thread():
    v = SemanticVariable("v1", "x", "s1")

    def produce():
        for i in range(20):
            v.append_stream(f"{i},")
            time.sleep(0.001)
        v.set("".join(f"{i}," for i in range(20)))

    async def main():
        threading.Thread(target=produce).start()
        return "".join([d async for d in v.stream()])
    assert run(main()) == "".join(f"{i}," for i in range(20))


def test_manager_scopes():
    m = SemanticVariableManager()
    a = m.create("s1", "a")
    b = m.create("s2", "b", "given")
    assert a.session_id == "s1" and a.is_pending and b.is_ready and not a.is_constant
    assert a.id != b.id
    assert m.get(a.id, "s1") is a
    with pytest.raises(NotFoundError):
        m.get(a.id, "s2")  # another session's variable looks absent
    with pytest.raises(NotFoundError):
        m.get(a.id, None)
    with pytest.raises(NotFoundError):
        m.get("nope", "s1")
    c = m.constant("You are helpful.", session_id="s1")
    assert m.get(c.id, "s1") is c and m.get(c.id, None) is c
    with pytest.raises(NotFoundError):  # a session that does not use the text cannot learn that another does
        m.get(c.id, "s2")
    m.constant("You are helpful.", session_id="s2")
    assert m.get(c.id, "s2") is c
    assert m.session_variables("s1") == [a]
    with pytest.raises(InvalidRequestError):
        m.create("", "x")


def test_constants_are_content_addressed_and_refcounted():
    m = SemanticVariableManager()
    c1 = m.constant("system prompt")
    c2 = m.constant("system prompt", session_id="s2")
    assert c1 is c2 and c1.id == constant_id("system prompt") and c1.is_constant and c1.is_ready
    assert c1.session_id is None and c1.content == "system prompt"
    assert m.constant("other") is not c1
    assert m.constant_refcount(c1) == 2
    m.release_constant(c1)
    assert m.get(c1.id, "s2") is c1 and m.get(c1.id, None) is c1
    m.release_constant(c1, session_id="s2")
    with pytest.raises(NotFoundError):
        m.get(c1.id, None)
    with pytest.raises(NotFoundError):
        m.release_constant(c1)
    c3 = m.constant("system prompt")
    assert c3 is not c1 and c3.id == c1.id  # recreated with the same id
    with pytest.raises(InvalidRequestError):
        m.constant("")


def test_free_session():
    m = SemanticVariableManager()
    pending = m.create("s1", "p")
    done = m.create("s1", "d", "x")
    other = m.create("s2", "o")
    shared = m.constant("shared", session_id="s1")
    m.constant("shared", session_id="s2")
    only_s1 = m.constant("only s1", session_id="s1")
    assert m.free_session("s1") == 2
    assert pending.is_failed and pending.error == "session ended" and done.is_ready
    for v in (pending, done):
        with pytest.raises(NotFoundError):
            m.get(v.id, "s1")
    assert m.get(other.id, "s2") is other and other.is_pending
    assert m.get(shared.id, "s2") is shared and m.constant_refcount(shared) == 1
    with pytest.raises(NotFoundError):
        m.get(only_s1.id, "s2")
    assert m.free_session("s1") == 0
    assert len(m) == 2
    with pytest.raises(NotFoundError):
        m.release_constant(shared, session_id="s1")


def test_free_session_wakes_waiters():
    async def main():
        m = SemanticVariableManager()
        v = m.create("s1", "p")
        waiter = asyncio.create_task(v.wait(5))
        await asyncio.sleep(0)
        m.free_session("s1")
        with pytest.raises(VariableFailedError, match="session ended"):
            await waiter
    run(main())


def test_to_json():
    v = SemanticVariable("v1", "x", "s1", producer="r1")
    assert v.to_json() == {"id": "v1", "name": "x", "session_id": "s1", "state": "pending",
                           "is_constant": False, "producer": "r1"}
    v.fail("bad")
    assert v.to_json(with_content=True)["error"] == "bad"


def test_text_is_metered_and_freed():
    m = SemanticVariableManager()
    a = m.create("s1", "a", "héllo")  # 6 UTF-8 bytes
    out = m.create("s1", "out")
    assert m.held == 6 and m.session_held("s1") == 6
    out.set("generated")  # an output counts once set
    assert m.held == 15 and m.session_held("s1") == 15
    c = m.constant("shared text", session_id="s1")
    m.constant("shared text", session_id="s1")  # the same session again: counted once
    m.constant("shared text", session_id="s2")  # held by the server once, by each session that uses it
    assert m.held == 26 and m.session_held("s1") == 26 and m.session_held("s2") == 11
    m.release_constant(c, session_id="s2")
    assert m.held == 26 and m.session_held("s2") == 0
    m.discard(a)
    assert m.held == 20 and m.session_held("s1") == 20
    m.free_session("s1")
    assert m.held == 0 and m.session_held("s1") == 0
    out2 = m.create("s3", "late")
    m.free_session("s3")
    with pytest.raises(ConflictError):
        out2.set("set after its session ended")  # failed meanwhile: nothing counted
    assert m.held == 0


def test_a_clients_text_past_a_budget_is_refused_with_a_429():
    m = SemanticVariableManager(budget_bytes=100, session_budget_bytes=40, retry_after_s=3)
    m.create("s1", "a", "x" * 30)
    with pytest.raises(RateLimitError, match="session s1's variables hold 30 bytes") as refused:
        m.create("s1", "b", "x" * 11)  # 41 > the session's 40
    assert refused.value.retry_after == 3 and m.held == 30
    pending = m.create("s1", "c")
    with pytest.raises(RateLimitError):
        m.set_by_client(pending, "y" * 11)
    assert pending.is_pending
    pending.set("z" * 20)  # a generated output is never refused: it counts, past the session's budget
    assert m.session_held("s1") == 50
    with pytest.raises(RateLimitError):
        m.constant("q", session_id="s1")  # a full session takes no more client text
    m.create("s2", "a", "x" * 40)
    with pytest.raises(RateLimitError, match="the server's variables hold"):
        m.create("s3", "a", "x" * 11)  # 101 > the server's 100
    m.free_session("s1")
    m.create("s3", "a", "x" * 11)  # room again
    c = m.constant("y" * 25, session_id="s3")
    assert m.held == 76
    m.constant("y" * 25, session_id="s4")  # held already: the server's text does not grow
    assert m.constant_refcount(c) == 2 and m.held == 76
    with pytest.raises(RateLimitError, match="76 bytes of text: 25 bytes more would pass its limit of 100 bytes"):
        m.create("s5", "a", "w" * 25)
