"""How an application's calls reach a system. One app logic (workloads.py) runs on either runtime:

- `ParrotRuntime`: the app as semantic variables through the SDK. Calls are submitted at once with
  their inputs bound to other calls' output variables; the server sees the whole graph and runs it.
- `OpenAIRuntime`: the app's control flow in the client, as a vLLM / llama.cpp user writes it. A call
  waits (client-side) for the calls it reads, renders its prompt and sends one streamed
  `/v1/completions` request with the real `openai` client.

Both send the same prompt text for the same call: the SDK template with its inputs substituted, up to
the output placeholder. Every generation is greedy and produces exactly `max_tokens` tokens
(`ignore_eos`), so every system does the same work."""

from __future__ import annotations

import asyncio
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import parrot as P
from parrot.frontend.functions import Output, SemanticFunction

Handle = Any  # a runtime's reference to a value: a SemanticVariable (Parrot) or an asyncio.Task (OpenAI)
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass
class RequestRecord:
    """One generation as measured (vLLM benchmark_serving's definitions): TTFT from when the request
    could start (sent by the client; for Parrot: all inputs ready and the output needed) to its first
    token; TPOT the mean time per output token after the first; latency from start to last token."""

    kind: str
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int
    ttft_s: float | None  # None: not measurable (a server used without streaming)
    tpot_s: float | None
    latency_s: float


@dataclass
class AppRecord:
    kind: str
    jct_s: float


@dataclass
class Recorder:
    """Everything measured in one workload run on one system."""

    requests: list[RequestRecord] = field(default_factory=list)
    apps: list[AppRecord] = field(default_factory=list)


def output_port(fn: SemanticFunction) -> tuple[str, Output]:
    outs = [(n, ann) for n, ann in fn.ports if isinstance(ann, Output)]
    if len(outs) != 1 or not fn.template.rstrip().endswith("{{" + outs[0][0] + "}}"):
        raise ValueError(f"{fn.name}: the benchmarks need exactly one output placeholder, at the template's end")
    return outs[0]


def render_prompt(fn: SemanticFunction, inputs: dict[str, str]) -> str:
    """The prompt a plain completion API gets for this call: the template up to its output placeholder,
    with the inputs substituted (the text Parrot tokenizes for the same call)."""
    name, _ = output_port(fn)
    body = fn.template[: fn.template.rindex("{{" + name)]
    return _PLACEHOLDER.sub(lambda m: inputs[m.group(1)], body)


class App(ABC):
    """One running instance of an application (a Parrot session, or a client's control flow)."""

    def __init__(self, kind: str, recorder: Recorder) -> None:
        self.kind = kind
        self.recorder = recorder

    @abstractmethod
    async def call(self, fn: SemanticFunction, **inputs: str | Handle) -> Handle: ...

    @abstractmethod
    async def join(self, parts: list[Handle], sep: str = "\n") -> Handle: ...

    @abstractmethod
    async def get(self, value: Handle, criteria: str) -> str: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class Runtime(ABC):
    name: str

    @abstractmethod
    async def open_app(self, kind: str, recorder: Recorder) -> App: ...

    async def run_app(self, kind: str, recorder: Recorder, logic: Callable[[App], Awaitable[object]]) -> None:
        """Run one app to completion, recording its job completion time: from its start (its HTTP clients
        built, as a long-running client has them) to its result."""
        app = await self.open_app(kind, recorder)
        t0 = time.perf_counter()
        try:
            await logic(app)
            recorder.apps.append(AppRecord(kind, time.perf_counter() - t0))
        finally:
            await app.close()


# ---- Parrot: semantic variables through the SDK ---------------------------------------------------------
class ParrotApp(App):
    def __init__(self, kind: str, recorder: Recorder, vm: P.VirtualMachine) -> None:
        super().__init__(kind, recorder)
        self.vm = vm

    async def call(self, fn: SemanticFunction, **inputs: str | Handle) -> Handle:
        return await asyncio.to_thread(fn, vm=self.vm, **inputs)

    async def join(self, parts: list[Handle], sep: str = "\n") -> Handle:
        named = {f"part{i}": p for i, p in enumerate(parts)}
        return await asyncio.to_thread(self.vm.transform, "join", {"sep": sep}, **named)

    async def get(self, value: Handle, criteria: str) -> str:
        return await value.aget(criteria=criteria)

    async def close(self) -> None:
        """Collect the server's timings of this session's generations, then delete the session."""
        try:
            gens = (await asyncio.to_thread(self.vm.inspect))["generations"]
            self.recorder.requests += [
                RequestRecord(self.kind, g["prompt_tokens"], g["cached_tokens"], g["output_tokens"], g["ttft_s"],
                              g["tpot_s"], g["latency_s"]) for g in gens]
        finally:
            await asyncio.to_thread(self.vm.close)
            await self.vm.aclose()


class ParrotRuntime(Runtime):
    name = "parrot"

    def __init__(self, url: str) -> None:
        self.url = url

    async def open_app(self, kind: str, recorder: Recorder) -> App:
        """A session with its HTTP clients built, before the app's clock starts, as the OpenAI runtime builds
        its one client before any app starts (the SDK builds its asyncio client on first use otherwise). The
        SDK's clients share one TLS context (`sdk._tls`), so only the first app's loads the trust store (tens
        to hundreds of ms of CPU on a loaded 2-core machine, which apps arriving mid-run took from the server).
        The session's creation (one loopback request) is here too."""
        vm = P.VirtualMachine(self.url, timeout=1800)
        await asyncio.to_thread(vm.open)
        vm._async()  # the SDK's asyncio client, built now (outside the app's time)
        return ParrotApp(kind, recorder, vm)


# ---- OpenAI-compatible servers: control flow in the client ----------------------------------------------
class OpenAIApp(App):
    def __init__(self, kind: str, recorder: Recorder, runtime: OpenAIRuntime) -> None:
        super().__init__(kind, recorder)
        self.rt = runtime
        self.tasks: list[asyncio.Task] = []

    def _spawn(self, coro: Awaitable[str]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task

    async def call(self, fn: SemanticFunction, **inputs: str | Handle) -> Handle:
        return self._spawn(self._complete(fn, inputs))

    async def join(self, parts: list[Handle], sep: str = "\n") -> Handle:
        async def joined() -> str:
            return sep.join([await _value(p) for p in parts])
        return self._spawn(joined())

    async def get(self, value: Handle, criteria: str) -> str:
        return await _value(value)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _complete(self, fn: SemanticFunction, inputs: dict[str, str | Handle]) -> str:
        values = {k: await _value(v) for k, v in inputs.items()}
        _, out = output_port(fn)
        cfg = out.sampling_config() or {}
        max_tokens = cfg.get("max_tokens", 64)
        t0 = time.perf_counter()
        if not self.rt.stream:
            done = await self.rt.client.completions.create(
                model=self.rt.model, prompt=render_prompt(fn, values), max_tokens=max_tokens, temperature=0.0,
                extra_body=self.rt.extra_body)
            usage = done.usage
            self.recorder.requests.append(RequestRecord(
                self.kind, usage.prompt_tokens if usage else None, None,
                usage.completion_tokens if usage else max_tokens, None, None, time.perf_counter() - t0))
            return done.choices[0].text
        stream = await self.rt.client.completions.create(
            model=self.rt.model, prompt=render_prompt(fn, values), max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=self.rt.extra_body)
        parts: list[str] = []
        first: float | None = None
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            text = chunk.choices[0].text if chunk.choices else ""
            if text:
                first = first or time.perf_counter()
                parts.append(text)
        end = time.perf_counter()
        # servers that report no usage when streaming (llama-cpp-python) send one text chunk per token
        n_out = usage.completion_tokens if usage is not None and usage.completion_tokens else len(parts)
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        first = first or end
        self.recorder.requests.append(RequestRecord(
            self.kind, usage.prompt_tokens if usage is not None else None, cached, n_out, first - t0,
            (end - first) / (n_out - 1) if n_out > 1 else None, end - t0))
        return "".join(parts)


async def _value(v: str | Handle) -> str:
    return v if isinstance(v, str) else await v


class OpenAIRuntime(Runtime):
    """`extra_body`: what the server needs to generate exactly max_tokens (e.g. {"ignore_eos": True}).
    `stream=False` for a server that cannot stream concurrent requests (no TTFT / TPOT then)."""

    def __init__(self, name: str, url: str, model: str, extra_body: dict[str, Any], stream: bool = True) -> None:
        import httpx
        import openai

        self.name = name
        self.model = model
        self.extra_body = extra_body
        self.stream = stream
        self.client = openai.AsyncOpenAI(
            base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=1800,
            # a fresh connection per request: llama-server closes idle keep-alive connections, and a request
            # on one it has just closed fails (the cost on loopback is well under a millisecond)
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=0),
                                          timeout=1800))

    async def open_app(self, kind: str, recorder: Recorder) -> App:
        return OpenAIApp(kind, recorder, self)
