"""The real texts the application workloads read (parrot/bench/data, package data; see its README), cut into
pieces."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
CHARS_PER_TOKEN = 4.8  # SmolLM2 tokens on these license texts: 4.6-5.1 characters each (measured)


@cache
def text(name: str) -> str:
    """A document of parrot/bench/data, with runs of blank lines and trailing spaces squeezed."""
    raw = (DATA / name).read_text(encoding="utf-8")
    lines = [line.rstrip() for line in raw.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def paragraphs(doc: str) -> list[str]:
    return [p.strip() for p in doc.split("\n\n") if p.strip()]


def chunks(doc: str, tokens: int = 512) -> list[str]:
    """Consecutive pieces of about `tokens` tokens, cut between paragraphs (a paragraph longer than a
    piece is cut between lines)."""
    limit = int(tokens * CHARS_PER_TOKEN)
    units: list[str] = []
    for para in paragraphs(doc):
        if len(para) <= limit:
            units.append(para)
            continue
        piece = ""
        for line in para.splitlines():
            if piece and len(piece) + len(line) + 1 > limit:
                units.append(piece)
                piece = ""
            piece = f"{piece}\n{line}" if piece else line
        units.append(piece)
    out: list[str] = []
    current = ""
    for unit in units:
        if current and len(current) + len(unit) + 2 > limit:
            out.append(current)
            current = ""
        current = f"{current}\n\n{unit}" if current else unit
    if current:
        out.append(current)
    return out


def head(doc: str, tokens: int) -> str:
    """The document's first whole paragraphs, about `tokens` tokens in all."""
    return chunks(doc, tokens)[0]


def sentences(doc: str, min_chars: int = 60, max_chars: int = 300) -> list[str]:
    """The document's sentences of a readable length, in order, whitespace collapsed."""
    flat = re.sub(r"\s+", " ", doc)
    found = re.split(r"(?<=[.;:])\s+(?=[A-Z(\"])", flat)
    return [s.strip() for s in found if min_chars <= len(s.strip()) <= max_chars]
