"""parrot/sse.py: event-stream lines split at "\n" alone, whatever the chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from parrot.sse import sse_lines


async def _chunks(*parts: str | bytes) -> AsyncIterator[str | bytes]:
    for part in parts:
        yield part


def _lines(*parts: str | bytes) -> list[str]:
    async def run() -> list[str]:
        return [line async for line in sse_lines(_chunks(*parts))]

    return asyncio.run(run())


def test_lines_end_at_newline_alone() -> None:
    text = 'data: {"text": "a\u2028b\u2029c\x85d"}\r\n\r\ndata: [DONE]\n\n'
    assert _lines(text) == ['data: {"text": "a\u2028b\u2029c\x85d"}', "", "data: [DONE]", ""]
    assert _lines("data: x", "y\nda", "ta: z") == ["data: xy", "data: z"]  # a line across chunks; an unended last


def test_utf8_chunks_may_split_a_character() -> None:
    encoded = "data: é\u2028€\n".encode()
    assert _lines(*(encoded[i:i + 1] for i in range(len(encoded)))) == ["data: é\u2028€"]
