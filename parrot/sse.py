"""Server-Sent Events read as lines: split at "\n" alone (a "\r" before it dropped).

Not str.splitlines() (nor httpx's `aiter_lines`, which uses it): that also splits at U+2028, U+2029 and
U+0085, which JSON carries unescaped in a token's text, so an event holding one was cut in two (the serve core
took a healthy engine for dead; a relayed stream died mid-way)."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterable, AsyncIterator


async def sse_lines(chunks: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str]:
    """The lines of a stream of text or UTF-8 chunks (a character may be split between chunks)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending = ""
    async for chunk in chunks:
        pending += chunk if isinstance(chunk, str) else decoder.decode(bytes(chunk))
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    pending += decoder.decode(b"", final=True)
    if pending:
        yield pending.removesuffix("\r")
