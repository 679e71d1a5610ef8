"""Map-reduce summarization: every ~512-token chunk is summarized independently (the map calls run as
one batch on the server, sharing the system prompt's KV cache), a native `join` transform gathers the
summaries server-side, and one reduce call writes the overall summary.

    parrot serve                      # in another terminal (default http://127.0.0.1:9000)
    python examples/map_reduce_summarization.py [--url URL] [--file PATH] [--chunk-chars 2300] [--keep]

It prints the address of the server's live view of its session (/ui): open it to watch the map calls
run side by side and the reduce wait for them. Run from a terminal, the session stays open (and the
view with it) until you press Enter.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from chain_summarization import DATA, chunks

import parrot as P

SYSTEM = ("<|im_start|>system\nYou are a precise assistant. You write short, factual summaries of "
          "documents.<|im_end|>\n")


@P.semantic_function(template=SYSTEM + "<|im_start|>user\nSummarize this part of a document in one or two "
                     "sentences.\n\n{{chunk}}<|im_end|>\n<|im_start|>assistant\n{{summary}}")
def summarize_chunk(chunk: P.Input, summary: P.Output(max_tokens=64, stop=["\n\n"])): ...


@P.semantic_function(template=SYSTEM + "<|im_start|>user\nThese are summaries of the consecutive parts of one "
                     "document:\n{{summaries}}\n\nWrite a summary of the whole document in three sentences."
                     "<|im_end|>\n<|im_start|>assistant\n{{overall}}")
def reduce_summaries(summaries: P.Input, overall: P.Output(max_tokens=128, stop=["\n\n"])): ...


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="the Parrot server")
    parser.add_argument("--file", type=Path, default=DATA, help="the text to summarize")
    parser.add_argument("--chunk-chars", type=int, default=2300, help="characters per chunk (~512 tokens)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the session (and its /ui view) open until a line is read from stdin; "
                             "the default when stdin is a terminal")
    args = parser.parse_args()

    parts = chunks(args.file.read_text(encoding="utf-8"), args.chunk_chars)
    print(f"{args.file.name}: {sum(map(len, parts))} characters in {len(parts)} chunks")
    with P.VirtualMachine(args.url) as vm:
        print(f"live view of this session: {vm.ui_url}", flush=True)
        t0 = time.perf_counter()
        maps = [summarize_chunk(part) for part in parts]
        # a native function: the join runs on the server as a graph node, no round trip to the client
        joined = P.transform("join", {"sep": "\n"}, **{f"part{i + 1}": m for i, m in enumerate(maps)})
        overall = reduce_summaries(joined)
        t_submit = time.perf_counter() - t0
        result = overall.get(criteria="throughput")  # the app wants the end result; batch the maps
        t_total = time.perf_counter() - t0
        for i, m in enumerate(maps):
            print(f"\n--- chunk {i + 1} ---\n{m.get().strip()}")
        print(f"\n=== overall summary ===\n{result.strip()}")
        if args.keep or sys.stdin.isatty():
            print(f"\nthe session stays open for its live view ({vm.ui_url}): press Enter to end it", flush=True)
            sys.stdin.readline()
    print(f"\nsubmitted {len(maps) + 2} calls in {t_submit * 1000:.0f} ms; overall summary after {t_total:.2f} s")


if __name__ == "__main__":
    main()
