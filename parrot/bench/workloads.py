"""The application workloads (the Parrot paper's, scaled to a 2-core CPU and SmolLM2-135M). Each app is
written once against `runtime.App` and runs unchanged on every system. Prompts are ChatML, as
SmolLM2-Instruct expects; documents are the real texts of parrot/bench/data."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import parrot as P
from parrot.bench import corpus
from parrot.bench.runtime import App, Recorder, Runtime


def chatml(system: str, user: str, output: str) -> str:
    """A one-turn ChatML prompt whose assistant reply is the output placeholder."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n{{{{{output}}}}}")


def out(max_tokens: int) -> P.Output:
    """Greedy, and always exactly `max_tokens` tokens: every system does the same work."""
    return P.Output(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- summarization (chain, map-reduce, mixed) -----------------------------------------------------------
SUMMARIZER = "You are a precise assistant. You write short, factual summaries of documents."


@P.semantic_function(template=chatml(
    SUMMARIZER, "Summary of the document so far:\n{{summary}}\n\nNext part of the document:\n{{chunk}}\n\n"
    "Rewrite the summary so that it also covers the next part, in a few sentences.", "new_summary"))
def refine_summary(summary: P.Input, chunk: P.Input, new_summary: out(48)): ...


@P.semantic_function(template=chatml(
    SUMMARIZER, "Summarize this part of a document in two sentences.\n\n{{chunk}}", "summary"))
def summarize_chunk(chunk: P.Input, summary: out(48)): ...


@P.semantic_function(template=chatml(
    SUMMARIZER, "These are summaries of the consecutive parts of one document:\n{{summaries}}\n\n"
    "Write a summary of the whole document in a few sentences.", "overall"))
def reduce_summaries(summaries: P.Input, overall: out(96)): ...


async def chain_summary(app: App, chunks: list[str]) -> str:
    summary: str | object = "(nothing yet)"
    for chunk in chunks:
        summary = await app.call(refine_summary, summary=summary, chunk=chunk)
    return await app.get(summary, "latency")


async def map_reduce(app: App, chunks: list[str]) -> str:
    maps = [await app.call(summarize_chunk, chunk=c) for c in chunks]
    joined = await app.join(maps, "\n")
    overall = await app.call(reduce_summaries, summaries=joined)
    return await app.get(overall, "throughput")


# ---- a chat app with a long shared system prompt --------------------------------------------------------
LICENSE_BOT = ("You answer questions about the license below. Answer in one or two sentences.\n\n"
               + corpus.head(corpus.text("apache-2.0.txt"), 1600))  # ~1,500 tokens


@P.semantic_function(template=chatml(LICENSE_BOT, "What does this part of the license mean?\n{{passage}}",
                                     "answer"))
def ask_license(passage: P.Input, answer: out(32)): ...


async def license_question(app: App, passage: str) -> str:
    return await app.get(await app.call(ask_license, passage=passage), "latency")


# ---- a multi-agent pipeline: architect -> engineers in parallel -> reviewer ----------------------------
TEAM = ("You are part of a software team. The team builds tools that help projects comply with this "
        "license:\n\n" + corpus.head(corpus.text("mpl-2.0.txt"), 1000))  # ~1,100 tokens


@P.semantic_function(template=chatml(
    TEAM, "You are the architect. Design a small Python tool that {{goal}}. List its modules, one line each.",
    "design"))
def architect(goal: P.Input, design: out(64)): ...


@P.semantic_function(template=chatml(
    TEAM, "The architect's design:\n{{design}}\n\nYou are an engineer. Write the Python code of {{module}}.",
    "code"))
def engineer(design: P.Input, module: P.Input, code: out(96)): ...


@P.semantic_function(template=chatml(
    TEAM, "The architect's design:\n{{design}}\n\nThe engineers' code:\n{{code}}\n\nYou are the reviewer. "
    "List the most important problems in the code.", "review"))
def reviewer(design: P.Input, code: P.Input, review: out(64)): ...


GOALS = ["checks that every source file carries the license notice",
         "lists the files of a project that are covered by the license",
         "reports which contributions in a repository lack a license grant"]


async def team(app: App, goal: str, engineers: int) -> str:
    design = await app.call(architect, goal=goal)
    codes = [await app.call(engineer, design=design, module=f"module {i + 1} of the design")
             for i in range(engineers)]
    code = await app.join(codes, "\n\n")
    return await app.get(await app.call(reviewer, design=design, code=code), "latency")


# ---- latency-critical chats (the mixed workload) -------------------------------------------------------
@P.semantic_function(template=chatml("You are a helpful assistant.",
                                     "Explain this sentence in simple words:\n{{sentence}}", "reply"))
def explain(sentence: P.Input, reply: out(32)): ...


async def chat(app: App, sentence: str) -> str:
    return await app.get(await app.call(explain, sentence=sentence), "latency")


# ---- the workloads ---------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    description: str
    primary: str  # the headline metric (a summary key); "..._s" lower is better, else higher is better
    params: dict[str, dict[str, object]] = field(default_factory=dict)  # per mode: "quick" / "full"
    body: Callable[[Runtime, Recorder, dict], Awaitable[None]] | None = None

    async def run(self, runtime: Runtime, recorder: Recorder, params: dict[str, object]) -> None:
        """One run with `params` (`self.params[mode]`, or those with some values overridden)."""
        assert self.body is not None
        await self.body(runtime, recorder, params)


def override_params(names: list[str], mode: str, overrides: list[str]) -> dict[str, dict[str, object]]:
    """Each named workload's `mode` parameters with `overrides` ("key=value", e.g. "chat_rate=2.0": the load
    of a sweep) applied wherever a workload has that key, the value as the default's type. Raises ValueError
    for a malformed override or a key none of the workloads has."""
    params = {n: dict(WORKLOADS[n].params[mode]) for n in names}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or not text:
            raise ValueError(f"--param {item!r}: expected KEY=VALUE")
        hits = [p for p in params.values() if key in p]
        if not hits:
            known = sorted({k for p in params.values() for k in p})
            raise ValueError(f"--param {key!r}: no selected workload has it (they have {', '.join(known)})")
        for p in hits:
            try:
                p[key] = type(p[key])(text)
            except ValueError:
                raise ValueError(f"--param {item!r}: {text!r} is not of type {type(p[key]).__name__}") from None
    return params


def poisson_starts(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of `n` requests arriving at `rate` per second."""
    rng, t, out_ = random.Random(seed), 0.0, []
    for _ in range(n):
        out_.append(t)
        t += rng.expovariate(rate)
    return out_


async def _at(delay: float, coro: Awaitable[None]) -> None:
    await asyncio.sleep(delay)
    await coro


def passages(n: int, seed: int) -> list[str]:
    """`n` distinct sentences of the Apache license (then the LGPL), shuffled reproducibly."""
    pool = corpus.sentences(corpus.text("apache-2.0.txt"), 40, 400)
    pool += [s for s in corpus.sentences(corpus.text("lgpl-2.1.txt")) if s not in pool]
    if n > len(pool):
        raise ValueError(f"only {len(pool)} distinct passages for {n} users")
    rng = random.Random(seed)
    return rng.sample(pool, n)


async def _chain(rt: Runtime, rec: Recorder, p: dict) -> None:
    chunks = corpus.chunks(corpus.text("gpl-2.0.txt"))[: p["chunks"]]
    await rt.run_app("chain", rec, lambda app: chain_summary(app, chunks))


async def _map_reduce(rt: Runtime, rec: Recorder, p: dict) -> None:
    chunks = corpus.chunks(corpus.text("gpl-3.0.txt"))[: p["chunks"]]
    await rt.run_app("map_reduce", rec, lambda app: map_reduce(app, chunks))


async def _shared_prompt(rt: Runtime, rec: Recorder, p: dict) -> None:
    users = p["users"]
    starts = poisson_starts(users, p["rate"], seed=1)
    questions = passages(users, seed=2)
    await asyncio.gather(*[
        _at(t, rt.run_app("chat", rec, lambda app, q=q: license_question(app, q)))
        for t, q in zip(starts, questions, strict=True)])


async def _multi_agent(rt: Runtime, rec: Recorder, p: dict) -> None:
    await asyncio.gather(*[
        rt.run_app("team", rec, lambda app, g=goal: team(app, g, p["engineers"]))
        for goal in GOALS[: p["teams"]]])


async def _mixed(rt: Runtime, rec: Recorder, p: dict) -> None:
    docs = [corpus.chunks(corpus.text(name))[: p["chunks"]] for name in ("lgpl-2.1.txt", "gpl-2.0.txt")]
    jobs = [rt.run_app("map_reduce", rec, lambda app, c=chunks: map_reduce(app, c))
            for chunks in docs[: p["map_reduce_apps"]]]
    sentences = random.Random(3).sample(corpus.sentences(corpus.text("gpl-3.0.txt")), p["chats"])
    starts = poisson_starts(p["chats"], p["chat_rate"], seed=4)
    jobs += [_at(p["chat_delay"] + t, rt.run_app("chat", rec, lambda app, s=s: chat(app, s)))
             for t, s in zip(starts, sentences, strict=True)]
    await asyncio.gather(*jobs)


async def _background_chats(rt: Runtime, rec: Recorder, n: int, rate: float, seed: int) -> None:
    """Other users' latency-critical chats (32 tokens each), arriving as a Poisson process from t = 0."""
    sentences = random.Random(seed).sample(corpus.sentences(corpus.text("gpl-3.0.txt")), n)
    starts = poisson_starts(n, rate, seed=seed + 1)
    await asyncio.gather(*[_at(t, rt.run_app("chat", rec, lambda app, s=s: chat(app, s)))
                           for t, s in zip(starts, sentences, strict=True)])


async def _chain_under_load(rt: Runtime, rec: Recorder, p: dict) -> None:
    chunks = corpus.chunks(corpus.text("gpl-2.0.txt"))[: p["chunks"]]
    await asyncio.gather(rt.run_app("chain", rec, lambda app: chain_summary(app, chunks)),
                         _background_chats(rt, rec, p["chats"], p["chat_rate"], seed=5))


async def _map_reduce_under_load(rt: Runtime, rec: Recorder, p: dict) -> None:
    chunks = corpus.chunks(corpus.text("gpl-3.0.txt"))[: p["chunks"]]
    await asyncio.gather(rt.run_app("map_reduce", rec, lambda app: map_reduce(app, chunks)),
                         _background_chats(rt, rec, p["chats"], p["chat_rate"], seed=7))


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("chain", "chain summarization: a document in ~512-token chunks (GPL-2); each step rewrites the "
             "running summary (48 tokens) to cover the next chunk", "jct_mean_s",
             {"quick": {"chunks": 4}, "full": {"chunks": 8}}, _chain),
    Workload("map_reduce", "map-reduce summarization: ~512-token chunks of the GPL-3 summarized in parallel "
             "(48 tokens each), joined server-side, then one reduce (96 tokens)", "jct_mean_s",
             {"quick": {"chunks": 8}, "full": {"chunks": 16}}, _map_reduce),
    Workload("shared_prompt", "shared system prompt: users of one license-QA app (~1,500-token system prompt "
             "from the Apache-2.0 text) ask about one passage each (32-token answers), Poisson arrivals",
             "request_throughput_rps",
             {"quick": {"users": 16, "rate": 8.0}, "full": {"users": 48, "rate": 8.0}}, _shared_prompt),
    Workload("multi_agent", "multi-agent pipeline: architect (64 tokens) -> engineers in parallel (96 each) -> "
             "reviewer (64); every role shares a ~1,100-token team prompt (MPL-2.0 text); teams run "
             "concurrently", "jct_mean_s",
             {"quick": {"teams": 1, "engineers": 3}, "full": {"teams": 2, "engineers": 6}}, _multi_agent),
    Workload("mixed", "mixed: latency-critical chats (32 tokens, Poisson arrivals) while throughput-oriented "
             "map-reduce apps (LGPL-2.1, GPL-2) run", "map_reduce_jct_mean_s",
             {"quick": {"map_reduce_apps": 1, "chunks": 8, "chats": 8, "chat_rate": 0.5, "chat_delay": 1.0},
              "full": {"map_reduce_apps": 2, "chunks": 10, "chats": 16, "chat_rate": 0.5, "chat_delay": 1.0}},
             _mixed),
    Workload("chain_under_load", "chain summarization (as `chain`) while other users' chats (32 tokens, "
             "Poisson arrivals from t=0) share the server, as in the Parrot paper", "chain_jct_mean_s",
             {"quick": {"chunks": 4, "chats": 10, "chat_rate": 0.3},
              "full": {"chunks": 8, "chats": 24, "chat_rate": 0.3}}, _chain_under_load),
    Workload("map_reduce_under_load", "map-reduce summarization (as `map_reduce`) while other users' chats "
             "(32 tokens, Poisson arrivals from t=0) share the server", "map_reduce_jct_mean_s",
             {"quick": {"chunks": 8, "chats": 10, "chat_rate": 0.3},
              "full": {"chunks": 16, "chats": 24, "chat_rate": 0.3}}, _map_reduce_under_load),
]}
