"""Differential run through `parrot serve`: every request of a random concurrent mix answers what it answers alone.

    python -m benchmarks.serve_differential [--rounds 8] [--seed 0] [--kv-memory-mb 16] [--out F]

The HTTP layer's twin of `benchmarks.differential`. It starts two `parrot serve` processes (the real CLI, the
default model, loopback ports, a small KV pool so the engine preempts running jobs and evicts idle contexts):
one takes the mixes, the other the replays alone (so no prefix the mix cached helps them; earlier replays' may).
Each round sends 4-12 requests at once (threads, staggered by 0-200 ms) through the `openai` client and the
REST session API (semantic calls bound to semantic variables, read through the SDK's `VirtualMachine`): greedy,
seeded (temperature, top-p, `seed`) and `n` > 1 chat completions and completions, stop strings, `logprobs` /
`top_logprobs`, `echo` with prompt logprobs, the sampler's options (penalties, `logit_bias`, `top_k`, `min_p`,
`min_tokens`, `stop_token_ids`), a `json_schema` or `json_object` response format, regex, choice and Lark grammar
constraints, tools, a long system prompt
several requests share, streamed and not; two chained calls (the second reads the first's output), a call with
two outputs, and a map-reduce whose map calls share a long constant prefix. Then it sends each request alone,
one at a time, to the other server, and compares text, finish reason, tool calls and logprobs (equal bit for bit
where the native CPU kernels run: a row's bits do not depend on its batch; the largest gap is reported anyway),
and for a streamed request also its stream alone with the same request unstreamed alone. An HTTP error or a
timeout is a failure too. Prints each round and every request that differed (where its text first did); writes
JSON; exits 1 if any did. A correctness check of the serve layer under load (prefix caching, forks, chains,
batching, preemption), not a speed test.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from benchmarks.report import write_json
from benchmarks.soak import free_port
from parrot.frontend.sdk import VirtualMachine  # a pure client (httpx, no JAX); imported once, not per thread

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
TIMEOUT = 300.0  # seconds one request (one case: a session's calls) may take
TOPICS = ["the sea", "a cat named Tom", "prime numbers", "Paris in winter", "how bread is made", "a robot",
          "the moon landing", "a short poem about rain"]
STOPS = [".", "\n", " the", ","]
# a long prefix several requests share (~200 tokens): automatic prefix caching forks it
SYSTEM = ("You are a careful assistant for a small public library. You answer questions from visitors about books, "
          "opening hours, events and the history of the town. Keep every answer short and friendly, use plain "
          "words, and never invent facts: when you do not know something, say so and suggest asking a librarian "
          "at the front desk. The library opens at nine in the morning and closes at six in the evening from "
          "Monday to Friday, and at one in the afternoon on Saturdays. It is closed on Sundays and public "
          "holidays. Children's reading hour is every Wednesday at four. Members may borrow up to eight books for "
          "three weeks, and renew them twice unless someone else has reserved them. The reading room on the first "
          "floor is a quiet space; the café on the ground floor serves tea, coffee and cake.")
CHATML_SYSTEM = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
QUESTIONS = ["When does the library open on Saturday?", "How many books can I borrow?", "Is there a café?",
             "When is the children's reading hour?", "Can I renew a book three times?", "Is it open on Sunday?"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
KINDS = ["chat", "chat_seeded", "chat_logprobs", "chat_n", "chat_json", "chat_tools", "chat_system", "completion",
         "completion_seeded", "completion_logprobs", "completion_echo", "completion_n", "rest_chain", "rest_map",
         "rest_two_outputs", "chat_sampling", "completion_sampling", "chat_guided", "completion_guided"]
# output constraints beside json_schema (vLLM's names, in `extra_body`; json_object in response_format)
GUIDED: list[dict[str, Any]] = [
    {"guided_regex": r"[A-Z][a-z]+( [a-z]+){2,6}\."},
    {"guided_regex": r"(yes|no), because [a-z ]{5,40}\."},
    {"guided_choice": ["the sea", "a cat", "prime numbers", "bread"]},
    {"guided_grammar": 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'},
    {"guided_grammar": 'start: item (", " item)*\nitem: /[a-z]{2,8}/'},
]
# SmolLM2's ids of ".", ",", " the", " and", "\n", " a", " is", " cat", " sea": logit_bias and stop_token_ids
COMMON_IDS = [30, 28, 260, 284, 198, 253, 314, 2644, 3426]

# refusals of a request as such: larger than the whole KV pool, or than the model's maximum length
TOO_BIG = re.compile(r"needs \d+ tokens of KV; the whole cache holds \d+|maximum context length is \d+ tokens"
                     r"|would exceed the model's maximum length \d+")
Outcome = dict[str, Any]  # {"choices": [Choice, ...], "seconds": s} or {"error": "...", "seconds": s}
Choice = dict[str, Any]  # {"index", "text", "finish", "tools": [[name, arguments]] | None, "logprobs": [...] | None}


@dataclass
class Case:
    """One request of a round (for the REST API: one session's calls) and what it answered where."""

    kind: str
    body: dict[str, Any]  # the openai client's keyword arguments, or a REST plan
    stream: bool
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # "mix", "alone", "alone_unstreamed"

    @property
    def api(self) -> str:
        return self.kind.split("_")[0]


# ---- the requests -------------------------------------------------------------------------------------------
def make_case(rng: random.Random, kinds: list[str] | None = None) -> Case:
    """A random request of one of `kinds`: what it asks (temperature 0 or a seed: never unseeded sampling) and
    whether it streams."""
    kind = rng.choice(kinds or KINDS)
    topic = rng.choice(TOPICS)
    stream = rng.random() < 0.5
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(8, 48)}
    seeded = {"temperature": rng.choice([0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]), "seed": rng.randint(0, 1000)}
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": f"Tell me about {topic}."}]
        body["temperature"] = 0.0
    elif kind.startswith("completion"):
        body["prompt"] = f"Here is a short story about {topic}:\n"
        body["temperature"] = 0.0
    if kind in ("chat", "completion") and rng.random() < 0.6:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if kind in ("chat_seeded", "completion_seeded"):
        body.update(seeded)
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(STOPS)]
    elif kind == "chat_logprobs":
        body.update(logprobs=True, top_logprobs=rng.randint(0, 3), **(seeded if rng.random() < 0.4 else {}))
    elif kind == "completion_logprobs":
        body.update(logprobs=rng.randint(0, 3), **(seeded if rng.random() < 0.4 else {}))
    elif kind in ("chat_n", "completion_n"):
        body.update(seeded, n=rng.randint(2, 3))
    elif kind == "chat_json":
        body["messages"] = [{"role": "user", "content": f"Describe {topic} as a JSON object with name, age and tags."}]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                                           "strict": True}}
        body["max_tokens"] = 48
    elif kind == "chat_tools":
        city = rng.choice(["Paris", "Oslo", "Lima", "Cairo"])
        body["messages"] = [{"role": "user", "content": f"What is the weather like in {city} right now?"}]
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(["auto", "required", {"type": "function", "function": {"name": "get_time"}}])
        body["max_tokens"] = 40
    elif kind == "chat_system":
        body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rng.choice(QUESTIONS)}]
        if rng.random() < 0.5:
            body.update(seeded)
    elif kind == "completion_echo":
        body["prompt"] = f"{SYSTEM}\nQuestion: {rng.choice(QUESTIONS)}\nAnswer:"
        body.update(echo=True, logprobs=rng.randint(0, 2), max_tokens=rng.randint(1, 12))
    elif kind in ("chat_sampling", "completion_sampling"):  # the sampler's processing, greedy or seeded
        body.update(sampling_options(rng))
        if rng.random() < 0.5:
            body.update(seeded)
    elif kind in ("chat_guided", "completion_guided"):  # structured decoding beside the JSON schemas
        if kind == "chat_guided" and rng.random() < 0.2:
            body["response_format"] = {"type": "json_object"}
            body["messages"] = [{"role": "user", "content": f"Describe {topic} as a JSON object."}]
        else:
            body["extra_body"] = dict(rng.choice(GUIDED))
        if rng.random() < 0.4:
            body.update(seeded)
    elif kind.startswith("rest"):
        greedy: dict[str, Any] = {"max_tokens": body["max_tokens"]}
        sampling = dict(greedy, temperature=seeded["temperature"], top_p=seeded["top_p"], seed=seeded["seed"])
        first = rng.choice([greedy, sampling, dict(greedy, stop=["\n"])])
        second = rng.choice([greedy, {"max_tokens": rng.randint(8, 24)}, {"max_tokens": 8, "choice": ["yes", "no"]}])
        body = {"topic": topic, "first": first, "second": second, "criteria": rng.choice(["latency", "throughput"])}
        if kind == "rest_map":
            body["questions"] = rng.sample(QUESTIONS, rng.randint(2, 4))
            body["criteria"] = "throughput"
    return Case(kind, body, stream)


def sampling_options(rng: random.Random) -> dict[str, Any]:
    """One to three of the sampler's processing options: penalties, logit_bias, top-k, min-p, min_tokens,
    stop_token_ids (the extensions in `extra_body`, as the openai client sends them)."""
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    names = ["frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "top_k", "min_p",
             "min_tokens", "stop_token_ids"]
    for name in rng.sample(names, rng.randint(1, 3)):
        if name in ("frequency_penalty", "presence_penalty"):
            out[name] = rng.choice([-0.5, 0.5, 1.5])
        elif name == "repetition_penalty":
            extra[name] = rng.choice([0.9, 1.2, 1.5])
        elif name == "logit_bias":
            out[name] = {str(i): rng.choice([-100, -3, 3, 8]) for i in rng.sample(COMMON_IDS, rng.randint(1, 3))}
        elif name == "top_k":
            extra[name] = rng.choice([1, 5, 40])
        elif name == "min_p":
            extra[name] = rng.choice([0.05, 0.2])
        elif name == "min_tokens":
            extra[name] = rng.randint(1, 8)
        else:
            extra[name] = rng.sample(COMMON_IDS, rng.randint(1, 2))
    if extra:
        out["extra_body"] = extra
    return out


# ---- running one request -------------------------------------------------------------------------------------
def _chat_logprobs(content: Iterable[Any] | None) -> list[list[Any]]:
    return [[t.token, t.logprob, [[x.token, x.logprob] for x in (t.top_logprobs or [])]] for t in content or []]


def _completion_logprobs(lp: Any) -> list[list[Any]]:
    if lp is None or lp.tokens is None:
        return []
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    return [[t, v, [[k, x] for k, x in (top or {}).items()]]
            for t, v, top in zip(lp.tokens, lp.token_logprobs or [None] * len(lp.tokens), tops, strict=True)]


def _choice(index: int, text: str, finish: str | None, tools: list[list[str]], logprobs: list[list[Any]],
            asked: bool) -> Choice:
    return {"index": index, "text": text, "finish": finish, "tools": tools or None,
            "logprobs": logprobs if asked else None}


def _finish(c: Any) -> str | None:
    """A choice's finish_reason, with its stop_reason (the stop string or token id) where one is given."""
    stop = (c.model_extra or {}).get("stop_reason")
    return c.finish_reason if stop is None or c.finish_reason is None else f"{c.finish_reason} ({stop!r})"


def chat_choices(response: Any, asked_logprobs: bool) -> list[Choice]:
    """A chat completion's choices, normalized."""
    out = []
    for c in sorted(response.choices, key=lambda c: c.index):
        m = c.message
        tools = [[t.function.name, t.function.arguments] for t in (m.tool_calls or [])]
        if m.function_call is not None:
            tools.append([m.function_call.name, m.function_call.arguments])
        out.append(_choice(c.index, m.content or "", _finish(c), tools,
                           _chat_logprobs(c.logprobs.content if c.logprobs else None), asked_logprobs))
    return out


def chat_stream_choices(chunks: Iterable[Any], asked_logprobs: bool) -> list[Choice]:
    """A streamed chat completion's chunks put together as `chat_choices` gives the unstreamed answer."""
    acc: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            a = acc.setdefault(c.index, {"text": "", "finish": None, "tools": {}, "logprobs": []})
            d = c.delta
            a["text"] += d.content or ""
            for t in d.tool_calls or []:
                call = a["tools"].setdefault(t.index, ["", ""])
                if t.function is not None:
                    call[0] += t.function.name or ""
                    call[1] += t.function.arguments or ""
            if d.function_call is not None:
                call = a["tools"].setdefault(-1, ["", ""])
                call[0] += d.function_call.name or ""
                call[1] += d.function_call.arguments or ""
            if c.logprobs is not None:
                a["logprobs"] += _chat_logprobs(c.logprobs.content)
            if c.finish_reason is not None:
                a["finish"] = _finish(c)
    return [_choice(i, a["text"], a["finish"], [a["tools"][k] for k in sorted(a["tools"])], a["logprobs"],
                    asked_logprobs) for i, a in sorted(acc.items())]


def completion_choices(response: Any, asked_logprobs: bool) -> list[Choice]:
    """A completion's choices, normalized."""
    return [_choice(c.index, c.text, _finish(c), [], _completion_logprobs(c.logprobs), asked_logprobs)
            for c in sorted(response.choices, key=lambda c: c.index)]


def completion_stream_choices(chunks: Iterable[Any], asked_logprobs: bool) -> list[Choice]:
    """A streamed completion's chunks put together as `completion_choices` gives the unstreamed answer."""
    acc: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            a = acc.setdefault(c.index, {"text": "", "finish": None, "logprobs": []})
            a["text"] += c.text or ""
            a["logprobs"] += _completion_logprobs(c.logprobs)
            if c.finish_reason is not None:
                a["finish"] = _finish(c)
    return [_choice(i, a["text"], a["finish"], [], a["logprobs"], asked_logprobs) for i, a in sorted(acc.items())]


def run_openai(client: Any, case: Case, stream: bool) -> list[Choice]:
    body = dict(case.body)
    if case.api == "chat":
        asked = bool(body.get("logprobs"))
        if stream:
            return chat_stream_choices(client.chat.completions.create(**body, stream=True), asked)
        return chat_choices(client.chat.completions.create(**body), asked)
    asked = body.get("logprobs") is not None
    if stream:
        return completion_stream_choices(client.completions.create(**body, stream=True), asked)
    return completion_choices(client.completions.create(**body), asked)


def _read(var: Any, stream: bool, criteria: str) -> str:
    return "".join(var.stream(criteria)) if stream else var.get(criteria)


def run_rest(url: str, case: Case, stream: bool) -> list[Choice]:
    """One session's calls through the REST API; a choice per output variable (text only), in a fixed order."""
    b = case.body
    user = "<|im_start|>user\n"
    answer = "<|im_end|>\n<|im_start|>assistant\n"
    with VirtualMachine(url, timeout=TIMEOUT) as vm:
        if case.kind == "rest_chain":  # the second call reads the first's output
            first = vm.semantic_call(f"{user}Write one sentence about {{{{topic}}}}.{answer}{{{{a}}}}", [
                {"name": "topic", "value": b["topic"]},
                {"name": "a", "is_output": True, "sampling_config": b["first"]}])
            second = vm.semantic_call(
                f"{user}Is this sentence about {{{{topic}}}}? Answer yes or no.\n\n{{{{a}}}}{answer}{{{{b}}}}", [
                    {"name": "topic", "value": b["topic"]}, {"name": "a", "var_id": first["a"].id},
                    {"name": "b", "is_output": True, "sampling_config": b["second"]}])
            outs = [_read(second["b"], stream, b["criteria"]), first["a"].get(b["criteria"])]
        elif case.kind == "rest_two_outputs":  # one template, two outputs: the second continues after the first
            got = vm.semantic_call(
                f"{CHATML_SYSTEM}{user}Name a book about {{{{topic}}}}.{answer}{{{{title}}}}<|im_end|>\n{user}"
                f"Who wrote it?{answer}{{{{author}}}}", [
                    {"name": "topic", "value": b["topic"]},
                    {"name": "title", "is_output": True, "sampling_config": dict(b["first"], stop=["\n"])},
                    {"name": "author", "is_output": True, "sampling_config": b["second"]}])
            outs = [_read(got["author"], stream, b["criteria"]), got["title"].get(b["criteria"])]
        else:  # rest_map: map calls sharing the long system prompt, a reduce reading all their outputs
            maps = [vm.semantic_call(f"{CHATML_SYSTEM}{user}{{{{q}}}}{answer}{{{{a}}}}", [
                {"name": "q", "value": q}, {"name": "a", "is_output": True, "sampling_config": b["first"]}])["a"]
                for q in b["questions"]]
            slots = "\n".join(f"- {{{{a{i}}}}}" for i in range(len(maps)))
            reduce = vm.semantic_call(
                f"{user}Here are some answers:\n{slots}\nSummarize them in one sentence.{answer}{{{{summary}}}}",
                [*({"name": f"a{i}", "var_id": m.id} for i, m in enumerate(maps)),
                 {"name": "summary", "is_output": True, "sampling_config": b["second"]}])
            outs = [_read(reduce["summary"], stream, b["criteria"]), *(m.get(b["criteria"]) for m in maps)]
    return [_choice(i, text, None, [], [], False) for i, text in enumerate(outs)]


def run_case(client: Any, url: str, case: Case, stream: bool) -> Outcome:
    """The request's answer, or the error (an HTTP error or a timeout is a failure to report, not a crash)."""
    t0 = time.perf_counter()
    try:
        choices = run_rest(url, case, stream) if case.api == "rest" else run_openai(client, case, stream)
        return {"choices": choices, "seconds": round(time.perf_counter() - t0, 3)}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500], "seconds": round(time.perf_counter() - t0, 3)}


def run_concurrently(jobs: list[Callable[[], None]], stagger: list[float], timeout: float) -> list[bool]:
    """Start each job on a thread, `stagger[i]` seconds after the one before; whether each ended in time."""
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for t, pause in zip(threads, stagger, strict=True):
        t.start()
        time.sleep(pause)
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [not t.is_alive() for t in threads]


# ---- comparing -----------------------------------------------------------------------------------------------
def first_divergence(a: str, b: str) -> int:
    """The first character where two texts differ (the shorter one's length if one begins the other)."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def logprob_gap(a: list[list[Any]] | None, b: list[list[Any]] | None) -> tuple[str | None, float]:
    """(where two logprob lists differ in tokens, None if nowhere; the largest gap of their values)."""
    if (a is None) != (b is None):
        return f"logprobs {'missing' if a is None else 'present'} / {'missing' if b is None else 'present'}", 0.0
    a, b = a or [], b or []
    far = 0.0
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x[0] != y[0]:
            return f"logprob tokens differ at token {k} ({x[0]!r} / {y[0]!r})", far
        if [t for t, _ in x[2]] != [t for t, _ in y[2]]:
            return f"top_logprobs tokens differ at token {k} ({[t for t, _ in x[2]]} / {[t for t, _ in y[2]]})", far
        pairs = [(x[1], y[1]), *((p[1], q[1]) for p, q in zip(x[2], y[2], strict=True))]
        for p, q in pairs:
            if (p is None) != (q is None):
                return f"logprob {p} / {q} at token {k}", far
            if p is not None and q is not None:
                far = max(far, abs(p - q) if math.isfinite(p) and math.isfinite(q) else (0.0 if p == q else math.inf))
    if len(a) != len(b):
        return f"{len(a)} / {len(b)} logprob tokens", far
    return None, far


def too_big(outcome: Outcome) -> bool:
    """The request was refused as larger than the whole KV pool (a small `--kv-memory-mb`) or than the model's
    maximum length (`--max-model-len`): a refusal that depends on the request alone, not on what ran beside it."""
    return bool(TOO_BIG.search(outcome.get("error", "")))


def compare(a: Outcome, b: Outcome, tolerance: float = 0.0) -> tuple[str | None, float]:
    """(where two answers to one request differ, None if they agree; the largest logprob gap). An error on
    either side is a difference, but for a request both sides refused as too big (`too_big`)."""
    if too_big(a) and too_big(b):
        return None, 0.0
    if "error" in a or "error" in b:
        return f"error: {a.get('error', 'ok')} / {b.get('error', 'ok')}", 0.0
    ca, cb = a["choices"], b["choices"]
    if len(ca) != len(cb):
        return f"{len(ca)} / {len(cb)} choices", 0.0
    far = 0.0
    where: str | None = None
    for x, y in zip(ca, cb, strict=True):
        i = x["index"]
        if x["text"] != y["text"]:
            k = first_divergence(x["text"], y["text"])
            where = where or (f"choice {i}: text differs from char {k} ({len(x['text'])} / {len(y['text'])} chars): "
                              f"{x['text'][max(0, k - 12):k + 24]!r} / {y['text'][max(0, k - 12):k + 24]!r}")
        elif x["finish"] != y["finish"]:
            where = where or f"choice {i}: finish {x['finish']} / {y['finish']}"
        elif x["tools"] != y["tools"]:
            where = where or f"choice {i}: tool calls {x['tools']} / {y['tools']}"
        token_diff, gap = logprob_gap(x["logprobs"], y["logprobs"])
        far = max(far, gap)
        if token_diff is not None:
            where = where or f"choice {i}: {token_diff}"
    if where is None and far > tolerance:
        where = f"logprobs differ by up to {far:.3g}"
    return where, far


@dataclass
class Verdict:
    """What one case's comparisons found."""

    mix: str | None  # the mix against the request alone
    stream: str | None  # streamed alone against unstreamed alone (None also where the request does not stream)
    logprob_gap: float

    @property
    def differed(self) -> bool:
        return self.mix is not None or self.stream is not None


def judge(case: Case, tolerance: float = 0.0) -> Verdict:
    mix, gap = compare(case.outcomes["mix"], case.outcomes["alone"], tolerance)
    stream = None
    if "alone_unstreamed" in case.outcomes:
        stream, gap2 = compare(case.outcomes["alone"], case.outcomes["alone_unstreamed"], tolerance)
        gap = max(gap, gap2)
    return Verdict(mix, stream, gap)


def describe_request(case: Case) -> str:
    """The request in short (the long shared system prompt elided) for the report."""
    text = json.dumps({k: v for k, v in case.body.items() if k not in ("model", "tools")}, sort_keys=True)
    text = text.replace(json.dumps(SYSTEM)[1:-1], "<SYSTEM>")
    return f"{case.kind}{' stream' if case.stream else ''} {text}{' tools=TOOLS' if 'tools' in case.body else ''}"


def case_report(i: int, case: Case, verdict: Verdict) -> dict[str, Any]:
    """A case for the JSON: every answer in full where it differed, else the mix's texts alone."""
    out = {"case": i, "kind": case.kind, "stream": case.stream, "request": case.body,
           "logprob_gap": verdict.logprob_gap, "mix_vs_alone": verdict.mix, "stream_vs_unstreamed": verdict.stream}
    if verdict.differed:
        return out | {"outcomes": case.outcomes}
    return out | {"texts": [c["text"] for c in case.outcomes["mix"].get("choices", [])]}


# ---- the servers ---------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child before exec: SIGTERM once this process's parent ends (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def free_port_range(n: int) -> int:
    """A base port whose n ports from it are free now (engines of `--engines n` listen on base + i)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        with contextlib.ExitStack() as stack:
            try:
                for i in range(n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + i))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


def http_get(url: str, timeout: float = 5.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except OSError:
        return None


class Server:
    """One `parrot serve` this run starts, and stops by its PID (it also ends with this process, and after
    `lifetime` seconds in any case)."""

    def __init__(self, name: str, args: list[str], log: Path, lifetime: float) -> None:
        self.name, self.port, self.log_path = name, free_port(), log
        if "--engines" in args and "--engine-base-port" not in args:  # the two servers' engines apart
            engines = int(args[args.index("--engines") + 1])
            args = [*args, "--engine-base-port", str(free_port_range(max(engines, 1)))]
        self.cmd = [sys.executable, "-m", "parrot.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    *args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.lifetime = lifetime
        self._timer: threading.Timer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=ROOT, preexec_fn=_die_with_parent)  # before any thread starts
        return self

    def expire(self) -> None:
        """Stop the server after its lifetime whatever happens to this run."""
        self._timer = threading.Timer(self.lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()

    def wait_ready(self, timeout: float, warm: bool) -> dict[str, Any]:
        """/health once it answers with an engine (warming up or not; with `warm`: once it says ok)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"parrot serve ({self.name}) exited ({self.proc.returncode}); see {self.log_path}")
            raw = http_get(self.url + "/health", timeout=2)
            if raw:
                health = json.loads(raw)
                if health.get("engines") and (health.get("status") == "ok" or not warm):
                    return health
            time.sleep(0.5)
        raise RuntimeError(f"parrot serve ({self.name}) not ready within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM to this PID only: uvicorn shuts down gracefully
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def metric(url: str, name: str, over: Callable[[list[float]], float] = sum) -> float | None:
    """A /metrics value: the series of `name` (one per engine, say) put together by `over` (their sum)."""
    raw = http_get(url + "/metrics")
    if raw is None:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ")]
    return over(values) if values else None


def kv_pages_total(url: str, engines: int = 1, wait: float = 60.0) -> int | None:
    """The engines' KV pools in pages (16 tokens each; summed over `engines` engines, once that many have
    reported theirs), from a session's graph view."""
    deadline = time.monotonic() + wait
    try:
        with VirtualMachine(url, timeout=30) as vm:
            while True:
                totals = [e["kv_pages_total"] for e in vm._request("GET", f"/v1/session/{vm.session_id}/graph")[
                    "engines"] if e["kv_pages_total"] is not None]  # (an engine process: once it reported)
                if len(totals) >= engines or time.monotonic() > deadline:
                    return sum(totals) if totals else None
                time.sleep(0.5)
    except Exception:  # noqa: BLE001 (informational only)
        return None


def engines_of(serve_args: list[str]) -> int:
    """How many engines `parrot serve` starts with these arguments (`--engines N`, else one)."""
    for i, arg in enumerate(serve_args):
        if arg.startswith("--engines="):
            return int(arg.split("=", 1)[1])
        if arg == "--engines" and i + 1 < len(serve_args):
            return int(serve_args[i + 1])
    return 1


class KvWatch:
    """Polls the mix server's KV usage while a round runs: the highest seen."""

    def __init__(self, url: str) -> None:
        self.url, self.peak = url, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            usage = metric(self.url, "parrot:kv_cache_usage_perc", max)  # the fullest engine's
            if usage is not None:
                self.peak = max(self.peak, usage)

    def __enter__(self) -> KvWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---- the run -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-memory-mb", type=int, default=16, help="a small pool: preemption and eviction")
    ap.add_argument("--tolerance", type=float, default=0.0, help="logprob gap still counted as equal")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=None, help="draw only these kinds of request")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for both `parrot serve`s (repeat it; e.g. --serve-arg=--speculative-tokens"
                         " --serve-arg=4)")
    ap.add_argument("--warm", action="store_true", help="wait until both servers compiled every shape")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds a request may take")
    ap.add_argument("--out", default="benchmarks/results/serve_differential.json")
    ap.add_argument("--log-dir", default="benchmarks/results/logs")
    args = ap.parse_args(argv)

    serve_args = ["--kv-memory-mb", str(args.kv_memory_mb), *args.serve_arg]
    lifetime = 600.0 + args.rounds * 600.0
    log_dir = Path(args.log_dir)
    mix_server = Server("mix", serve_args, log_dir / "serve_differential-mix.log", lifetime)
    alone_server = Server("alone", serve_args, log_dir / "serve_differential-alone.log", lifetime)
    t_start = time.perf_counter()
    rounds: list[dict[str, Any]] = []
    differed = failed = refused = 0
    max_gap = 0.0
    try:
        mix_server.start()
        alone_server.start()
        for s in (mix_server, alone_server):
            s.expire()
        for s in (mix_server, alone_server):
            s.wait_ready(900, args.warm)
        pages = kv_pages_total(mix_server.url, engines_of(serve_args))
        print(f"parrot serve {' '.join(serve_args)}: mix at {mix_server.url}, alone at {alone_server.url}; KV pool "
              f"{pages} pages of 16 tokens in all; ready after {time.perf_counter() - t_start:.1f} s", flush=True)
        clients = {s.name: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=args.timeout,
                                         max_retries=0) for s in (mix_server, alone_server)}
        for rnd in range(args.rounds):
            rng = random.Random(args.seed * 1000 + rnd)
            cases = [make_case(rng, args.kinds) for _ in range(rng.randint(4, 12))]
            stagger = [rng.choice([0.0, 0.0, 0.01, 0.05, 0.2]) for _ in cases]

            def job(c: Case) -> Callable[[], None]:
                return lambda: c.outcomes.__setitem__("mix", run_case(clients["mix"], mix_server.url, c, c.stream))

            t0 = time.perf_counter()
            with KvWatch(mix_server.url) as watch:
                ended = run_concurrently([job(c) for c in cases], stagger, args.timeout + 30)
            t_mix = time.perf_counter() - t0
            for c, done in zip(cases, ended, strict=True):
                if not done:
                    c.outcomes["mix"] = {"error": f"timeout: no answer in {args.timeout + 30:.0f} s", "seconds": None}
            t0 = time.perf_counter()
            for c in cases:
                c.outcomes["alone"] = run_case(clients["alone"], alone_server.url, c, c.stream)
                if c.stream:
                    c.outcomes["alone_unstreamed"] = run_case(clients["alone"], alone_server.url, c, False)
            t_alone = time.perf_counter() - t0
            verdicts = [judge(c, args.tolerance) for c in cases]
            bad = [(i, c, v) for i, (c, v) in enumerate(zip(cases, verdicts, strict=True)) if v.differed]
            differed += len(bad)
            failed += sum(any("error" in o for o in c.outcomes.values()) for c in cases)
            refused += sum(all(too_big(o) for o in c.outcomes.values()) for c in cases)
            gap = max((v.logprob_gap for v in verdicts), default=0.0)
            max_gap = max(max_gap, gap)
            for i, c, v in bad:
                print(f"  round {rnd}, request {i}: {describe_request(c)}", flush=True)
                if v.mix:
                    print(f"    mix vs alone: {v.mix}", flush=True)
                if v.stream:
                    print(f"    streamed vs unstreamed (alone): {v.stream}", flush=True)
            retries = metric(mix_server.url, "parrot:overload_retries_total") or 0
            print(f"round {rnd}: {len(cases)} requests ({', '.join(c.kind + ('+s' if c.stream else '') for c in cases)}"
                  f"), {len(bad)} differed; mix {t_mix:.1f} s, alone {t_alone:.1f} s; KV peak "
                  f"{watch.peak:.0%}, overload retries so far {retries:.0f}; logprob gap {gap:.3g}", flush=True)
            rounds.append({"round": rnd, "requests": len(cases), "differed": len(bad), "mix_s": round(t_mix, 2),
                           "alone_s": round(t_alone, 2), "kv_peak": watch.peak,
                           "cases": [case_report(i, c, v) for i, (c, v) in enumerate(zip(cases, verdicts,
                                                                                            strict=True))]})
        hits = {s.name: metric(s.url, "parrot:prefix_cache_hits_total") for s in (mix_server, alone_server)}
        retries = metric(mix_server.url, "parrot:overload_retries_total")
    finally:
        for s in (mix_server, alone_server):
            s.stop()
    requests = sum(r["requests"] for r in rounds)
    seconds = time.perf_counter() - t_start
    print(f"{differed} of {requests} requests differed ({failed} with an error, {refused} refused on both sides as "
          f"larger than the KV pool or the model); largest logprob gap {max_gap:.3g}; {seconds:.0f} s")
    write_json({"model": MODEL, "kv_memory_mb": args.kv_memory_mb, "serve_args": serve_args, "seed": args.seed,
                "kv_pages_total": pages, "requests": requests, "differed": differed, "failed": failed,
                "refused": refused, "max_logprob_gap": max_gap, "tolerance": args.tolerance,
                "seconds": round(seconds, 1), "prefix_cache_hit_tokens": hits, "overload_retries": retries,
                "rounds": rounds}, args.out)
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
