"""Multi-agent programming: for each task a coder writes the code, a tester writes tests for that code,
and a reviewer reviews both. All agents share one team prompt (its KV cache is computed once and
forked), each role adds its own prompt, and every task's three-step pipeline is submitted at once:
the tasks run concurrently on the server and the client only collects the reviews.

    parrot serve                      # in another terminal (default http://127.0.0.1:9000)
    python examples/multi_agent.py [--url URL] [--tasks N]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import parrot as P

TEAM = ("<|im_start|>system\nYou are a member of a small, careful software team. The team writes Python 3 "
        "code that is simple, readable and correct, with type hints and docstrings. Every answer is short "
        "and to the point. ")
CODER = TEAM + "Your role: programmer. You answer with one Python code block and nothing else.<|im_end|>\n"
TESTER = TEAM + "Your role: tester. You write pytest tests that check the code's behavior.<|im_end|>\n"
REVIEWER = TEAM + "Your role: reviewer. You point out bugs and missing cases, in a short list.<|im_end|>\n"

TASKS = [
    "a function is_palindrome(s) that ignores case and non-alphanumeric characters",
    "a function fizzbuzz(n) returning the FizzBuzz list for 1..n",
    "a function word_count(text) returning a dict of word frequencies",
    "a function flatten(nested) that flattens arbitrarily nested lists",
]


@P.semantic_function(template=CODER + "<|im_start|>user\nWrite {{task}}.<|im_end|>\n<|im_start|>assistant\n{{code}}")
def write_code(task: P.Input, code: P.Output(max_tokens=160)): ...


@P.semantic_function(template=TESTER + "<|im_start|>user\nThe task was: {{task}}.\nThe code:\n{{code}}\n"
                     "Write pytest tests for it.<|im_end|>\n<|im_start|>assistant\n{{tests}}")
def write_tests(task: P.Input, code: P.Input, tests: P.Output(max_tokens=160)): ...


@P.semantic_function(template=REVIEWER + "<|im_start|>user\nThe task was: {{task}}.\nThe code:\n{{code}}\n"
                     "The tests:\n{{tests}}\nReview the code and the tests.<|im_end|>\n<|im_start|>assistant\n"
                     "{{review}}")
def review(task: P.Input, code: P.Input, tests: P.Input, review: P.Output(max_tokens=128)): ...


@P.native_function("strip")
def strip(text: P.Input): ...


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="the Parrot server")
    parser.add_argument("--tasks", type=int, default=len(TASKS), help=f"how many tasks (1..{len(TASKS)})")
    args = parser.parse_args()

    tasks = TASKS[: max(1, min(args.tasks, len(TASKS)))]
    async with P.VirtualMachine(args.url) as vm:
        print(f"live view of this session: {vm.ui_url}", flush=True)
        t0 = time.perf_counter()
        runs = []
        for task in tasks:
            code = strip(write_code(task))
            tests = strip(write_tests(task, code))
            runs.append((task, code, tests, review(task, code, tests)))
        t_submit = time.perf_counter() - t0
        reviews = await asyncio.gather(*(r[3].aget() for r in runs))
        t_total = time.perf_counter() - t0
        for (task, code, tests, _), text in zip(runs, reviews, strict=True):
            print(f"\n################ {task}")
            print(f"--- code ---\n{await code.aget()}")
            print(f"--- tests ---\n{await tests.aget()}")
            print(f"--- review ---\n{text.strip()}")
    print(f"\n{len(tasks)} tasks x 3 agents: submitted in {t_submit * 1000:.0f} ms, all reviews after {t_total:.2f} s")


if __name__ == "__main__":
    asyncio.run(main())
