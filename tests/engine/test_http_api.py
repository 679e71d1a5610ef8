"""The engine's HTTP face against a real uvicorn server on loopback, the tiny random model behind it.

Covers the primitives' round trips (fill, generate, fork, SSE streaming, free, ping, health), every error's
status and message, the server surviving bad input and disconnecting clients, the serve-core
registration and heartbeats (against a fake serve core on another port), and the `parrot engine` CLI."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import pytest
import uvicorn
from fastapi import FastAPI, HTTPException
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from parrot.cli import build_parser, engine_config_from_args, main
from parrot.engine import kernels
from parrot.engine.engine import EngineDeadError, LLMEngine
from parrot.engine.http_api import EngineServer, serve_core_link
from parrot.engine.kv_cache import OutOfPages
from parrot.engine.loader import default_model_path
from parrot.errors import ConflictError, InvalidRequestError, ModelLoadError, ParrotError
from parrot.protocol import (
    EngineRegistration,
    FillRequest,
    GenerateRequest,
    GenerateResponse,
    RuntimeInfo,
    SamplingParams,
    StreamChunk,
)
from tests.conftest import grammar_rejects, tiny_engine_config, tiny_model
from tests.servers import free_port

VOCAB = 260
MAX_LEN = 512  # tiny model: min(max_position 512, largest kv bucket 512)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def sampling(**kw: Any) -> dict[str, Any]:
    return {"max_tokens": 8, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    # lazy compilation: precompiling all 43 tiny shapes takes ~35 s here, lazily the tests touch a handful
    eng = LLMEngine(tiny_model(), tiny_engine_config(precompile=False, max_batch_size=16)).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: LLMEngine) -> Iterator[EngineServer]:
    srv = EngineServer(engine, "127.0.0.1", free_port(), log_level="warning").start_in_thread()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: EngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def fill(client: httpx.Client, ctx: str, tokens: list[int], parent: str | None = None) -> dict[str, Any]:
    r = client.post("/fill", json={"context_id": ctx, "parent_context_id": parent, "token_ids": tokens})
    assert r.status_code == 200, r.text
    return r.json()


def free(client: httpx.Client, ctx: str) -> None:
    r = client.post("/free_context", json={"context_id": ctx})
    assert r.status_code == 200, r.text


def ping(client: httpx.Client) -> RuntimeInfo:
    r = client.get("/ping")
    assert r.status_code == 200, r.text
    return RuntimeInfo.model_validate(r.json())


_CODES = {400: "invalid_request", 404: "not_found", 409: "conflict", 422: "invalid_request", 499: "aborted",
          503: "engine_unavailable", 507: "kv_cache_full"}


def expect_error(r: httpx.Response, status: int, *phrases: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"detail", "code"} and isinstance(body["detail"], str) and body["detail"], body
    assert body["code"] == _CODES.get(status, body["code"]) and body["code"].isidentifier(), body
    for p in phrases:
        assert p in body["detail"], (p, body["detail"])
    return body["detail"]


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of a Server-Sent Events stream."""
    event, data = "message", []
    for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            event = line[6:].strip()
    if data:
        yield event, "\n".join(data)


def stream(client: httpx.Client, body: dict[str, Any]) -> tuple[list[StreamChunk], list[tuple[str, str]]]:
    with client.stream("POST", "/generate_stream", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    chunks = [StreamChunk.model_validate_json(d) for e, d in events if e == "message" and d != "[DONE]"]
    return chunks, events


PROMPT = list(b"The quick brown fox jumps over the lazy dog.")


# ---- primitives ---------------------------------------------------------------------------------------
def test_health_and_ping(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    settings = r.json()["settings"]  # what the engine chose for its device
    assert settings["platform"] == jax.default_backend() and settings["kv_pages"] > 0 and settings["overlap"] is True
    assert settings["cpu_matmul"] == kernels.matmul_path()  # "amx-int8", "avx512-vnni", "avx2" or None (XLA)
    assert settings["bf16_tiles"] == kernels.bf16_tiles()
    assert settings["bf16_fills"] in (kernels.bf16_fills(), None)  # None: the engine fills prompts exactly
    assert settings["decode_attention_bf16"] in (False, kernels.decode_bf16())
    assert settings["prefill_attention"] == ("in place" if kernels.available() else "gathered")
    info = ping(client)
    assert info.model == "tiny-random" and info.max_context_len == MAX_LEN and info.page_size == 16
    assert info.settings == settings
    assert 0 <= info.free_pages <= info.total_pages and info.running == 0 and info.waiting == 0


def test_fill_generate_round_trip(client: httpx.Client) -> None:
    assert fill(client, "rt", PROMPT[:20]) == {"context_id": "rt", "num_tokens": 20, "logprobs": None}
    assert fill(client, "rt", PROMPT[20:]) == {"context_id": "rt", "num_tokens": len(PROMPT), "logprobs": None}
    r = client.post("/generate", json={"context_id": "rt", "sampling": sampling(max_tokens=10)})
    assert r.status_code == 200, r.text
    out = GenerateResponse.model_validate(r.json())
    assert out.context_id == "rt" and out.finish_reason == "length"
    assert len(out.token_ids) == 10 and all(0 <= t < VOCAB for t in out.token_ids)
    assert out.num_tokens == len(PROMPT) + 10
    # the generated tokens are in the context: a further fill and generate continue after them
    assert fill(client, "rt", [65])["num_tokens"] == len(PROMPT) + 11
    free(client, "rt")
    # prompt logprobs: one per filled token, the context's first without one
    r = client.post("/fill", json={"context_id": "rt-scored", "token_ids": PROMPT[:6], "logprobs": 2})
    assert r.status_code == 200, r.text
    lps = r.json()["logprobs"]
    assert [lp["token_id"] for lp in lps] == PROMPT[:6] and lps[0]["logprob"] is None and lps[0]["top"] == []
    assert all(lp["logprob"] <= 0 and len(lp["top"]) == 2 for lp in lps[1:])
    free(client, "rt-scored")


def test_fork_then_generate(client: httpx.Client) -> None:
    fill(client, "parent", PROMPT)
    before = ping(client)
    outs = []
    for child in ("child-a", "child-b"):
        r = client.post("/generate", json={"context_id": child, "parent_context_id": "parent",
                                           "sampling": sampling(max_tokens=6)})
        assert r.status_code == 200, r.text
        outs.append(GenerateResponse.model_validate(r.json()))
    assert outs[0].num_tokens == len(PROMPT) + 6
    assert outs[0].token_ids == outs[1].token_ids  # greedy from the same parent
    assert ping(client).num_contexts == before.num_contexts + 2
    # the parent is unchanged by its children: a generate on it gives the children's tokens too
    r = client.post("/generate", json={"context_id": "parent", "sampling": sampling(max_tokens=6)})
    assert r.json()["token_ids"] == outs[0].token_ids and r.json()["num_tokens"] == len(PROMPT) + 6
    # a fill can fork as well
    assert fill(client, "child-c", [1, 2, 3], parent="child-a")["num_tokens"] == len(PROMPT) + 6 + 3
    for ctx in ("child-c", "child-a", "child-b", "parent"):
        free(client, ctx)


def test_stream_matches_generate(client: httpx.Client) -> None:
    fill(client, "s-base", PROMPT)
    r = client.post("/generate", json={"context_id": "s-a", "parent_context_id": "s-base",
                                       "sampling": sampling(max_tokens=24)})
    assert r.status_code == 200, r.text
    out = GenerateResponse.model_validate(r.json())
    chunks, events = stream(client, {"context_id": "s-b", "parent_context_id": "s-base",
                                     "sampling": sampling(max_tokens=24)})
    assert events[-1] == ("message", "[DONE]")
    assert chunks[-1].finish_reason == "length" and chunks[-1].token_id is None
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert [c.token_id for c in chunks[:-1]] == out.token_ids
    assert "".join(c.text for c in chunks) == out.text
    for ctx in ("s-a", "s-b", "s-base"):
        free(client, ctx)


@pytest.mark.parametrize("stop", [
    "O",
    "OO",
])
def test_stream_with_stop_string_matches_generate(client: httpx.Client, stop: str) -> None:
    fill(client, "st-base", PROMPT)  # greedy continuation of PROMPT: "OOOOOOOOOOOOOO" + 10 empty tokens
    try:
        body = {"parent_context_id": "st-base", "sampling": sampling(max_tokens=24, stop=[stop])}
        r = client.post("/generate", json={"context_id": "st-a", **body})
        assert r.status_code == 200, r.text
        out = GenerateResponse.model_validate(r.json())
        chunks, _ = stream(client, {"context_id": "st-b", **body})
        assert out.finish_reason == "stop" and chunks[-1].finish_reason == "stop"
        assert stop not in out.text
        assert "".join(c.text for c in chunks) == out.text
        # (token ids may differ: /generate lists the token that completed the stop string, the stream
        # sends no chunk for it because it adds no text)
    finally:
        for ctx in ("st-a", "st-b", "st-base"):
            client.post("/free_context", json={"context_id": ctx})


def test_constrained_generate_and_stream(client: httpx.Client) -> None:
    """A regex-constrained generate and stream agree and match; logprobs ride on the chunks; an invalid
    constraint is a 400 with the matcher's message on both routes."""
    fill(client, "c-base", PROMPT)
    body = {"parent_context_id": "c-base", "sampling": sampling(max_tokens=12, regex="[0-9]{4}", logprobs=2)}
    r = client.post("/generate", json={"context_id": "c-a", **body})
    assert r.status_code == 200, r.text
    out = GenerateResponse.model_validate(r.json())
    assert len(out.text) == 4 and out.text.isdigit() and out.finish_reason == "stop"
    assert [lp.token_id for lp in out.logprobs] == out.token_ids and all(len(lp.top) == 2 for lp in out.logprobs)
    chunks, events = stream(client, {"context_id": "c-b", **body})
    assert events[-1] == ("message", "[DONE]") and "".join(c.text for c in chunks) == out.text
    assert [c.logprob for c in chunks if c.token_id is not None] == out.logprobs
    for path in ("/generate", "/generate_stream"):
        r = client.post(path, json={"context_id": "c-c", "parent_context_id": "c-base",
                                    "sampling": sampling(regex="(")})
        expect_error(r, 400, "invalid regex")
    for ctx in ("c-a", "c-b", "c-base"):
        free(client, ctx)


@pytest.mark.parametrize("at", [0, 2])
def test_a_token_the_grammar_rejects_fails_that_generate_alone(client: httpx.Client, server: EngineServer,
                                                               monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """A matcher that rejects the token it is fed fails that generate with 422 generation_failed (at its
    first token) or an `event: error` with that code (later), never a 5xx (which tells a serve core the
    engine is gone); a generate running beside it completes, and the engine serves on."""
    grammar_rejects(monkeypatch, at)
    fill(client, "g-base", PROMPT)
    body = {"parent_context_id": "g-base", "sampling": sampling(max_tokens=8, regex="[a-y]{8}")}
    plain: dict[str, Any] = {}

    def beside() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            plain["r"] = c.post("/generate", json={"context_id": "g-plain", "parent_context_id": "g-base",
                                                   "sampling": sampling(max_tokens=24)})

    thread = threading.Thread(target=beside)
    thread.start()
    if at == 0:
        for i, path in enumerate(("/generate", "/generate_stream")):
            r = client.post(path, json={"context_id": f"g-{i}", **body})
            assert r.status_code == 422 and r.json()["code"] == "generation_failed", r.text
            assert "left its grammar" in r.json()["detail"]
    else:
        chunks, events = stream(client, {"context_id": "g-0", **body})
        assert len([c for c in chunks if c.token_id is not None]) == at
        assert events[-1][0] == "error" and '"generation_failed"' in events[-1][1]
    thread.join(60)
    assert plain["r"].status_code == 200 and len(plain["r"].json()["token_ids"]) == 24
    assert client.get("/health").json()["status"] == "ok"
    for ctx in ("g-plain", "g-base", "g-0", "g-1"):
        client.post("/free_context", json={"context_id": ctx})


def test_free_context_updates_ping(client: httpx.Client) -> None:
    before = ping(client)
    fill(client, "f1", list(range(40)))
    after_fill = ping(client)
    assert after_fill.num_cached_tokens == before.num_cached_tokens + 40
    assert after_fill.num_contexts == before.num_contexts + 1
    assert after_fill.free_pages == before.free_pages - 3  # 40 tokens in 16-token pages
    fill(client, "f2", [7], parent="f1")  # shares f1's two full pages, copies the partial one
    assert ping(client).num_cached_tokens == before.num_cached_tokens + 40 + 41
    r = client.post("/free_context", json={"context_id": "f1"})
    assert r.status_code == 200 and r.json() == {"context_id": "f1", "freed_pages": 1}  # the rest is f2's too
    r = client.post("/free_context", json={"context_id": "f2"})
    assert r.status_code == 200 and r.json()["freed_pages"] == 3
    end = ping(client)
    assert (end.num_cached_tokens, end.num_contexts, end.free_pages) == (
        before.num_cached_tokens, before.num_contexts, before.free_pages)
    assert end.steps > before.steps


def test_concurrent_generates(server: EngineServer, client: httpx.Client) -> None:
    fill(client, "c-base", PROMPT)
    solo = client.post("/generate", json={"context_id": "c-solo", "parent_context_id": "c-base",
                                          "sampling": sampling(max_tokens=12)}).json()

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            return await asyncio.gather(*[
                ac.post("/generate", json={"context_id": f"c-{i}", "parent_context_id": "c-base",
                                           "sampling": sampling(max_tokens=12)}) for i in range(6)])

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert all(len(r.json()["token_ids"]) == 12 for r in responses)
    assert sum(r.json()["token_ids"] == solo["token_ids"] for r in responses) >= 5  # batched == alone (fp32)
    for ctx in [*(f"c-{i}" for i in range(6)), "c-solo", "c-base"]:
        free(client, ctx)


# ---- errors -------------------------------------------------------------------------------------------
def test_unknown_context_is_404(client: httpx.Client) -> None:
    r = client.post("/generate", json={"context_id": "nope", "sampling": sampling()})
    expect_error(r, 404, "'nope'", "does not exist")
    r = client.post("/generate_stream", json={"context_id": "nope", "sampling": sampling()})
    expect_error(r, 404, "'nope'", "does not exist")  # a plain HTTP error, not an event stream


def test_missing_parent_is_404(client: httpx.Client) -> None:
    r = client.post("/fill", json={"context_id": "orphan", "parent_context_id": "ghost", "token_ids": [1]})
    expect_error(r, 404, "parent", "'ghost'")
    r = client.post("/generate", json={"context_id": "orphan", "parent_context_id": "ghost"})
    expect_error(r, 404, "parent", "'ghost'")
    # the failed fork created nothing
    expect_error(client.post("/free_context", json={"context_id": "orphan"}), 404, "does not exist")


def test_free_unknown_context_is_404(client: httpx.Client) -> None:
    expect_error(client.post("/free_context", json={"context_id": "never"}), 404, "'never'", "does not exist")
    fill(client, "twice", [1, 2])
    free(client, "twice")
    expect_error(client.post("/free_context", json={"context_id": "twice"}), 404, "does not exist")


def test_free_while_generating_is_409(client: httpx.Client) -> None:
    fill(client, "busy", [1, 2, 3])
    body = {"context_id": "busy", "sampling": sampling(max_tokens=MAX_LEN - 3 - 1)}
    for _attempt in range(3):  # retried only if the whole generation beat the free request (never seen)
        with client.stream("POST", "/generate_stream", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # the generate is running now
            resp = client.post("/free_context", json={"context_id": "busy"})
            events = list(sse_events(lines))
        if resp.status_code != 200:
            break
        fill(client, "busy", [1, 2, 3])  # it finished and was freed: start over
    expect_error(resp, 409, "'busy'", "in use")
    assert events[-1] == ("message", "[DONE]")  # the running generate was not disturbed
    free(client, "busy")  # once it is done, the context frees normally


def test_token_ids_outside_vocabulary_are_400(client: httpx.Client) -> None:
    for bad in ([VOCAB], [-1], [1, 2, 10**12]):
        r = client.post("/fill", json={"context_id": "vocab", "token_ids": bad})
        expect_error(r, 400, "outside the vocabulary", str(VOCAB))
    r = client.post("/fill", json={"context_id": "vocab", "token_ids": [1]})
    assert r.status_code == 200
    r = client.post("/generate", json={"context_id": "vocab", "sampling": sampling(stop_token_ids=[VOCAB + 5])})
    expect_error(r, 400, "stop_token_ids", "outside the vocabulary")
    free(client, "vocab")


def test_too_long_is_400(client: httpx.Client) -> None:
    r = client.post("/fill", json={"context_id": "long", "token_ids": [5] * (MAX_LEN + 1)})
    expect_error(r, 400, "maximum length", str(MAX_LEN))
    fill(client, "long", [5] * (MAX_LEN - 10))
    r = client.post("/fill", json={"context_id": "long", "token_ids": [5] * 11})
    expect_error(r, 400, "maximum length")
    r = client.post("/generate", json={"context_id": "long", "sampling": sampling(max_tokens=11)})
    expect_error(r, 400, "maximum length", "max_tokens")
    # the failed requests left the context as it was
    assert fill(client, "long", [5] * 10)["num_tokens"] == MAX_LEN
    free(client, "long")


@pytest.mark.parametrize(("field", "value", "phrase"), [
    ("top_p", 0, "sampling.top_p"), ("top_p", 1.5, "sampling.top_p"), ("temperature", -1, "sampling.temperature"),
    ("max_tokens", 0, "sampling.max_tokens"), ("top_k", -3, "sampling.top_k"), ("seed", -1, "sampling.seed"),
    ("bogus", 1, "sampling.bogus"),
])
def test_sampling_out_of_range_is_422(client: httpx.Client, field: str, value: Any, phrase: str) -> None:
    r = client.post("/generate", json={"context_id": "x", "sampling": {field: value}})
    expect_error(r, 422, phrase)


@pytest.mark.parametrize(("path", "content", "phrase"), [
    ("/fill", b'{"context_id": "x", "token_ids": [1, 2', "not valid JSON"),
    ("/generate", b"not json at all", "not valid JSON"),
    ("/fill", b"", "JSON body"),
    ("/fill", b'[1, 2, 3]', "dictionary"),
    ("/fill", b'{"context_id": "x", "token_ids": []}', "token_ids"),
    ("/fill", b'{"context_id": "", "token_ids": [1]}', "context_id"),
    ("/fill", b'{"context_id": "x", "token_ids": ["a"]}', "token_ids.0"),
    ("/free_context", b'{}', "context_id: Field required"),
    ("/generate", b'{"context_id": "x", "sampling": {"temperature": NaN}}', "sampling.temperature"),
])
def test_malformed_body_is_422(client: httpx.Client, path: str, content: bytes, phrase: str) -> None:
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    expect_error(r, 422, phrase)


def test_unknown_route_and_method(client: httpx.Client) -> None:
    expect_error(client.get("/nowhere"), 404, "Not Found")
    expect_error(client.get("/fill"), 405, "Method Not Allowed")


@pytest.mark.parametrize(("exc", "status"), [
    (OutOfPages(3, 1, "extend 'x' by 40 tokens"), 507),
    (EngineDeadError("the engine stopped (boom)"), 503),
    (ConflictError("context 'x' is in use"), 409),
    (RuntimeError("an engine bug"), 500),
])
def test_engine_errors_map_to_status(client: httpx.Client, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch,
                                     exc: Exception, status: int) -> None:
    async def failing_fill(req: object) -> None:
        raise exc

    monkeypatch.setattr(engine, "fill", failing_fill)
    detail = expect_error(client.post("/fill", json={"context_id": "x", "token_ids": [1]}), status)
    assert str(exc) in detail


def test_dead_engine(server: EngineServer, engine: LLMEngine) -> None:
    dead = LLMEngine(tiny_model(), tiny_engine_config(precompile=False, max_batch_size=16)).start()
    dead.shutdown()
    srv = EngineServer(dead, "127.0.0.1", free_port(), log_level="warning").start_in_thread()
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            expect_error(c.get("/health"), 503, "not running")
            expect_error(c.post("/fill", json={"context_id": "x", "token_ids": [1]}), 503, "not running")
            expect_error(c.post("/generate_stream", json={"context_id": "x"}), 503, "not running")
            expect_error(c.post("/free_context", json={"context_id": "x"}), 503, "not running")
            assert c.get("/ping").status_code == 200  # the last state stays readable
    finally:
        srv.stop()


def test_serves_normally_after_errors(client: httpx.Client) -> None:
    fill(client, "after", PROMPT[:5])
    r = client.post("/generate", json={"context_id": "after", "sampling": sampling(max_tokens=3)})
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
    free(client, "after")
    assert client.get("/health").json()["status"] == "ok"


def test_client_disconnect_mid_stream_aborts(server: EngineServer, client: httpx.Client) -> None:
    fill(client, "gone", [1, 2, 3])
    before = ping(client)
    with httpx.Client(base_url=server.url, timeout=60) as other, \
            other.stream("POST", "/generate_stream",
                         json={"context_id": "gone", "sampling": sampling(max_tokens=400, ignore_eos=True)}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    # the disconnect aborts the generation within a step or so; the server keeps serving
    wait_until(lambda: ping(client).running == 0, 30, "the abandoned generation to stop")
    after = ping(client)
    assert after.aborts == before.aborts + 1
    assert after.steps < before.steps + 200, "the abandoned generation ran on"
    r = client.post("/generate", json={"context_id": "gone", "sampling": sampling(max_tokens=2)})
    assert r.status_code == 200 and 3 + 2 < r.json()["num_tokens"] < 3 + 200 + 2
    free(client, "gone")


def test_abort_route(server: EngineServer, client: httpx.Client) -> None:
    r = client.post("/abort", json={"context_id": "nothing-runs-here"})
    assert r.status_code == 200 and r.json() == {"context_id": "nothing-runs-here", "aborted": False}
    expect_error(client.post("/abort", json={"context_id": ""}), 422)


_ctx_ids = st.one_of(st.sampled_from(["fz0", "fz1", "fz2"]), st.sampled_from(["fz0", "fz1", "fz2", "", "x" * 300]))
_maybe = st.one_of(st.none(), st.just("fz0"), _ctx_ids)
_tokens = st.lists(st.integers(-3, VOCAB + 3), max_size=12)
_valid_tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
_json = st.recursive(st.none() | st.booleans() | st.integers(-10, 10) | st.floats(-2, 2) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                    max_size=3), max_leaves=8)
_valid_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 4), "temperature": st.sampled_from([0.0, 0.7, 1.5]),
    "top_p": st.sampled_from([0.5, 0.9, 1.0]), "top_k": st.integers(0, 300), "seed": st.integers(0, 2**32 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=2), max_size=2), "stop_token_ids": st.lists(st.integers(0, 259)),
    "ignore_eos": st.booleans(), "regex": st.sampled_from(["[ab]{1,3}", "x+", "(", "[0-9]"]),
    "logprobs": st.integers(0, 3), "logit_bias": st.dictionaries(st.integers(0, 259), st.floats(-100, 100), max_size=2),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2), "min_p": st.floats(0, 1),
    "min_tokens": st.integers(0, 2)})
_wild_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-1, 4) | st.just(10**9), "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-1, 300), "seed": st.integers(-1, 2**33),
    "stop": st.lists(st.text(max_size=2), max_size=2), "stop_token_ids": _tokens, "extra": _json,
    "json_schema": _json, "choice": _json, "grammar": st.text(max_size=12), "logit_bias": _json})
_sampling = st.one_of(_valid_sampling, _valid_sampling, _wild_sampling)
_request = st.one_of(
    st.tuples(st.just("/fill"), st.fixed_dictionaries({"context_id": _ctx_ids, "token_ids": _valid_tokens | _tokens},
                                                      optional={"parent_context_id": _maybe})),
    st.tuples(st.sampled_from(["/generate", "/generate_stream"]),
              st.fixed_dictionaries({"context_id": _ctx_ids},
                                    optional={"parent_context_id": _maybe, "sampling": _sampling})),
    st.tuples(st.just("/free_context"), st.fixed_dictionaries({"context_id": _ctx_ids})),
    st.tuples(st.sampled_from(["/fill", "/generate", "/free_context"]), _json),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(_request, min_size=1, max_size=4))
def test_fuzzed_requests_never_500(client: httpx.Client, requests: list[tuple[str, Any]]) -> None:
    """Random sequences of valid and invalid requests: each answers 200 or a 4xx with a clear detail."""
    for ctx in ("fz0", "fz1", "fz2"):
        client.post("/free_context", json={"context_id": ctx})
    fill(client, "fz0", list(PROMPT[:5]))
    for path, body in requests:
        r = client.post(path, json=body)
        event(f"{path} -> {r.status_code}")
        if r.status_code == 200:
            if path == "/generate_stream":
                events = list(sse_events(iter(r.text.splitlines())))
                assert events[-1] == ("message", "[DONE]"), events
            continue
        expect_error(r, r.status_code)
        assert r.status_code in (400, 404, 409, 422), r.text


def test_fuzz_cleanup_and_final_state(client: httpx.Client) -> None:
    for ctx in ("fz0", "fz1", "fz2"):
        client.post("/free_context", json={"context_id": ctx})
    info = ping(client)
    assert info.running == info.waiting == 0 and info.num_contexts == 0 and info.num_cached_tokens == 0
    assert info.free_pages == info.total_pages and client.get("/health").status_code == 200


# ---- serve core link ----------------------------------------------------------------------------------
class FakeServeCore:
    """A serve core that records registrations and heartbeats; unknown engines' heartbeats get 404."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.known: set[str] = set()
        app = FastAPI()

        @app.post("/v1/engine/register")
        async def register(body: dict[str, Any]) -> dict[str, str]:
            reg = EngineRegistration.model_validate(body)
            self.posts.append(("register", body))
            self.known.add(reg.name)
            return {"status": "ok"}

        @app.post("/v1/engine/heartbeat")
        async def heartbeat(body: dict[str, Any]) -> dict[str, str]:
            self.posts.append(("heartbeat", body))
            if body.get("name") not in self.known:
                raise HTTPException(404, "unknown engine")
            return {"status": "ok"}

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.posts)

    def __enter__(self) -> FakeServeCore:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "the fake serve core to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_engine_server_registers_and_heartbeats(engine: LLMEngine) -> None:
    with FakeServeCore() as core:
        port = free_port()
        srv = EngineServer(engine, "127.0.0.1", port, serve_core_url=core.url, name="tiny-engine",
                           heartbeat_interval=0.5, log_level="warning").start_in_thread()
        try:
            wait_until(lambda: core.count("heartbeat") >= 2, 5, "a registration and two heartbeats")
            kinds = [k for k, _ in core.posts]
            assert kinds[0] == "register" and kinds.count("register") == 1
            reg = dict(core.posts[0][1])
            assert RuntimeInfo.model_validate(reg.pop("runtime")).total_shapes >= 0  # its warm-up, from the start
            assert reg == {"name": "tiny-engine", "url": f"http://127.0.0.1:{port}", "model": "tiny-random",
                           "max_context_len": MAX_LEN, "max_batch_size": 16}
            beat = core.posts[1][1]
            assert beat["name"] == "tiny-engine"
            assert RuntimeInfo.model_validate(beat["runtime"]).model == "tiny-random"
            # the advertised URL serves the engine
            assert httpx.get(f"{core.posts[0][1]['url']}/health").json()["status"] == "ok"
            # a serve core that forgot the engine (restart) gets a new registration
            core.known.clear()
            wait_until(lambda: core.count("register") == 2, 5, "a second registration")
        finally:
            srv.stop()
    assert engine.alive  # stopping an HTTP server leaves the engine to its owner


def test_link_retries_until_the_serve_core_is_up(engine: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens here yet
    reg = EngineRegistration(name="late", url="http://127.0.0.1:1", model="tiny-random", max_context_len=MAX_LEN)
    core = FakeServeCore(port)

    async def run() -> None:
        task = asyncio.create_task(serve_core_link(f"http://127.0.0.1:{port}", reg, engine.ping, interval=0.2))
        with caplog.at_level(logging.WARNING, logger="parrot.engine.http_api"):
            await asyncio.sleep(0.3)  # two failed attempts: no warning yet (a blip, e.g. a core stopping first)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            for _ in range(250):  # the third attempt in a row warns, once for the streak
                if any("cannot register" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # more attempts, no more warnings
            assert len([r for r in caplog.records if "cannot register" in r.getMessage()]) == 1
        assert not task.done()  # failures are not fatal
        core.__enter__()
        try:
            for _ in range(200):
                if core.count("heartbeat") >= 2:
                    break
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            core.__exit__()
        assert core.count("register") == 1 and core.count("heartbeat") >= 2

    asyncio.run(run())


# ---- CLI ----------------------------------------------------------------------------------------------
def test_cli_engine_config() -> None:
    args = build_parser().parse_args([
        "engine", "--port", "9200", "--model", "m.gguf", "--kv-memory-mb", "64", "--precompile-token-paddings",
        "64", "16", "--precompile-bs-paddings", "1", "2", "4", "--disable-precompile", "--compilation-cache-dir", "",
        "--serve-core", "http://core:8000", "--name", "e1"])
    cfg = engine_config_from_args(args)
    assert (args.port, args.serve_core, args.name, args.host) == (9200, "http://core:8000", "e1", "127.0.0.1")
    assert cfg.model == "m.gguf" and cfg.kv_memory_mb == 64 and not cfg.precompile
    assert cfg.token_buckets == [16, 64] and cfg.max_num_batched_tokens == 64  # capped at the largest padding
    assert cfg.bs_buckets == [1, 2, 4] and cfg.max_batch_size == 4 and cfg.compilation_cache_dir is None
    cfg = engine_config_from_args(build_parser().parse_args(["engine", "--max-batch-size", "8"]))
    assert cfg.max_batch_size == 8 and cfg.precompile and cfg.max_num_batched_tokens == 512
    assert cfg.explicit == ("max_batch_size",)  # given: an accelerator keeps it even where it is the default
    assert engine_config_from_args(build_parser().parse_args(["engine"])).explicit == ()
    # layers per call: unset keeps the default (1; 4 on accelerators), 0 is the whole model, a given one is kept
    unset = engine_config_from_args(build_parser().parse_args(["engine"]))
    assert unset.layers_per_call == 1 and "layers_per_call" not in unset.explicit
    one = engine_config_from_args(build_parser().parse_args(["engine", "--layers-per-call", "1"]))
    assert one.layers_per_call == 1 and one.explicit == ("layers_per_call",)
    whole = engine_config_from_args(build_parser().parse_args(["engine", "--layers-per-call", "0"]))
    assert whole.layers_per_call is None
    with pytest.raises(ParrotError, match="max-batch-size 128"):
        engine_config_from_args(build_parser().parse_args(["engine", "--max-batch-size", "128"]))
    cfg = engine_config_from_args(build_parser().parse_args(["serve", "--max-model-len", "2048"]))
    assert cfg.kv_buckets == [256, 512, 1024, 2048]
    cfg = engine_config_from_args(build_parser().parse_args(["engine", "--max-model-len", "1536"]))
    assert cfg.kv_buckets == [256, 512, 1024, 1536]
    cfg = engine_config_from_args(build_parser().parse_args(["engine", "--max-model-len", "1000"]))  # any length
    assert cfg.kv_buckets == [256, 512, 1008] and cfg.max_model_len == 1000  # the shapes: whole pages
    assert engine_config_from_args(build_parser().parse_args(["serve"])).throughput_hold_ms is None  # auto
    assert engine_config_from_args(build_parser().parse_args(["serve"])).gc_freeze  # servers freeze, once warm
    assert not engine_config_from_args(build_parser().parse_args(["engine", "--no-gc-freeze"])).gc_freeze
    cfg = engine_config_from_args(build_parser().parse_args(["serve", "--throughput-hold-ms", "1000"]))
    assert cfg.throughput_hold_ms == 1000
    assert engine_config_from_args(build_parser().parse_args(["serve"])).kv_release_idle_s == 10.0
    cfg = engine_config_from_args(build_parser().parse_args(["engine", "--kv-release-idle-s", "2.5"]))
    assert cfg.kv_release_idle_s == 2.5
    assert engine_config_from_args(build_parser().parse_args(["engine"])).kv_release_idle_s == 10.0
    assert engine_config_from_args(build_parser().parse_args(["serve", "--max-num-seqs", "8"])).max_batch_size == 8
    assert "kv_buckets" in engine_config_from_args(build_parser().parse_args(["serve", "--max-model-len", "512"])
                                                   ).explicit  # the engine refuses one past the model's context


@pytest.mark.parametrize("argv", [["--max-batch-size", "-3"], ["--max-num-batched-tokens", "0"],
                                  ["--max-num-batched-tokens", "-1"], ["--kv-memory-mb", "0"], ["--port", "70000"],
                                  ["--port", "0"], ["--engines", "-1"], ["--throughput-hold-ms", "-1"],
                                  ["--max-model-len", "-16"], ["--precompile-bs-paddings", "1", "0"],
                                  ["--speculative-tokens", "-2"], ["--max-sessions", "0"],
                                  ["--kv-release-idle-s", "-1"], ["--kv-release-idle-s", "nan"]])
def test_cli_numbers_out_of_range_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything loads, naming the flag (a negative batch size was taken and every request hung;
    port 70000 listened on 4464)."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and argv[0] in err and "out of range" in err, err


def test_a_max_model_len_of_any_length_is_what_a_sequence_may_hold() -> None:
    """vLLM takes any --max-model-len: a sequence holds that many tokens, its shapes the whole pages they take."""
    eng = LLMEngine(tiny_model(), tiny_engine_config(max_model_len=300, kv_buckets=[256, 304])).start(precompile=False)
    try:
        assert eng.ping().max_context_len == 300 and eng.runner.max_len == 304
        eng.fill_future(FillRequest(context_id="m", token_ids=[5] * 290)).result(120)
        with pytest.raises(InvalidRequestError, match="maximum length 300"):
            eng.generate_future(GenerateRequest(context_id="m", sampling=SamplingParams(
                max_tokens=11, ignore_eos=True))).result(120)
        out = eng.generate_future(GenerateRequest(context_id="m", sampling=SamplingParams(
            max_tokens=10, ignore_eos=True))).result(120)
        assert (len(out.token_ids), out.num_tokens, out.finish_reason) == (10, 300, "length")
        with pytest.raises(InvalidRequestError, match="maximum length 300"):
            eng.fill_future(FillRequest(context_id="m2", token_ids=[5] * 301)).result(120)
    finally:
        eng.shutdown()


def test_a_max_model_len_past_the_models_context_is_refused() -> None:
    cfg = tiny_engine_config(kv_buckets=[256, 1024], explicit=("kv_buckets",))  # the tiny model's context: 512
    with pytest.raises(ModelLoadError, match="max_model_len 1024 is longer than the model's context"):
        LLMEngine(tiny_model(), cfg)
    assert LLMEngine(tiny_model(), tiny_engine_config(kv_buckets=[256, 1024])).runner.max_len == 512  # a default


def test_a_key_sent_over_plain_http_to_another_machine_is_told() -> None:
    from parrot.cli import key_in_clear

    assert key_in_clear("http://core.example:9000", "k") and key_in_clear("http://10.0.0.5:9000", "k")
    assert not key_in_clear("https://core.example:9000", "k")  # encrypted
    assert not any(key_in_clear(url, "k") for url in ("http://127.0.0.1:9000", "http://127.8.0.1:1",
                                                       "http://[::1]:9000", "http://localhost:9000"))
    assert not key_in_clear("http://core.example:9000", None) and not key_in_clear(None, "k")


def test_cli_engine_bad_settings_exit_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--serve-core", "notaurl", "--port", str(free_port())]) == 2  # not retried for ever
    assert "is not an http:// or https:// URL" in capsys.readouterr().err
    assert main(["engine", "--serve-core", "http://127.0.0.1:1", "--serve-core-api-key", "k1,k2"]) == 2
    assert "holds a comma" in capsys.readouterr().err
    assert main(["engine", "--max-num-batched-tokens", "4096"]) == 2
    assert "max_num_batched_tokens" in capsys.readouterr().err
    assert main(["engine", "--model", "/no/such/model.gguf", "--disable-precompile", "--port", str(free_port())]) == 2
    assert "does not exist" in capsys.readouterr().err
    with socket.socket() as taken:  # its port is taken before the model loads: a port in use fails at once
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["engine", "--model", "/no/such/model.gguf", "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.model
def test_cli_engine_serves_the_default_model() -> None:
    """`parrot engine` end to end: the real model in a subprocess, registered with a fake serve core,
    answering a fill and generate, exiting cleanly on SIGINT."""
    try:
        default_model_path()
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")
    port = free_port()
    with FakeServeCore() as core:
        proc = subprocess.Popen(
            [sys.executable, "-m", "parrot.cli", "engine", "--port", str(port), "--disable-precompile",
             "--kv-memory-mb", "64", "--compilation-cache-dir", "", "--serve-core", core.url, "--name", "cli"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        try:
            wait_until(lambda: core.count("register") >= 1 or proc.poll() is not None, 60, "the CLI engine")
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            reg = core.posts[0][1]
            assert reg["name"] == "cli" and reg["model"] == "smollm2" and reg["url"] == f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=reg["url"], timeout=120) as c:
                ids = list(range(100, 120))
                assert c.post("/fill", json={"context_id": "a", "token_ids": ids}).json()["num_tokens"] == 20
                r = c.post("/generate", json={"context_id": "a", "sampling": {"max_tokens": 3, "ignore_eos": True}})
                assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
            wait_until(lambda: core.count("heartbeat") >= 1, 5, "a heartbeat")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        assert proc.returncode == 0, out
