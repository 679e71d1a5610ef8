"""The Parrot REST API end to end: a real uvicorn server on loopback, the serve core, an embedded
engine running a tiny random model."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parrot.engine.engine import LLMEngine
from tests.conftest import tiny_engine_config, tiny_model
from tests.servers import serving_core

SYSTEM = "You are a careful assistant that summarizes text in one line. " * 2


@pytest.fixture(scope="module")
def server():
    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    with serving_core(engine, "tiny", model.tokenizer, default_max_tokens=8) as (url, core):
        yield url, core, engine
    engine.shutdown()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


def new_session(client: httpx.Client) -> tuple[str, dict]:
    r = client.post("/v1/session", json={})
    assert r.status_code == 201, r.text
    body = r.json()
    return body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}


def call(client: httpx.Client, sid: str, auth: dict, template: str, params: list[dict], **kw) -> dict:
    r = client.post("/v1/semantic_call", json={"session_id": sid, "template": template, "parameters": params, **kw},
                    headers=auth)
    assert r.status_code == 201, r.text
    return {p["name"]: p["var_id"] for p in r.json()["param_info"]}


def get(client: httpx.Client, sid: str, auth: dict, var_id: str, **params) -> httpx.Response:
    """GET a variable; the client waits longer than the server-side `timeout` it asks for."""
    wait = float(params.get("timeout", 0)) + 60
    return client.get(f"/v1/semantic_var/{var_id}", params={"session_id": sid, **params}, headers=auth,
                      timeout=max(wait, 60))


def test_call_then_get_generates(client: httpx.Client) -> None:
    sid, auth = new_session(client)
    ids = call(client, sid, auth, SYSTEM + "Text: {{doc}}\nSummary: {{summary}}",
               [{"name": "doc", "is_output": False, "value": "the cat sat on the mat"},
                {"name": "summary", "is_output": True, "sampling_config": {"max_tokens": 6, "ignore_eos": True}}])
    r = get(client, sid, auth, ids["summary"], criteria="latency", timeout=60)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["content"], str)
    info = client.get(f"/v1/session/{sid}", headers=auth).json()
    assert any(v["id"] == ids["summary"] and v["state"] == "ready" for v in info["variables"])


def test_chain_and_map_reduce_share_the_system_prompt(client: httpx.Client, server) -> None:
    _, core, engine = server
    sid, auth = new_session(client)
    sampling = {"max_tokens": 5, "ignore_eos": True}
    parts = [f"part {i}: " + "abc " * (i + 1) for i in range(4)]
    maps = [call(client, sid, auth, SYSTEM + "Chunk: {{chunk}}\nSummary: {{s}}",
                 [{"name": "chunk", "is_output": False, "value": p},
                  {"name": "s", "is_output": True, "sampling_config": sampling}]) for p in parts]
    reduce_params = [{"name": f"s{i}", "is_output": False, "var_id": m["s"]} for i, m in enumerate(maps)]
    reduce_params.append({"name": "final", "is_output": True, "sampling_config": sampling})
    template = SYSTEM + "Summaries: " + " ".join(f"{{{{s{i}}}}}" for i in range(4)) + "\nOverall: {{final}}"
    red = call(client, sid, auth, template, reduce_params)
    # nothing runs until the result is read (lazy); reading it runs the whole DAG
    r = get(client, sid, auth, red["final"], criteria="throughput", timeout=120)
    assert r.status_code == 200, r.text
    for m in maps:
        assert get(client, sid, auth, m["s"], timeout=5).status_code == 200
    assert core.contexts.hit_rate > 0  # the system prompt context was forked, not refilled


def test_native_call_in_the_graph(client: httpx.Client) -> None:
    sid, auth = new_session(client)
    ids = call(client, sid, auth, SYSTEM + "Say: {{x}}", [{"name": "x", "is_output": True,
                                                             "sampling_config": {"max_tokens": 4, "ignore_eos": True}}])
    r = client.post("/v1/native_call", headers=auth, json={
        "session_id": sid, "transform": "upper", "inputs": {"text": {"var_id": ids["x"]}}, "outputs": ["output"]})
    assert r.status_code == 201, r.text
    out = {p["name"]: p["var_id"] for p in r.json()["param_info"]}["output"]
    r = get(client, sid, auth, out, timeout=60)
    assert r.status_code == 200, r.text
    x = get(client, sid, auth, ids["x"]).json()["content"]
    assert r.json()["content"] == x.upper()


def test_stream_matches_content(client: httpx.Client) -> None:
    sid, auth = new_session(client)
    ids = call(client, sid, auth, SYSTEM + "Go: {{y}}", [{"name": "y", "is_output": True,
                                                          "sampling_config": {"max_tokens": 8, "ignore_eos": True}}])
    text = ""
    with client.stream("GET", f"/v1/semantic_var/{ids['y']}/stream", params={"session_id": sid},
                       headers=auth) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["text"]
    assert text == get(client, sid, auth, ids["y"]).json()["content"]


def test_auth_and_bad_input(client: httpx.Client) -> None:
    sid, auth = new_session(client)
    other, other_auth = new_session(client)
    assert client.get(f"/v1/session/{sid}").status_code == 401
    assert client.get(f"/v1/session/{sid}", headers=other_auth).status_code == 403
    assert client.get("/v1/session/nope", headers=auth).status_code == 404
    r = client.post("/v1/semantic_call", headers=auth, json={"session_id": sid, "template": "Hi {{x",
                                                             "parameters": []})
    assert r.status_code == 400 and "detail" in r.json()
    r = client.post("/v1/semantic_call", headers=auth, json={
        "session_id": sid, "template": "Hi {{a}} and {{b}}", "parameters": [{"name": "a", "is_output": True}]})
    assert r.status_code == 400
    v = client.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "v"}).json()["var_id"]
    set_url = f"/v1/semantic_var/{v}"
    assert client.post(set_url, headers=auth, json={"session_id": sid, "content": "x"}).status_code == 200
    assert client.post(set_url, headers=auth, json={"session_id": sid, "content": "y"}).status_code == 409
    assert get(client, other, other_auth, v).status_code == 404  # another session's variable
    pending = client.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "p"}).json()["var_id"]
    assert get(client, sid, auth, pending, timeout=0.2).status_code == 408
    # a cycle: out feeds in, in feeds out
    a = client.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "a"}).json()["var_id"]
    b = client.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "b"}).json()["var_id"]
    call(client, sid, auth, "X {{a}} then {{b}}", [{"name": "a", "is_output": False, "var_id": a},
                                                   {"name": "b", "is_output": True, "var_id": b}])
    r = client.post("/v1/semantic_call", headers=auth, json={
        "session_id": sid, "template": "Y {{b}} then {{a}}",
        "parameters": [{"name": "b", "is_output": False, "var_id": b}, {"name": "a", "is_output": True, "var_id": a}]})
    assert r.status_code == 400 and "cycle" in r.json()["detail"]
    assert client.post("/v1/semantic_call", headers=auth, content=b"{not json").status_code == 422
    assert client.delete(f"/v1/session/{sid}", headers=auth).status_code == 204
    assert client.get(f"/v1/session/{sid}", headers=auth).status_code == 404


def test_failed_generation_fails_the_variable(client: httpx.Client) -> None:
    sid, auth = new_session(client)
    r = client.post("/v1/semantic_call", headers=auth, json={"session_id": sid, "template": "x {{y}}", "parameters": [
        {"name": "y", "is_output": True, "sampling_config": {"max_tokens": 5000}}]})  # no prompt fits beside it
    assert r.status_code == 400 and "max_tokens 5000" in r.json()["detail"]
    ids = call(client, sid, auth, "x" * 600 + " {{y}}",  # the prompt is known once it runs: beyond the context
               [{"name": "y", "is_output": True, "sampling_config": {"max_tokens": 8}}])
    r = get(client, sid, auth, ids["y"], timeout=60)
    assert r.status_code == 424 and "maximum length" in r.json()["detail"]
    # a call reading the failed variable fails too, instead of hanging
    dep = call(client, sid, auth, "Then {{y}} and {{z}}", [{"name": "y", "is_output": False, "var_id": ids["y"]},
                                                          {"name": "z", "is_output": True}])
    assert get(client, sid, auth, dep["z"], timeout=30).status_code == 424


def test_plain_completions_share_the_cached_prefix(server) -> None:
    import asyncio

    from parrot.protocol import SamplingParams
    from parrot.serve.core import CompletionResult

    _, core, _ = server
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)

    async def one(question: str) -> CompletionResult:
        out = [item async for item in core.run_completion([SYSTEM, question], sampling)]
        assert "".join(x for x in out if isinstance(x, str)) == out[-1].text
        return out[-1]

    first = asyncio.run_coroutine_threadsafe(one("first question"), core.loop).result(60)
    second = asyncio.run_coroutine_threadsafe(one("second question"), core.loop).result(60)
    assert first.cached_tokens == 0 or first.cached_tokens < first.prompt_tokens
    assert second.cached_tokens > 0  # the system prompt's context was kept and forked



JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                max_size=5), max_leaves=12)
ROUTES = ["/v1/semantic_call", "/v1/native_call", "/v1/semantic_var", "/v1/semantic_var/x"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=st.one_of(JSON, st.fixed_dictionaries(
    {"session_id": st.text(max_size=10), "template": st.text(max_size=40),
     "parameters": st.lists(st.fixed_dictionaries({"name": st.text(max_size=5), "is_output": st.booleans()},
                                                  optional={"value": st.text(max_size=5)}), max_size=3)})))
def test_fuzzed_bodies_never_get_a_500(client: httpx.Client, route: str, body) -> None:  # noqa: ANN001
    sid, auth = new_session(client)
    if isinstance(body, dict) and "session_id" in body:
        body = {**body, "session_id": sid}
    r = client.post(route, json=body, headers=auth)
    assert r.status_code < 500, r.text
    assert "detail" in r.json()


def test_deleting_a_session_mid_generation_frees_its_contexts(client: httpx.Client, server) -> None:
    _, core, _ = server
    sid, auth = new_session(client)
    long = {"max_tokens": 200, "ignore_eos": True}
    ids = call(client, sid, auth, SYSTEM + "Long: {{y}}", [{"name": "y", "is_output": True, "sampling_config": long}],
               output_criteria="throughput")
    deadline = time.time() + 30
    while not any(t.session_id == sid for t in core.scheduler.running.values()) and time.time() < deadline:
        time.sleep(0.02)
    assert client.delete(f"/v1/session/{sid}", headers=auth).status_code == 204
    deadline = time.time() + 30
    while any(c.session_id == sid for c in core.contexts.contexts()) or core.scheduler.running:
        assert time.time() < deadline, "the deleted session's contexts were not released"
        time.sleep(0.05)
    assert ids["y"] not in {v.id for v in core.vars.session_variables(sid)}


def test_health_is_a_503_once_the_servers_own_engine_has_stopped() -> None:
    """An engine inside the server whose loop stopped never serves again: /health says so with a 503 (a
    liveness probe restarts the server), where it used to answer 200 "ok" with no engine."""
    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    try:
        with serving_core(engine, "tiny", tiny_model().tokenizer) as (url, _):
            ok = httpx.get(f"{url}/health", timeout=30)
            assert ok.status_code == 200 and ok.json()["engines"] == ["local"]
            engine.shutdown()
            deadline = time.monotonic() + 30
            while (r := httpx.get(f"{url}/health", timeout=30)).status_code == 200:
                assert time.monotonic() < deadline, r.json()
                time.sleep(0.2)
            assert r.status_code == 503
            assert r.json()["status"] == "engine_dead" and r.json()["engines"] == [] and "local" in r.json()["dead"]
    finally:
        engine.shutdown()


def test_work_waiting_when_the_servers_own_engine_stops_fails_instead_of_waiting_forever() -> None:
    """The engine inside the server stops mid-generation: the request it held, re-dispatched, and a semantic call
    sent afterwards fail with an explicit error; they used to wait for an engine that could never come."""
    import threading

    from parrot.frontend.sdk import VariableFailedError, VirtualMachine

    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    try:
        with serving_core(engine, "tiny", tiny_model().tokenizer) as (url, _):
            got: dict = {}

            def long_generation() -> None:
                body = {"model": "tiny", "prompt": "a b c", "max_tokens": 400, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                    got["status"] = r.status_code
                    got["events"] = [line for line in r.iter_lines() if line.startswith("data:")]

            t = threading.Thread(target=long_generation)
            t.start()
            deadline = time.monotonic() + 30
            while engine.ping().running == 0:  # the generation runs on the engine
                assert time.monotonic() < deadline
                time.sleep(0.05)
            engine.shutdown()
            t.join(60)
            assert not t.is_alive()
            # a 503 before the stream's first chunk, or a stream that ends with an error event
            assert got["status"] == 503 or any("error" in e for e in got["events"]), got
            with VirtualMachine(url, timeout=60) as vm:
                call = vm.semantic_call("Say: {{a}}", [{"name": "a", "is_output": True,
                                                         "sampling_config": {"max_tokens": 4}}])
                with pytest.raises(VariableFailedError, match="engine stopped"):
                    call["a"].get(timeout=30)
    finally:
        engine.shutdown()
