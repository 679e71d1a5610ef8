"""Session: an app's scope on the serve core: a secret token, its variables, graph and executor."""

from __future__ import annotations

import hmac
import secrets
import time
import uuid
from dataclasses import dataclass, field

from parrot.errors import ParrotError
from parrot.serve.executor import GraphExecutor


class AuthError(ParrotError):
    """Missing or malformed credentials (HTTP 401)."""


class ForbiddenError(ParrotError):
    """Credentials of another session (HTTP 403)."""


@dataclass(eq=False)
class Session:
    session_id: str = field(default_factory=lambda: f"s-{uuid.uuid4().hex[:16]}")
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    executor: GraphExecutor = field(default_factory=GraphExecutor)
    created: float = field(default_factory=time.monotonic)
    last_access: float = field(default_factory=time.monotonic)
    requests: dict[str, dict] = field(default_factory=dict)  # request id -> summary for inspection
    generations: list[dict] = field(default_factory=list)  # timings of finished generations, for inspection

    def check_token(self, token: str | None) -> None:
        if not token:
            raise AuthError("missing session token: send 'Authorization: Bearer <session_token>'")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise ForbiddenError(f"the token does not belong to session {self.session_id}")
        self.last_access = time.monotonic()

    def idle_seconds(self) -> float:
        return time.monotonic() - self.last_access
