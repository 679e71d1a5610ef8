"""Chain summarization: a long text in ~512-token chunks; each step summarizes the next chunk together
with the running summary. The whole chain is submitted at once (each step's input is the previous
step's output variable) and runs on the server; the client waits only for the final summary.

    parrot serve                      # in another terminal (default http://127.0.0.1:9000)
    python examples/chain_summarization.py [--url URL] [--file PATH] [--chunk-chars 2300]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import parrot as P

DATA = Path(__file__).parent / "data" / "gpl-3.0-excerpt.txt"


@P.semantic_function
def first_summary(chunk: P.Input, summary: P.Output(max_tokens=96, stop=["\n\n"])):
    """<|im_start|>system
    You are a precise assistant. You write short, factual summaries of documents.<|im_end|>
    <|im_start|>user
    Summarize the beginning of this document in two or three sentences.

    {{chunk}}<|im_end|>
    <|im_start|>assistant
    {{summary}}"""


@P.semantic_function
def refine(previous: P.Input, chunk: P.Input, summary: P.Output(max_tokens=96, stop=["\n\n"])):
    """<|im_start|>system
    You are a precise assistant. You write short, factual summaries of documents.<|im_end|>
    <|im_start|>user
    Summary of the document so far:
    {{previous}}

    Next part of the document:
    {{chunk}}

    Write an updated summary of the whole document so far, in at most three sentences.<|im_end|>
    <|im_start|>assistant
    {{summary}}"""


def chunks(text: str, max_chars: int) -> list[str]:
    """Paragraphs packed into chunks of at most `max_chars` characters (about 4.5 characters per
    SmolLM2 token in English prose, so 2300 characters is about 512 tokens)."""
    out: list[str] = []
    current = ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        while len(para) > max_chars:  # a paragraph longer than a chunk: cut it
            if current:
                out.append(current)
                current = ""
            out.append(para[:max_chars])
            para = para[max_chars:]
        if current and len(current) + 2 + len(para) > max_chars:
            out.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        out.append(current)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="the Parrot server")
    parser.add_argument("--file", type=Path, default=DATA, help="the text to summarize")
    parser.add_argument("--chunk-chars", type=int, default=2300, help="characters per chunk (~512 tokens)")
    args = parser.parse_args()

    parts = chunks(args.file.read_text(encoding="utf-8"), args.chunk_chars)
    print(f"{args.file.name}: {sum(map(len, parts))} characters in {len(parts)} chunks")
    with P.VirtualMachine(args.url) as vm:
        print(f"live view of this session: {vm.ui_url}", flush=True)
        t0 = time.perf_counter()
        steps = [first_summary(parts[0])]
        for part in parts[1:]:
            steps.append(refine(steps[-1], part))  # no waiting: the output variable is the next input
        t_submit = time.perf_counter() - t0
        final = steps[-1].get()
        t_total = time.perf_counter() - t0
        for i, step in enumerate(steps[:-1]):
            print(f"\n--- summary after chunk {i + 1} ---\n{step.get().strip()}")
        print(f"\n=== final summary ({len(parts)} chunks) ===\n{final.strip()}")
    print(f"\nsubmitted {len(steps)} calls in {t_submit * 1000:.0f} ms; final summary after {t_total:.2f} s")


if __name__ == "__main__":
    main()
