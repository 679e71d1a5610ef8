"""Work a request waits for, given up when its client goes away: nobody reads the answer, and what the work
holds (a generation, a reader's place, a session kept alive) is let go."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def while_connected(request: Request | None, work: Awaitable[T], gone: Callable[[], BaseException],
                          poll: float = 0.5) -> T:
    """`work`'s result, unless the client disconnects first (checked every `poll` seconds): then `work` is
    cancelled and `gone()` raised (an error answer nobody reads)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll)
            if not task.done() and request is not None and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise gone()
    finally:
        if not task.done():
            task.cancel()
    return await task  # its error, if it failed
