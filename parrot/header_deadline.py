"""A deadline for each request's head: uvicorn's h11 protocol, with a connection closed where a request's line
and headers take longer than `HEADER_TIMEOUT_S` to arrive.

uvicorn closes a connection idle after a response (its keep-alive timeout), but not one that never sends a
whole request head: a connection opened and left silent, or one whose headers trickle in a byte at a time
(slowloris), is held for as long as the client likes, and needs no API key, since the key is in the headers.
Enough of them take every file descriptor the process has. Here each connection's head must arrive within
the deadline from the connection's opening, and each next request's within it from the end of the response
before; once a request's head is in, its body and its answer take as long as they take (a stream may run for
minutes). As nginx's `client_header_timeout` (60 s) and Apache's `RequestReadTimeout header=20-40`.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEADER_TIMEOUT_S", "HeaderDeadlineH11"]

HEADER_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol (`uvicorn.Config(http=HeaderDeadlineH11)`) with the head's deadline."""

    header_timeout_s = HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's head is in: its body and answer have no deadline here
            self._disarm()

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if self.cycle is before and not self.transport.is_closing():  # waiting for the next request's head
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.debug("closing a connection from %s: no whole request head within %.0f s", self.client,
                      self.header_timeout_s)
            self.transport.close()
