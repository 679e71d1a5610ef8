"""Hostile and unlucky clients against a real server: catastrophic regular expressions, limits (429 with
Retry-After), the API key, disconnects that cancel generations (OpenAI streams, variable streams) while
a variable another reader needs keeps running, bounded session state."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

import parrot as P
from parrot.config import ServeConfig
from parrot.engine.engine import LLMEngine
from parrot.errors import ParrotError
from parrot.frontend.http_api import MAX_BODY_BYTES
from parrot.serve.session import Session
from tests.conftest import tiny_engine_config, tiny_model
from tests.servers import endless_chunked_body, serving_core


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    model = tiny_model()
    # one decode step a call (the tests' default): the disconnect tests need a 480-token generation of the tiny
    # model to outlast a client's 0.3 s timeout, which multi-step decode makes too fast for on some machines
    eng = LLMEngine(model, tiny_engine_config(multi_step=1)).start(precompile=False)
    yield eng
    eng.shutdown()


def slow_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, seconds: float,
               until: Callable[[], bool] | None = None, limit: float = 10.0) -> None:
    """Every engine step takes `seconds` longer, or (with `until`) waits until `until()` holds, for `limit`
    seconds in all: a generation then outlasts a client's timeout on any machine (the tiny model's own steps
    take well under a millisecond once its shapes are compiled)."""
    collect = engine.runner.collect
    deadline = time.monotonic() + limit

    def slow_collect(launched):  # noqa: ANN001, ANN202
        time.sleep(seconds)
        while until is not None and not until() and time.monotonic() < deadline:
            time.sleep(seconds)
        return collect(launched)

    monkeypatch.setattr(engine.runner, "collect", slow_collect)


def serve(engine: LLMEngine, **cfg: object):  # noqa: ANN201
    config = ServeConfig(model="tiny", default_max_tokens=8, **cfg)  # type: ignore[arg-type]
    return serving_core(engine, "tiny", engine.tokenizer, config=config)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def new_session(c: httpx.Client, headers: dict | None = None) -> tuple[str, dict]:
    r = c.post("/v1/session", json={}, headers=headers)
    assert r.status_code == 201, r.text
    body = r.json()
    return body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}


def native(c: httpx.Client, sid: str, auth: dict, pattern: str, text: str) -> str:
    r = c.post("/v1/native_call", headers=auth, json={
        "session_id": sid, "transform": "regex_extract", "params": {"pattern": pattern},
        "inputs": {"text": {"value": text}}, "outputs": ["output"]})
    assert r.status_code == 201, r.text
    return next(p["var_id"] for p in r.json()["param_info"] if p["is_output"])


# ---- no user input can freeze the server ------------------------------------------------------------
def test_catastrophic_regex_does_not_freeze_the_server(engine: LLMEngine) -> None:
    with serve(engine, transform_timeout_s=0.5) as (url, _core), httpx.Client(base_url=url, timeout=60) as c:
        sid, auth = new_session(c)
        cases = [(r"^(a+)+$", "a" * 26 + "!", "does not match"),  # froze Python's re for seconds
                 (r"(a|aa)+$", "a" * 80 + "!", "ran longer than the limit of 0.5 s")]  # backtracks for ages
        for pattern, text, why in cases:
            var = native(c, sid, auth, pattern, text)
            result: dict[str, httpx.Response] = {}

            def read(var: str = var, result: dict[str, httpx.Response] = result) -> None:
                with httpx.Client(base_url=url, timeout=60) as other:
                    result["r"] = other.get(f"/v1/semantic_var/{var}", params={"session_id": sid}, headers=auth)

            reader = threading.Thread(target=read)
            reader.start()
            worst = 0.0
            while reader.is_alive():  # the server answers other clients meanwhile
                t0 = time.perf_counter()
                assert c.get("/health", timeout=5).status_code == 200
                worst = max(worst, time.perf_counter() - t0)
                time.sleep(0.05)
            reader.join()
            assert worst < 0.5, f"/health took {worst:.2f}s while {pattern!r} ran"
            r = result["r"]
            assert r.status_code == 424 and why in r.json()["detail"], r.text
            assert r.json()["code"] == "variable_failed"


# ---- limits and bounded state -------------------------------------------------------------------------
def test_limits_answer_429_with_retry_after(engine: LLMEngine) -> None:
    with serve(engine, max_sessions=2, max_vars_per_session=5, max_pending_calls_per_session=2) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        sid, auth = new_session(c)
        new_session(c)
        r = c.post("/v1/session", json={})
        # Retry-After: when the idlest session expires (TTL 3600 s, and the 30 s sweep), not a second from now
        assert r.status_code == 429 and 3600 <= int(r.headers["Retry-After"]) <= 3630, r.text
        assert r.json()["code"] == "rate_limited" and "too many open sessions" in r.json()["detail"]
        assert "the idlest expires in about" in r.json()["detail"]
        for i in range(5):
            r = c.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": f"v{i}"})
            assert r.status_code == 201
        r = c.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "one too many"})
        assert r.status_code == 429 and r.json()["code"] == "rate_limited" and "Retry-After" in r.headers

        sid2, auth2 = c.delete(f"/v1/session/{sid}", headers=auth) and new_session(c)
        call = {"session_id": sid2, "template": "Go {{a}}", "parameters": [{"name": "a", "is_output": True}]}
        for _ in range(2):  # lazy calls nobody reads stay pending
            assert c.post("/v1/semantic_call", headers=auth2, json=call).status_code == 201
        r = c.post("/v1/semantic_call", headers=auth2, json=call)
        assert r.status_code == 429 and "calls not finished" in r.json()["detail"], r.text


def test_variable_text_past_its_budgets_answers_429_and_leaves_nothing(engine: LLMEngine) -> None:
    """--max-session-variable-memory-mb 1 and --max-variable-memory-mb 2: a client's text past either is a 429
    (a variable's content, one set later, a call's template text), and what was refused holds nothing."""
    kb700, kb400 = "a" * 700_000, "é" * 200_000  # 700,000 and 400,000 UTF-8 bytes

    def held(c: httpx.Client) -> int:
        line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith("parrot:variable_bytes{"))
        return int(float(line.split()[1]))

    with serve(engine, max_variable_memory_mb=2, max_session_variable_memory_mb=1) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        (s1, a1), (s2, a2), (s3, a3) = new_session(c), new_session(c), new_session(c)
        assert c.post("/v1/semantic_var", headers=a1, json={"session_id": s1, "name": "x", "content": kb700}
                      ).status_code == 201
        r = c.post("/v1/semantic_var", headers=a1, json={"session_id": s1, "name": "y", "content": kb400})
        assert r.status_code == 429 and r.json()["code"] == "rate_limited" and "Retry-After" in r.headers
        assert f"session {s1}'s variables hold 700000 bytes of text: 400000 bytes more would pass its limit of " \
               "1.0 MiB" in r.json()["detail"]
        r = c.post("/v1/semantic_call", headers=a1, json={  # the template's text is the session's too
            "session_id": s1, "template": kb400 + "{{out}}", "parameters": [{"name": "out", "is_output": True}]})
        assert r.status_code == 429, r.text
        assert held(c) == 700_000  # nothing of what was refused
        assert c.post("/v1/semantic_var", headers=a2, json={"session_id": s2, "name": "x", "content": kb700}
                      ).status_code == 201
        pending = c.post("/v1/semantic_var", headers=a3, json={"session_id": s3, "name": "p"}).json()["var_id"]
        r = c.post(f"/v1/semantic_var/{pending}", headers=a3, json={"session_id": s3, "content": kb700})
        assert r.status_code == 429 and "the server's variables hold 1.3 MiB" in r.json()["detail"], r.text
        assert c.delete(f"/v1/session/{s1}", headers=a1).status_code == 204
        assert held(c) == 700_000
        r = c.post(f"/v1/semantic_var/{pending}", headers=a3, json={"session_id": s3, "content": kb700})
        assert r.status_code == 200, r.text
        assert c.get(f"/v1/semantic_var/{pending}", headers=a3, params={"session_id": s3}).json()["content"] == kb700
        assert held(c) == 1_400_000


def test_a_global_constant_is_visible_only_to_sessions_that_use_its_text(engine: LLMEngine) -> None:
    from parrot.serve.variables import constant_id

    secret = "You are the assistant of ACME's merger team. "
    with serve(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        (s1, a1), (s2, a2) = new_session(c), new_session(c)
        r = c.post("/v1/semantic_call", headers=a1, json={  # lazy: nobody reads its output
            "session_id": s1, "template": secret + "{{out}}", "parameters": [{"name": "out", "is_output": True}]})
        assert r.status_code == 201, r.text
        guessed = constant_id(secret)
        r = c.get(f"/v1/semantic_var/{guessed}", headers=a1, params={"session_id": s1})
        assert r.status_code == 200 and r.json()["content"] == secret, r.text
        r = c.get(f"/v1/semantic_var/{guessed}", headers=a2, params={"session_id": s2})
        assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
        r = c.post("/v1/semantic_call", headers=a2, json={  # nor can it bind the constant by its id
            "session_id": s2, "template": "{{a}} {{b}}",
            "parameters": [{"name": "a", "var_id": guessed}, {"name": "b", "is_output": True}]})
        assert r.status_code == 404, r.text


def test_sessions_share_constants_and_cached_prefixes_only_within_their_cache_salt(engine: LLMEngine) -> None:
    from parrot.serve.contexts import salt_digest
    from parrot.serve.variables import constant_id

    system = "You are the assistant of the legal team; answer in one word, citing nothing at all. " * 2

    def run(c: httpx.Client, sid: str, auth: dict) -> dict:
        r = c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": system + "Q: {{q}} A: {{a}}",
            "parameters": [{"name": "q", "value": "why?"},
                           {"name": "a", "is_output": True, "sampling_config": {"max_tokens": 2}}]})
        assert r.status_code == 201, r.text
        out = next(p["var_id"] for p in r.json()["param_info"] if p["name"] == "a")
        assert c.get(f"/v1/semantic_var/{out}", headers=auth, params={"session_id": sid}).status_code == 200
        return c.get(f"/v1/session/{sid}", headers=auth).json()["generations"][-1]

    def sees(c: httpx.Client, sid: str, auth: dict, var_id: str) -> bool:
        r = c.get(f"/v1/semantic_var/{var_id}", headers=auth, params={"session_id": sid})
        assert r.status_code in (200, 404), r.text
        return r.status_code == 200

    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/v1/session", json={"cache_salt": ""}).status_code == 422
        sessions = {}
        for name, salt in (("a1", "tenant-a"), ("a2", "tenant-a"), ("b", "tenant-b"), ("plain", None)):
            r = c.post("/v1/session", json={} if salt is None else {"cache_salt": salt})
            assert r.status_code == 201, r.text
            sessions[name] = r.json()["session_id"], {"Authorization": f"Bearer {r.json()['session_token']}"}
        first = run(c, *sessions["a1"])
        assert run(c, *sessions["a2"])["cached_tokens"] >= 128 > first["cached_tokens"]  # the same tenant's
        assert run(c, *sessions["b"])["cached_tokens"] == 0  # another tenant's, after it: nothing shared
        assert run(c, *sessions["plain"])["cached_tokens"] == 0
        lead = system + "Q: "  # the template's leading text, one constant (no other tenant shares a part of it)
        salted, plain = constant_id(lead, salt_digest("tenant-a")), constant_id(lead)
        assert salted != plain
        assert sees(c, *sessions["a1"], salted) and sees(c, *sessions["a2"], salted)
        assert not sees(c, *sessions["b"], salted) and not sees(c, *sessions["plain"], salted)
        assert sees(c, *sessions["plain"], plain) and not sees(c, *sessions["a1"], plain)
        assert set(core.prefix_matchers) == {None, salt_digest("tenant-a"), salt_digest("tenant-b")}
        for name in ("a1", "a2", "b"):  # a salt's matcher goes with its last session (salts are the clients')
            assert c.delete(f"/v1/session/{sessions[name][0]}", headers=sessions[name][1]).status_code == 204
            assert (salt_digest("tenant-a") in core.prefix_matchers) == (name == "a1")
        assert set(core.prefix_matchers) == {None}


def test_session_keeps_bounded_history() -> None:
    s = Session(max_generations=3, max_requests=2)
    for i in range(10):
        s.add_generation({"i": i})
        s.add_request(f"r{i}", {"i": i}, [])
    assert [g["i"] for g in s.generations] == [7, 8, 9]
    for i in range(5):
        s.executor.history.extend([f"chain-{i}"])  # type: ignore[list-item]
        s.executor.native_history.append(f"native-{i}")  # type: ignore[arg-type]
    assert list(s.executor.history) == ["chain-3", "chain-4"]
    assert list(s.executor.native_history) == ["native-3", "native-4"]
    assert list(s.requests) == ["r8", "r9"]
    assert s.pending_calls() == 0


# ---- API key ------------------------------------------------------------------------------------------
def test_browser_pages_get_cors_only_from_allowed_origins(engine: LLMEngine) -> None:
    """--allowed-origins: a listed origin's preflight is answered (without the API key, which a preflight never
    carries) and its calls get the CORS header; other origins, and every origin by default, get none."""
    key, page, other = "sekret-key", "http://localhost:3000", "http://evil.example"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with serve(engine, api_key=key, allowed_origins=(page,)) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.options("/v1/chat/completions", headers={"Origin": page, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.get("/v1/models", headers={"Origin": page, "Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert c.get("/v1/models", headers={"Origin": page}).status_code == 401  # the key is still required
        r = c.options("/v1/chat/completions", headers={"Origin": other, **preflight})
        assert "access-control-allow-origin" not in r.headers
    with serve(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": page}).headers


def test_an_engine_key_keeps_clients_from_registering_engines(engine: LLMEngine) -> None:
    """With --engine-key, the engines' routes take that key and not the API key: a client holding the API key
    cannot register an engine (and be sent other clients' prompts) nor spoof heartbeats; the server's own engine
    is never replaced by a registration under its name; a heartbeat must name the engine's URL."""
    reg = {"name": "extra", "url": "http://127.0.0.1:1", "model": "tiny", "max_context_len": 512}
    with serve(engine, api_key="client-key", engine_key="engine-key") as (url, core), \
            httpx.Client(base_url=url, timeout=60) as c:
        client, eng = {"Authorization": "Bearer client-key"}, {"Authorization": "Bearer engine-key"}
        r = c.post("/v1/engine/register", json=reg, headers=client)
        assert r.status_code == 401 and "engine key" in r.json()["detail"], r.text
        beat = {"name": "local", "runtime": engine.ping().model_dump(mode="json")}
        assert c.post("/v1/engine/heartbeat", json={**beat, "runtime": {**beat["runtime"], "draining": True}},
                      headers=client).status_code == 401
        assert c.get("/v1/models", headers=eng).status_code == 401  # nor is the engine key a client's key
        r = c.post("/v1/engine/register", json={**reg, "name": "local"}, headers=eng)
        assert r.status_code == 409 and "own engine" in r.json()["detail"], r.text
        assert c.post("/v1/engine/heartbeat", json=beat, headers=eng).status_code == 409
        assert core.engines.get("local").url is None and core.engines.is_live("local")
        assert c.post("/v1/engine/register", json=reg, headers=eng).status_code == 200
        assert c.post("/v1/engine/heartbeat", json={**beat, "name": "extra"}, headers=eng).status_code == 409  # no URL
        assert c.get("/v1/models", headers=client).status_code == 200


def test_an_admin_key_keeps_clients_from_reading_other_sessions(engine: LLMEngine) -> None:
    """With --admin-key, the list of sessions and every session's view (prompts and outputs) take that key; the API
    key opens a session's view only with the session's token, as without a key."""
    with serve(engine, api_key="client-key", admin_key="admin-key") as (url, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        client, admin = {"Authorization": "Bearer client-key"}, {"Authorization": "Bearer admin-key"}
        sid, auth = new_session(c, headers=client)
        assert c.get("/v1/sessions", headers=client).status_code == 403
        assert c.get(f"/v1/session/{sid}/graph", headers=client).status_code == 403  # not its token
        token = auth["Authorization"].removeprefix("Bearer ")
        assert c.get(f"/v1/session/{sid}/graph", headers={**client, "X-Session-Token": token}).status_code == 200
        assert [s["session_id"] for s in c.get("/v1/sessions", headers=admin).json()["sessions"]] == [sid]
        assert c.get(f"/v1/session/{sid}/graph", headers=admin).status_code == 200
        assert c.get("/v1/models", headers=admin).status_code == 401  # not a client's key
        assert c.get(f"/v1/session/{sid}", headers=admin).status_code == 401  # nor the session's REST routes


def test_several_api_keys_are_several_clients(engine: LLMEngine) -> None:
    """Keys separated by commas (llama-server's --api-key): each opens the REST and OpenAI routes; a session belongs
    to the key that created it (another key gets 404 for it, its token or not, on the REST routes and the session's
    view); max_sessions_per_key bounds each key's open sessions (429) while another key still opens its own; no key
    but the admin key lists every session."""
    with serve(engine, api_key="key-a, key-b", max_sessions_per_key=2, max_queued_completions_per_key=4) as \
            (url, core), httpx.Client(base_url=url, timeout=60) as c:
        a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
        sid, auth = new_session(c, headers=a)
        token = {"X-Session-Token": auth["Authorization"].removeprefix("Bearer ")}
        assert c.get(f"/v1/session/{sid}", headers={**a, **token}).status_code == 200
        for method, path in [("GET", f"/v1/session/{sid}"), ("GET", f"/v1/session/{sid}/graph"),
                             ("DELETE", f"/v1/session/{sid}")]:
            r = c.request(method, path, headers={**b, **token})
            assert r.status_code == 404 and "does not exist" in r.json()["detail"], (path, r.text)
        r = c.post("/v1/semantic_var", json={"session_id": sid, "name": "x", "content": "y"}, headers={**b, **token})
        assert r.status_code == 404
        new_session(c, headers=a)
        r = c.post("/v1/session", json={}, headers=a)
        assert r.status_code == 429 and "limit 2 a key" in r.json()["detail"] and r.headers["Retry-After"]
        new_session(c, headers=b)  # another key's room is its own
        assert c.get("/v1/models", headers=b).status_code == 200
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, headers=b)
        assert r.status_code == 200, r.text
        assert c.get("/v1/models", headers={"Authorization": "Bearer key-a,key-b"}).status_code == 401
        r = c.get("/v1/sessions", headers=a)
        assert r.status_code == 404 and "admin key" in r.json()["detail"]
        assert c.delete(f"/v1/session/{sid}", headers={**a, **token}).status_code == 204
        new_session(c, headers=a)  # room again
        assert sorted(s.owner for s in core.sessions.values()) == [0, 0, 1]
        metrics = c.get("/metrics").text  # per key, by its place in the list (never its text)
        assert re.search(r'parrot:api_key_sessions\{[^}]*key="0"[^}]*\} 2\.0', metrics), metrics
        assert re.search(r'parrot:api_key_sessions\{[^}]*key="1"[^}]*\} 1\.0', metrics)
        assert re.search(r'parrot:api_key_requests_waiting\{[^}]*key="1"[^}]*\} 0\.0', metrics)
        assert re.search(r'parrot:api_key_requests_running\{[^}]*key="0"[^}]*\} 0\.0', metrics)
        assert "key-a" not in metrics


def test_a_request_whose_later_choice_is_refused_leaves_no_choice_running(engine: LLMEngine,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """n choices are n completions: where one is refused (a limit reached), the request is the refusal, and the
    choices already queued are cancelled rather than run for nobody."""
    from parrot.errors import RateLimitError

    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        queued: list = []
        complete = core.complete

        def second_refused(*args: object, **kwargs: object):  # noqa: ANN202
            if queued:
                raise RateLimitError("a limit", 1)
            queued.append(complete(*args, **kwargs))
            return queued[-1]

        monkeypatch.setattr(core, "complete", second_refused)
        r = c.post("/v1/chat/completions", json={"model": "tiny", "n": 2, "max_tokens": 400,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429, r.text
        first = queued[0]  # the choice queued before the refusal: it ends with the cancellation's error
        wait_until(lambda: any(isinstance(x, BaseException) for x in list(first._queue)), 30, "the cancellation")
        assert "another choice of the request was refused" in str(list(first._queue)[-1])
        assert not core.scheduler.queue
        wait_until(lambda: not core.scheduler.running and engine.ping().running == 0, 30, "the choice to stop")


def test_the_api_keys_come_from_a_file_too(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from parrot import cli

    monkeypatch.delenv("PARROT_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# clients\nkey-1\n\n  key-2  \n", encoding="utf-8")
    args = cli.build_parser().parse_args(["serve", "--api-key", "key-0", "--api-key-file", str(keys),
                                          "--max-sessions-per-key", "3"])
    config = cli.serve_config_from_args(args)
    assert config.api_keys == ("key-0", "key-1", "key-2") and config.max_sessions_per_key == 3
    keys.write_text("# none\n", encoding="utf-8")
    with pytest.raises(ParrotError, match="lists no key"):
        cli.serve_config_from_args(args)
    with pytest.raises(ParrotError, match="api-key-file"):
        cli.serve_config_from_args(cli.build_parser().parse_args(["serve", "--api-key-file", str(tmp_path / "no")]))
    with pytest.raises(ValueError, match="blank key between its commas"):
        ServeConfig(model="tiny", api_key="a,,b")
    with pytest.raises(ValueError, match="max_sessions_per_key"):
        ServeConfig(model="tiny", max_sessions_per_key=0)


@pytest.mark.parametrize("blank", ["", " "])
def test_a_blank_key_is_refused_not_taken_for_none(blank: str) -> None:
    """An empty secret (PARROT_API_KEY="") must not quietly serve without a key."""
    for field in ("api_key", "engine_key", "admin_key"):
        with pytest.raises(ValueError, match="blank"):
            ServeConfig(model="tiny", **{field: blank})


def test_a_body_that_stalls_or_trickles_is_a_408(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's body must come within BODY_TIMEOUT_S of its head, plus a second for each BODY_MIN_RATE bytes
    that came: one that stalls is answered 408 and its connection closed; one that keeps coming fast enough is read
    whole; a long poll (no body, then minutes of waiting) is not cut short."""
    from parrot.frontend import http_api

    monkeypatch.setattr(http_api, "BODY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_api, "BODY_MIN_RATE", 10_000)
    with serve(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/session HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")  # 99 bytes never come
            t0 = time.monotonic()
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive in time" in answer, answer[:200]
            assert b"connection: close" in answer.lower() and 0.4 < time.monotonic() - t0 < 5
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # 30 KB in 0.9 s: in time
            body = b'{"cache_salt": "' + b"s" * 30_000 + b'"}'
            sock.sendall(b"POST /v1/session HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            for i in range(0, len(body), 3000):
                sock.sendall(body[i:i + 3000])
                time.sleep(0.09)
            assert sock.recv(4096).startswith(b"HTTP/1.1 201")
        sid, auth = new_session(c)
        r = c.post("/v1/semantic_var", json={"session_id": sid, "name": "x"}, headers=auth)
        var = r.json()["var_id"]
        r = c.get(f"/v1/semantic_var/{var}", params={"session_id": sid, "timeout": 1.5}, headers=auth)
        assert r.status_code == 408 and r.json()["code"] == "timeout" and "waiting for the variable" in r.text


def test_api_key_guards_every_route_but_health_and_metrics(engine: LLMEngine) -> None:
    key = "sekret-key"
    with serve(engine, api_key=key) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/version").json()["version"]  # as vLLM: the version is no secret
        for method, path in [("POST", "/v1/session"), ("GET", "/v1/models"), ("GET", "/openapi.json"),
                             ("POST", "/v1/engine/register"), ("GET", "/v1/semantic_var/x")]:
            r = c.request(method, path, json={})
            assert r.status_code == 401, (path, r.text)
            r = c.request(method, path, json={}, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, (path, r.text)
            # OpenAI's shape on its routes, the REST one (the engines' registration included) elsewhere
            assert set(r.json()) == ({"error"} if path == "/v1/models" else {"detail", "code"}), (path, r.text)
        # a refusal's chunked body is not read on: the connection closes
        answer, sent = endless_chunked_body(url, "POST", "/v1/chat/completions")
        assert answer.startswith(b"HTTP/1.1 401") and sent < 4 * MAX_BODY_BYTES, (answer[:100], sent)
        admin = {"Authorization": f"Bearer {key}"}
        r = c.post("/v1/session", json={}, headers=admin)
        assert r.status_code == 201
        sid, token = r.json()["session_id"], r.json()["session_token"]
        # the key alone does not open a session: its token goes in X-Session-Token
        assert c.get(f"/v1/session/{sid}", headers=admin).status_code == 401
        assert c.get(f"/v1/session/{sid}", headers={**admin, "X-Session-Token": "nope"}).status_code == 403
        assert c.get(f"/v1/session/{sid}", headers={**admin, "X-Session-Token": token}).status_code == 200
        # the real openai client with api_key=
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in oai.models.list().data] == ["tiny"]
        out = oai.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        # the SDK sends the key and the session token
        @P.semantic_function
        def echo(x: P.Input, y: P.Output(max_tokens=3, ignore_eos=True)):  # noqa: ANN202
            """Say {{x}} {{y}}"""

        with P.VirtualMachine(url, api_key=key):
            assert isinstance(echo("hi").get(), str)


# ---- cancellation -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 400}),  # relayed from the chat route's stream
])
def test_openai_stream_disconnect_aborts_the_generation(engine: LLMEngine, path: str, body: dict) -> None:
    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        before = engine.ping()
        body = {"model": "tiny", **body, "ignore_eos": True, "stream": True}
        with c.stream("POST", path, json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got >= 5:
                    break
        wait_until(lambda: not core.scheduler.running and engine.ping().running == 0, 10,
                   "the abandoned generation to stop")
        after = engine.ping()
        assert after.steps - before.steps < 300, "the abandoned generation ran on"
        assert core.aborts == 1 and after.aborts == before.aborts + 1
        metrics = c.get("/metrics").text
        assert 'parrot:aborted_requests_total{model_name="tiny"} 1.0' in metrics
        # counted as vLLM counts a client that left, not as a failure of the server's
        assert ('parrot:request_success_total{endpoint="chat",finished_reason="abort",model_name="tiny"} 1.0'
                in metrics)
        assert "parrot:request_failure_total{" not in metrics
        # the generated context is freed; the prompt stays cached (automatic prefix caching)
        wait_until(lambda: engine.ping().num_contexts <= before.num_contexts + core.contexts.num_globals(), 10,
                   "its contexts to be freed")
        assert all(c.session_id is None for c in core.contexts.contexts())


def test_openai_stream_left_before_its_first_token_is_cancelled(engine: LLMEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed request whose client gives up while it waits for its first token (here: queued behind a
    full batch) is cancelled, not run later for nobody."""
    slow_steps(engine, monkeypatch, 0.005)  # the batch's 400 steps then outlast the waiting client's 1 s
    with serve(engine) as (url, core):
        before = engine.ping()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        full = engine.cfg.max_batch_size
        started = threading.Event()
        stop = threading.Event()

        def occupy() -> None:  # one sequence of the full batch, streaming until told to leave
            with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started.set()
                        if stop.is_set():
                            return

        threads = [threading.Thread(target=occupy) for _ in range(full)]
        for t in threads:
            t.start()
        wait_until(lambda: engine.ping().running >= full, 30, "the batch to fill")
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url, timeout=1.0) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as r:
            r.read()  # no first byte within the second: the client leaves
        wait_until(lambda: core.aborts == 1, 10, "the waiting request to be cancelled")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        wait_until(lambda: not core.scheduler.running and engine.ping().running == 0, 20, "every generation to stop")
        after = engine.ping()
        assert core.aborts == full + 1 and after.aborts - before.aborts == full  # the waiting one never reached it
        assert after.steps - before.steps < 300, "the abandoned request ran"


def test_openai_request_disconnect_aborts_the_generation(engine: LLMEngine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-streamed completion whose client gives up is cancelled too."""
    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        # the engine's steps wait (10 s at most) until the core has cancelled the request: its 480 tokens cannot
        # all be generated before the server sees the client leave, however fast the steps are
        slow_steps(engine, monkeypatch, 0.002, until=lambda: core.aborts >= 1)
        before = engine.ping()
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 480, "ignore_eos": True}
        host, port = url.removeprefix("http://").rsplit(":", 1)
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # leaves once it has started
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            wait_until(lambda: bool(core.scheduler.running), 30, "the generation to start")
        wait_until(lambda: not core.scheduler.running and engine.ping().running == 0, 10,
                   "the abandoned generation to stop")
        after = engine.ping()
        # the engine aborted it before its 480 tokens (the tiny model decodes a step in a few milliseconds)
        assert core.aborts == 1 and after.aborts - before.aborts == 1 and after.steps - before.steps < 480
        # a client that stays gets its answer
        r = c.post("/v1/completions", json={**body, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _call(c: httpx.Client, sid: str, auth: dict, template: str, params: list[dict]) -> dict[str, str]:
    r = c.post("/v1/semantic_call", headers=auth, json={"session_id": sid, "template": template, "parameters": params})
    assert r.status_code == 201, r.text
    return {p["name"]: p["var_id"] for p in r.json()["param_info"]}


def _stream_a_little(url: str, sid: str, auth: dict, var: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c, \
            c.stream("GET", f"/v1/semantic_var/{var}/stream", params={"session_id": sid}, headers=auth) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break


def test_variable_stream_disconnect_cancels_unless_another_reader_needs_it(engine: LLMEngine) -> None:
    long = {"max_tokens": 300, "ignore_eos": True}
    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=120) as c:
        sid, auth = new_session(c)
        # alone: the disconnect aborts the generation and fails the variable as aborted
        ids = _call(c, sid, auth, "Write: {{a}}", [{"name": "a", "is_output": True, "sampling_config": long}])
        _stream_a_little(url, sid, auth, ids["a"])
        wait_until(lambda: not core.scheduler.running and engine.ping().running == 0, 10, "the generation to stop")
        r = c.get(f"/v1/semantic_var/{ids['a']}", params={"session_id": sid, "timeout": 5}, headers=auth)
        assert r.status_code == 424 and "aborted: its reader disconnected" in r.json()["detail"], r.text
        assert core.aborts == 1

        # in a DAG: b needs a, and a client waits for b; a's streaming reader leaving does not cancel a
        ids = _call(c, sid, auth, "Write: {{a}}", [{"name": "a", "is_output": True,
                                                    "sampling_config": {"max_tokens": 60, "ignore_eos": True}}])
        b = _call(c, sid, auth, "Then {{a}} and {{b}}", [{"name": "a", "var_id": ids["a"]},
                                                          {"name": "b", "is_output": True,
                                                           "sampling_config": {"max_tokens": 4}}])["b"]
        got: dict[str, httpx.Response] = {}
        waiter = threading.Thread(target=lambda: got.setdefault("b", httpx.get(
            f"{url}/v1/semantic_var/{b}", params={"session_id": sid, "timeout": 60}, headers=auth, timeout=90)))
        waiter.start()
        wait_until(lambda: core.scheduler.running, 10, "a to start")
        _stream_a_little(url, sid, auth, ids["a"])
        waiter.join(90)
        assert got["b"].status_code == 200, got["b"].text
        assert core.aborts == 1


@pytest.mark.parametrize("how", ["stream", "long-poll"])
def test_a_reader_that_leaves_cancels_the_calls_upstream(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch,
                                                         how: str) -> None:
    """a -> b, and a client reads b: it leaves (a stream closed, a long-poll given up) while a generates. a is
    aborted, not run for nobody (a reader that comes back for b learns it failed with it). A server-side
    `timeout` (408) is a reader still there: nothing is cancelled."""
    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        slow_steps(engine, monkeypatch, 0.002, until=lambda: core.aborts >= 1)
        sid, auth = new_session(c)
        long = {"max_tokens": 300, "ignore_eos": True}
        a = _call(c, sid, auth, "Write: {{a}}", [{"name": "a", "is_output": True, "sampling_config": long}])["a"]
        b = _call(c, sid, auth, "Then {{a}} and {{b}}", [{"name": "a", "var_id": a},
                                                          {"name": "b", "is_output": True,
                                                           "sampling_config": {"max_tokens": 4}}])["b"]
        r = c.get(f"/v1/semantic_var/{b}", params={"session_id": sid, "timeout": 0.2}, headers=auth)
        assert r.status_code == 408
        wait_until(lambda: engine.ping().running == 1, 10, "a to start")
        assert core.aborts == 0  # the 408's reader may poll again: a runs on
        if how == "stream":
            with httpx.stream("GET", f"{url}/v1/semantic_var/{b}/stream", params={"session_id": sid}, headers=auth,
                              timeout=60) as r:
                assert r.status_code == 200  # and the client leaves
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.get(f"{url}/v1/semantic_var/{b}", params={"session_id": sid}, headers=auth, timeout=0.3)
        wait_until(lambda: core.aborts == 1 and engine.ping().running == 0, 10, "a to be aborted")
        r = c.get(f"/v1/semantic_var/{a}", params={"session_id": sid, "timeout": 5}, headers=auth)
        assert r.status_code == 424 and "aborted: nothing needs it now" in r.json()["detail"], r.text
        r = c.get(f"/v1/semantic_var/{b}", params={"session_id": sid, "timeout": 5}, headers=auth)
        assert r.status_code == 424 and "aborted" in r.json()["detail"], r.text  # its input failed: explicit


def test_what_an_engine_held_when_taken_for_dead_is_freed_once_it_is_back(engine: LLMEngine) -> None:
    """A death that was a slip (a late ping): the core forgot the engine's contexts, but the engine still holds
    them; once it answers again they are freed there, not kept for good."""
    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        before = engine.ping().num_contexts
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello " * 20, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert engine.ping().num_contexts > before  # its prompt's prefix stays cached
        assert core.loop is not None
        core.loop.call_soon_threadsafe(core.engines.mark_dead, "local", "no successful ping for 5.2s")
        wait_until(lambda: not core.engines.is_live("local"), 10, "the engine to be taken for dead")
        wait_until(lambda: core.engines.is_live("local"), 10, "the engine to answer pings again")
        wait_until(lambda: engine.ping().num_contexts == before, 10, "what it held to be freed")
        assert not core._orphans and core.contexts.contexts() == []
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello " * 20, "max_tokens": 3})
        assert r.status_code == 200, r.text  # and it serves on


def test_deleting_a_session_aborts_its_generations(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """DELETE /v1/session/{id} while its call generates: the generation is aborted on the engine (its KV freed),
    not run to its end for nobody, and what waits on it is answered."""
    with serve(engine) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        slow_steps(engine, monkeypatch, 0.002, until=lambda: core.aborts >= 1)
        before = engine.ping()
        sid, auth = new_session(c)
        long = {"max_tokens": 300, "ignore_eos": True}
        a = _call(c, sid, auth, "Write: {{a}}", [{"name": "a", "is_output": True, "sampling_config": long}])["a"]
        got: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: got.append(httpx.get(
            f"{url}/v1/semantic_var/{a}", params={"session_id": sid, "timeout": 60}, headers=auth, timeout=90)))
        waiter.start()
        wait_until(lambda: engine.ping().running == 1, 10, "the generation to start")
        assert c.delete(f"/v1/session/{sid}", headers=auth).status_code == 204
        wait_until(lambda: not core.scheduler.running and engine.ping().running == 0, 10, "the generation to stop")
        waiter.join(30)
        assert got and got[0].status_code in (404, 424), got
        after = engine.ping()
        assert core.aborts == 1 and after.aborts == before.aborts + 1 and after.steps - before.steps < 300
        wait_until(lambda: engine.ping().num_contexts <= before.num_contexts + core.contexts.num_globals(), 10,
                   "its contexts to be freed")


def test_a_long_poll_whose_client_left_lets_its_session_expire(engine: LLMEngine) -> None:
    """A long-poll with no timeout on a variable set "later", whose client dies: the server stops reading for it,
    so its session is idle again and expires (it was held open for good, and so was the server's shutdown)."""
    with serve(engine, session_ttl_s=1.0) as (url, core), httpx.Client(base_url=url, timeout=60) as c:
        sid, auth = new_session(c)
        var = c.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "later"}).json()["var_id"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(f"{url}/v1/semantic_var/{var}", params={"session_id": sid}, headers=auth, timeout=0.5)
        wait_until(lambda: sid not in core.sessions, 10, "the session to expire once its reader left")


def test_a_graceful_shutdown_answers_long_polls_nothing_can_end(engine: LLMEngine) -> None:
    """SIGTERM while a connected client long-polls a variable only a request could set: the drain fails that
    variable (no request can come now), the client gets its 424, and the server stops."""
    from parrot import cli
    from parrot.frontend.http_api import create_app
    from tests.servers import free_port, make_core

    core = make_core(engine, "tiny", engine.tokenizer, config=ServeConfig(model="tiny"))
    port = free_port()
    server = cli.http_server(create_app(core), "127.0.0.1", port, on_shutdown=core.drain)
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "the server to start")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            sid, auth = new_session(c)
            var = c.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "x"}).json()["var_id"]
            answers: list[httpx.Response] = []
            poll = threading.Thread(target=lambda: answers.append(
                c.get(f"/v1/semantic_var/{var}", params={"session_id": sid}, headers=auth)))
            poll.start()
            wait_until(lambda: core.sessions[sid].readers == 1, 10, "the long-poll to wait")
            server.should_exit = True  # what SIGTERM does
            poll.join(20)
            assert answers and answers[0].status_code == 424 and "shutting down" in answers[0].json()["detail"]
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"
    finally:
        server.should_exit = True
        thread.join(30)
