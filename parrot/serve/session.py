"""Session: an app's scope on the serve core: a secret token, its variables, graph and executor.

What a session keeps for inspection is bounded: the latest `max_generations` generation timings and the
latest `max_requests` call summaries. Calls whose outputs are not all set yet are its pending calls (the
serve core limits how many a session may have)."""

from __future__ import annotations

import hmac
import secrets
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from parrot.errors import ParrotError
from parrot.serve.executor import GraphExecutor
from parrot.serve.variables import SemanticVariable


class AuthError(ParrotError):
    """Missing or malformed credentials (HTTP 401)."""

    code = "unauthorized"


class ForbiddenError(ParrotError):
    """Credentials of another session (HTTP 403)."""

    code = "forbidden"


@dataclass(eq=False)
class Session:
    session_id: str = field(default_factory=lambda: f"s-{uuid.uuid4().hex[:16]}")
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    executor: GraphExecutor = field(default_factory=GraphExecutor)
    created: float = field(default_factory=time.monotonic)
    last_access: float = field(default_factory=time.monotonic)
    max_generations: int = 256
    max_requests: int = 1024
    # a digest of its cache_salt (contexts.salt_digest): it shares global constants, cached prefixes and the
    # prefix matcher's cut points only with sessions of the same salt; None: with every unsalted session
    salt: str | None = None
    owner: int | None = None  # the API key that opened it (its index in ServeConfig.api_keys); None: no keys
    # request id -> summary for inspection, the latest `max_requests`
    requests: OrderedDict[str, dict] = field(default_factory=OrderedDict)
    # timings of the latest `max_generations` finished generations, for inspection
    generations: deque[dict] = field(default_factory=deque)
    pinned: set[str] = field(default_factory=set)  # output var ids of calls submitted with output_criteria
    readers: int = 0  # clients waiting on or streaming one of its variables now (it does not expire meanwhile)
    _pending: dict[str, list[SemanticVariable]] = field(default_factory=dict)  # request id -> its outputs

    def __post_init__(self) -> None:
        self.generations = deque(self.generations, maxlen=self.max_generations)
        # the calls kept for the live view: the latest `max_requests` chains (running ones are in the graph)
        self.executor.history = deque(self.executor.history, maxlen=self.max_requests)  # type: ignore[assignment]
        self.executor.native_history = deque(self.executor.native_history, maxlen=self.max_requests)  # type: ignore[assignment]

    def check_token(self, token: str | None) -> None:
        if not token:
            raise AuthError("missing session token: send 'Authorization: Bearer <session_token>' (or "
                            "'X-Session-Token: <session_token>' when the server has an API key)")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise ForbiddenError(f"the token does not belong to session {self.session_id}")
        self.last_access = time.monotonic()

    def idle_seconds(self) -> float:
        return 0.0 if self.readers > 0 else time.monotonic() - self.last_access

    def add_request(self, request_id: str, summary: dict, outputs: Iterable[SemanticVariable]) -> None:
        self.requests[request_id] = summary
        while len(self.requests) > self.max_requests:
            self.requests.popitem(last=False)
        self._pending[request_id] = list(outputs)

    def add_generation(self, stats: dict) -> None:
        self.generations.append(stats)

    def pending_calls(self) -> int:
        """Calls with an output not set (nor failed) yet; finished ones are forgotten here."""
        done = [rid for rid, outs in self._pending.items() if not any(v.is_pending for v in outs)]
        for rid in done:
            self.pinned.difference_update(v.id for v in self._pending.pop(rid))
        return len(self._pending)
