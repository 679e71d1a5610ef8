"""Semantic variables: set-once text containers that requests fill from and generate into.

A `SemanticVariable` is PENDING until it is set (READY, with its content) or failed (FAILED, with a
reason); it changes state once. Readers wait with `await var.wait(timeout)` from any asyncio loop in
any thread; `async for delta in var.stream()` yields the text as it is produced. All state sits behind
one lock, and waiters are woken with `loop.call_soon_threadsafe`, so producers may run in any thread.

The `SemanticVariableManager` holds two scopes: sessions (each reads its own variables only) and the
global scope of constants, content-addressed (same text -> same variable, in every session) and
reference counted. It meters the text its variables hold (UTF-8 bytes, `held`): text a client gives (a
variable's content, a template's constant text) is refused with a 429 (`RateLimitError`) where it would take
the whole server past `budget_bytes` or its session past `session_budget_bytes`; generated text (a call's
output, already accepted) always counts and is never refused, so a session full of outputs takes no more
text from its client.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from parrot.errors import ConflictError, InvalidRequestError, NotFoundError, ParrotError, RateLimitError


class VariableState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


class VariableFailedError(ParrotError):
    """A variable that was waited for (or streamed) failed; the message names it and says why."""

    code = "variable_failed"

    def __init__(self, var_id: str, name: str, reason: str) -> None:
        super().__init__(f"semantic variable {name!r} ({var_id}) failed: {reason}")
        self.var_id = var_id
        self.name = name
        self.reason = reason


def text_bytes(text: str) -> int:
    """What a text takes in a variable's budget: its UTF-8 bytes."""
    return len(text.encode("utf-8"))


def _amount(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def constant_id(text: str, salt: str | None = None) -> str:
    """The id of the global constant holding `text` for sessions of cache salt `salt` (a digest; None: the
    unsalted sessions): a hash of both."""
    key = text.encode("utf-8") if salt is None else f"{salt}\0{text}".encode()
    return "const-" + hashlib.sha256(key).hexdigest()[:32]


class SemanticVariable:
    """One semantic variable. Thread-safe; see the module docstring."""

    def __init__(self, var_id: str, name: str, session_id: str | None, content: str | None = None,
                 is_constant: bool = False, producer: str | None = None) -> None:
        self.id = var_id
        self.name = name
        self.session_id = session_id
        self.is_constant = is_constant
        self.producer = producer
        # the app depth of the call computing it (perf.depth: 0 for a call reading only what clients set); -1: set
        # by a client. Kept on the variable, as the call leaves the graph when it ends, before later steps arrive
        self.depth = -1
        # a typed output: {"json_schema": {...}} / {"regex": ...} / {"choice": [...]} / {"grammar": ...}
        self.type: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._state = VariableState.PENDING
        self._content: str | None = None
        self._error: str | None = None
        self._streamed: list[str] = []
        # one (loop, future) per waiting coroutine; resolved (with None) on every change
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.size = 0  # the content's UTF-8 bytes once set
        # told the content's size as it is set (the manager's budget: `SemanticVariableManager.create`)
        self.on_set: Callable[[SemanticVariable, int], None] | None = None
        if content is not None:
            self.set(content)

    def __repr__(self) -> str:
        return f"SemanticVariable(id={self.id!r}, name={self.name!r}, state={self._state.value})"

    # -- state ----------------------------------------------------------------------------------------
    @property
    def state(self) -> VariableState:
        return self._state

    @property
    def content(self) -> str | None:
        return self._content

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def is_ready(self) -> bool:
        return self._state is VariableState.READY

    @property
    def is_pending(self) -> bool:
        return self._state is VariableState.PENDING

    @property
    def is_failed(self) -> bool:
        return self._state is VariableState.FAILED

    def _check_pending(self, action: str) -> None:
        if self._state is VariableState.READY:
            raise ConflictError(f"cannot {action} semantic variable {self.name!r} ({self.id}): it is already set")
        if self._state is VariableState.FAILED:
            raise ConflictError(f"cannot {action} semantic variable {self.name!r} ({self.id}): it failed "
                                f"({self._error})")

    def set(self, content: str) -> None:
        """Give the variable its content (once). Raises `ConflictError` if it is already set or failed."""
        if not isinstance(content, str):
            raise InvalidRequestError(f"content of semantic variable {self.name!r} must be a string")
        with self._lock:
            self._check_pending("set")
            streamed = "".join(self._streamed)
            if content.startswith(streamed) and len(content) > len(streamed):
                self._streamed.append(content[len(streamed):])
            self._content = content
            self._state = VariableState.READY
            self.size = text_bytes(content)
            self._wake_locked()
        if self.on_set is not None:
            self.on_set(self, self.size)

    def fail(self, reason: str) -> None:
        """Mark the variable failed (once): waiters get `VariableFailedError`. `ConflictError` if not pending."""
        with self._lock:
            self._check_pending("fail")
            self._error = reason
            self._state = VariableState.FAILED
            self._wake_locked()

    def fail_if_pending(self, reason: str) -> bool:
        """Fail the variable if it is still pending; True if it was. For cleanup paths that may race."""
        with self._lock:
            if self._state is not VariableState.PENDING:
                return False
            self._error = reason
            self._state = VariableState.FAILED
            self._wake_locked()
            return True

    def append_stream(self, text: str) -> None:
        """Publish generated text before the variable is set. `ConflictError` once it is set or failed."""
        with self._lock:
            self._check_pending("stream into")
            if text:
                self._streamed.append(text)
                self._wake_locked()

    def _wake_locked(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that loop is closed: nobody is waiting there any more
                pass

    def _failed_error(self) -> VariableFailedError:
        return VariableFailedError(self.id, self.name, self._error or "unknown error")

    async def _changed(self, known_len: int, timeout: float | None) -> None:
        """Wait until the state leaves PENDING or more than `known_len` pieces were streamed."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._state is not VariableState.PENDING or len(self._streamed) > known_len:
                return
            fut: asyncio.Future[None] = loop.create_future()
            entry = (loop, fut)
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)

    # -- reading --------------------------------------------------------------------------------------
    async def wait(self, timeout: float | None = None) -> str:
        """The content once READY. Raises `VariableFailedError` if it fails, `TimeoutError` on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._lock:
                if self._state is VariableState.READY:
                    assert self._content is not None
                    return self._content
                if self._state is VariableState.FAILED:
                    raise self._failed_error()
                known = len(self._streamed)
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            await self._changed(known, remaining)

    async def stream(self) -> AsyncIterator[str]:
        """Yield the text as it is produced, from the start (late subscribers get what came before).

        Ends when the variable is READY; raises `VariableFailedError` (after the text streamed so far) if it
        fails. A variable set without streaming yields its whole content once. If the final content does
        not extend the streamed text, the stream ends without a correction: read `content` for the truth.
        """
        index = 0
        while True:
            with self._lock:
                pieces = self._streamed[index:]
                state = self._state
            for piece in pieces:
                yield piece
            index += len(pieces)
            if state is VariableState.READY:
                with self._lock:
                    if len(self._streamed) == index:
                        return
                continue
            if state is VariableState.FAILED:
                with self._lock:
                    if len(self._streamed) == index:
                        raise self._failed_error()
                continue
            await self._changed(index, None)

    def to_json(self, with_content: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "name": self.name, "session_id": self.session_id,
                               "state": self._state.value, "is_constant": self.is_constant,
                               "producer": self.producer}
        if self.type is not None:
            out["type"] = self.type
        if self._error is not None:
            out["error"] = self._error
        if with_content:
            out["content"] = self._content
        return out


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class SemanticVariableManager:
    """Every semantic variable of the serve core: the global constants and each session's variables."""

    def __init__(self, budget_bytes: int | None = None, session_budget_bytes: int | None = None,
                 retry_after_s: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._vars: dict[str, SemanticVariable] = {}
        self._by_session: dict[str, dict[str, SemanticVariable]] = {}
        self._const_refs: Counter[str] = Counter()
        self._session_const_refs: dict[str, Counter[str]] = {}
        self.budget_bytes, self.session_budget_bytes = budget_bytes, session_budget_bytes
        self.retry_after_s = retry_after_s
        self._held = 0  # bytes of every variable's content (a constant once)
        self._session_held: Counter[str] = Counter()  # a session's own contents and those of the constants it holds

    def __len__(self) -> int:
        with self._lock:
            return len(self._vars)

    # -- the text budget ------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Bytes of text all variables hold."""
        with self._lock:
            return self._held

    def session_held(self, session_id: str) -> int:
        """Bytes of text the session's variables hold, with the constants it references."""
        with self._lock:
            return self._session_held.get(session_id, 0)

    def admit(self, session_id: str | None, nbytes: int) -> None:
        """Room for `nbytes` more of a client's text in the session (None: a global constant), else a 429."""
        with self._lock:
            self._admit_locked(session_id, nbytes)

    def _admit_locked(self, session_id: str | None, nbytes: int, new_bytes: int | None = None) -> None:
        """`new_bytes`: what the server's text grows by where not `nbytes` (a constant it holds already: 0)."""
        new_bytes = nbytes if new_bytes is None else new_bytes
        if self.budget_bytes is not None and self._held + new_bytes > self.budget_bytes:
            raise RateLimitError(f"the server's variables hold {_amount(self._held)} of text: {_amount(new_bytes)} "
                                 f"more would pass its limit of {_amount(self.budget_bytes)}; retry once sessions "
                                 "are deleted", self.retry_after_s)
        held = self._session_held.get(session_id, 0) if session_id is not None else 0
        if session_id is not None and self.session_budget_bytes is not None and \
                held + nbytes > self.session_budget_bytes:
            raise RateLimitError(f"session {session_id}'s variables hold {_amount(held)} of text: {_amount(nbytes)} "
                                 f"more would pass its limit of {_amount(self.session_budget_bytes)}; delete the "
                                 "session and start a new one", self.retry_after_s)

    def _count(self, var: SemanticVariable, nbytes: int) -> None:
        """A variable's content was set (`SemanticVariable.set`): it counts while the variable is held (not
        one removed meanwhile, e.g. an output set as its session ended)."""
        with self._lock:
            if self._vars.get(var.id) is var:
                self._count_locked(var, nbytes)

    def _count_locked(self, var: SemanticVariable, nbytes: int) -> None:
        self._held += nbytes
        if var.session_id is not None:
            self._session_held[var.session_id] += nbytes

    def _uncount_locked(self, var: SemanticVariable) -> None:
        self._held -= var.size
        if var.session_id is not None:
            self._session_held[var.session_id] -= var.size

    # -- variables ------------------------------------------------------------------------------------
    def create(self, session_id: str, name: str, content: str | None = None, *, is_constant: bool = False,
               producer: str | None = None) -> SemanticVariable:
        """A new variable of the session (READY if `content` is given, else PENDING). A client's `content` is
        admitted first (`admit`)."""
        if not session_id:
            raise InvalidRequestError("a session variable needs a session id")
        if isinstance(content, str):
            self.admit(session_id, text_bytes(content))
        var = SemanticVariable(f"var-{uuid.uuid4().hex}", name, session_id, content, is_constant, producer)
        with self._lock:
            self._vars[var.id] = var
            self._by_session.setdefault(session_id, {})[var.id] = var
            self._count_locked(var, var.size)
        var.on_set = self._count  # a pending variable's content, once set (by its call or its client)
        return var

    def set_by_client(self, var: SemanticVariable, content: str) -> None:
        """`var.set(content)` where a client gives the content: admitted first (`admit`)."""
        if isinstance(content, str):
            self.admit(var.session_id, text_bytes(content))
        var.set(content)

    def discard(self, var: SemanticVariable) -> None:
        """Remove a session variable nothing refers to (one made for a request that was then refused)."""
        with self._lock:
            if self._vars.get(var.id) is var and var.session_id is not None:
                del self._vars[var.id]
                self._by_session.get(var.session_id, {}).pop(var.id, None)
                self._uncount_locked(var)

    def get(self, var_id: str, session_id: str | None) -> SemanticVariable:
        """The variable if `session_id` may read it: the session's own variables, and the global constants it
        holds a reference to (its calls' texts); otherwise `NotFoundError`, also for another session's
        variables and constants only other sessions use: a constant's id is a hash of its text, so a session
        could otherwise learn whether another uses a text it guessed. `session_id=None`: any constant."""
        with self._lock:
            var = self._vars.get(var_id)
            if var is not None and var.session_id is None and session_id is not None:
                refs = self._session_const_refs.get(session_id)
                visible = bool(refs and refs[var_id])
            else:
                visible = var is not None and var.session_id == session_id
        if not visible:
            raise NotFoundError(f"semantic variable {var_id!r} not found")
        return var

    def count(self, session_id: str) -> int:
        """Variables the session holds: its own and the distinct global constants it references."""
        with self._lock:
            return len(self._by_session.get(session_id, ())) + len(self._session_const_refs.get(session_id, ()))

    def session_variables(self, session_id: str) -> list[SemanticVariable]:
        with self._lock:
            return list(self._by_session.get(session_id, {}).values())

    def constant(self, text: str, session_id: str | None = None, salt: str | None = None) -> SemanticVariable:
        """The global constant holding `text`, one per distinct text (and cache salt: sessions of another salt
        have their own), with one more reference.

        With `session_id`, the reference belongs to that session and `free_session` releases it."""
        if not isinstance(text, str) or text == "":
            raise InvalidRequestError("a constant needs non-empty text")
        var_id, size = constant_id(text, salt), text_bytes(text)
        with self._lock:
            var = self._vars.get(var_id)
            refs = self._session_const_refs.get(session_id) if session_id is not None else None
            new_to_session = session_id is not None and not (refs and refs[var_id])
            if var is None or new_to_session:  # text the server, or the session, does not hold yet
                self._admit_locked(session_id if new_to_session else None, size, 0 if var is not None else size)
            if var is None:
                var = SemanticVariable(var_id, "constant", None, text, is_constant=True)  # counted just below
                self._vars[var_id] = var
                self._held += size
            elif var.content != text:  # a 128-bit hash collision: refuse rather than mix texts
                raise ConflictError(f"constant id collision for {var_id}")
            self._const_refs[var_id] += 1
            if session_id is not None:
                self._session_const_refs.setdefault(session_id, Counter())[var_id] += 1
                if new_to_session:
                    self._session_held[session_id] += size
        return var

    def constant_refcount(self, var: SemanticVariable) -> int:
        with self._lock:
            return self._const_refs.get(var.id, 0)

    def release_constant(self, var: SemanticVariable, session_id: str | None = None) -> None:
        """Drop one reference to a global constant; the last one removes it. `NotFoundError` if none is held."""
        with self._lock:
            self._release_locked(var.id, session_id)

    def _release_locked(self, var_id: str, session_id: str | None) -> None:
        if self._const_refs.get(var_id, 0) <= 0:
            raise NotFoundError(f"no reference held to constant {var_id!r}")
        if session_id is not None:
            refs = self._session_const_refs.get(session_id)
            if refs is None or refs[var_id] <= 0:
                raise NotFoundError(f"session {session_id!r} holds no reference to constant {var_id!r}")
            refs[var_id] -= 1
            if refs[var_id] == 0:
                del refs[var_id]
                self._session_held[session_id] -= self._vars[var_id].size
        self._const_refs[var_id] -= 1
        if self._const_refs[var_id] == 0:
            del self._const_refs[var_id]
            self._held -= self._vars.pop(var_id).size

    def free_session(self, session_id: str) -> int:
        """Remove the session's variables (failing pending ones: "session ended") and release its
        constant references. Returns how many session variables were removed."""
        with self._lock:
            own = self._by_session.pop(session_id, {})
            for var_id in own:
                self._uncount_locked(self._vars.pop(var_id))
            refs = self._session_const_refs.pop(session_id, Counter())
            for var_id, n in refs.items():
                for _ in range(n):
                    self._release_locked(var_id, None)
            self._session_held.pop(session_id, None)
        for var in own.values():
            var.fail_if_pending("session ended")
        return len(own)
