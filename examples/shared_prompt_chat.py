"""Many users, one long system prompt: every user's question is a call whose template starts with the
same system prompt, so the server fills it once and forks its KV cache for every user. The first
user's answer is streamed; the others are awaited concurrently.

    parrot serve                      # in another terminal (default http://127.0.0.1:9000)
    python examples/shared_prompt_chat.py [--url URL] [--users N]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import parrot as P

SYSTEM = """<|im_start|>system
You are Pip, the support assistant of Northwind Bikes, a shop that sells and repairs bicycles.
Facts about the shop:
- Opening hours: Monday to Friday 9:00 to 18:00, Saturday 10:00 to 16:00, closed on Sunday.
- Address: 12 Harbour Street. There is bicycle parking in front of the shop.
- Repairs: a standard service costs 45 euros and takes two working days. Flat tyres are fixed while you
  wait for 12 euros. Brake adjustments cost 15 euros.
- Sales: city bikes from 420 euros, e-bikes from 1500 euros, children's bikes from 150 euros. Every new
  bike comes with a free first service within three months.
- Returns: unused items can be returned within 30 days with the receipt. Bikes that were ridden cannot
  be returned but are covered by a two-year warranty.
- Rentals: city bikes 15 euros per day, e-bikes 35 euros per day; a deposit of 100 euros is required.
Rules: answer in one to three friendly sentences, use only the facts above, and if a question is not
covered by the facts, say that a colleague will call back.<|im_end|>
"""

QUESTIONS = [
    "When are you open on Saturday?",
    "How much does it cost to fix a flat tyre?",
    "Can I return a bike I rode for a week?",
    "How much is it to rent an e-bike for two days?",
    "Do you sell children's bikes?",
    "Where is the shop?",
    "How long does a standard service take?",
    "Do you repair electric scooters?",
]


@P.semantic_function(template=SYSTEM + "<|im_start|>user\n{{question}}<|im_end|>\n<|im_start|>assistant\n{{answer}}")
def ask(question: P.Input, answer: P.Output(max_tokens=80, stop=["\n\n"])): ...


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="the Parrot server")
    parser.add_argument("--users", type=int, default=len(QUESTIONS), help="concurrent users")
    args = parser.parse_args()

    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(max(1, args.users))]
    # one session per user, as separate chat users would have
    vms = [P.VirtualMachine(args.url) for _ in questions]
    for vm in vms:
        vm.open()
    print(f"live view of the first user's session: {vms[0].ui_url}", flush=True)
    try:
        t0 = time.perf_counter()
        answers = [ask(q, vm=vm) for q, vm in zip(questions, vms, strict=True)]
        done_at: dict[int, float] = {}

        async def wait(i: int) -> str:
            text = await answers[i].aget()
            done_at[i] = time.perf_counter() - t0
            return text

        async def stream_first() -> str:
            print(f"[user 0] {questions[0]}\n[Pip, streamed] ", end="", flush=True)
            parts = []
            first_token = None
            async for delta in answers[0].astream():
                first_token = first_token or time.perf_counter() - t0
                parts.append(delta)
                print(delta, end="", flush=True)
            done_at[0] = time.perf_counter() - t0
            print(f"\n(first text after {first_token or 0:.2f} s)\n")
            return "".join(parts)

        texts = await asyncio.gather(stream_first(), *(wait(i) for i in range(1, len(questions))))
        total = time.perf_counter() - t0
        for i, (q, a) in enumerate(zip(questions, texts, strict=True)):
            print(f"[user {i}, {done_at[i]:.2f} s] {q}\n  -> {a.strip()}")
        print(f"\n{len(questions)} users sharing a {len(SYSTEM)}-character system prompt: all answers after "
              f"{total:.2f} s")
    finally:
        for vm in vms:
            vm.close()


if __name__ == "__main__":
    asyncio.run(main())
