"""`/metrics`: Prometheus text that parses, with the vLLM-style names and values that follow the requests
made through the OpenAI-compatible API (real uvicorn server, real openai client, tiny random model)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from parrot.engine.engine import LLMEngine
from parrot.frontend.metrics import ParrotMetrics
from parrot.serve.core import ParrotServeCore
from tests.conftest import tiny_engine_config, tiny_model
from tests.servers import serving_core

HISTOGRAMS = ["parrot:time_to_first_token_seconds", "parrot:time_per_output_token_seconds",
              "parrot:inter_token_latency_seconds", "parrot:e2e_request_latency_seconds",
              "parrot:request_queue_time_seconds"]
GAUGES = ["parrot:num_requests_running", "parrot:num_requests_waiting", "parrot:kv_cache_usage_perc",
          "parrot:kv_cache_written_pages", "parrot:prefix_cache_hit_rate", "parrot:engines_live"]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    with serving_core(engine, "tiny", tiny_model().tokenizer) as (url, core):
        yield url, core
    engine.shutdown()


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{family name: {(sample name, sorted labels but model_name): value}}; every sample names the model."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(r.text):
        assert all(s.labels.pop("model_name") == "tiny" for s in fam.samples), fam.name  # vLLM's label, everywhere
        out[fam.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}
    return out


def value(families: dict, family: str, sample: str | None = None, **labels: str) -> float:
    return families[family][(sample or family, tuple(sorted(labels.items())))]


def test_metrics_follow_requests(server) -> None:
    url, core = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        system = "You are a metrics test assistant; answer briefly and precisely. " * 2
        usages = []
        for q in ("one", "two", "three"):
            r = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True},
                                               messages=[{"role": "system", "content": system},
                                                         {"role": "user", "content": q}])
            usages.append(r.usage)
        stream = client.completions.create(model="tiny", prompt="Count: 1 2 3", max_tokens=5, temperature=1.0,
                                           seed=1, n=2, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        usages.append([c.usage for c in stream if c.usage is not None][-1])

    deadline = time.time() + 10  # KV usage comes from the engine's ping (every second): one after the work
    fams = scrape(url)
    while (not fams["parrot:kv_cache_written_pages"]
           or value(fams, "parrot:kv_cache_written_pages", engine="local") == 0) and time.time() < deadline:
        time.sleep(0.2)
        fams = scrape(url)
    for name in HISTOGRAMS + GAUGES:
        assert name in fams, name
    choices = 3 + 2
    for name in ("parrot:time_to_first_token_seconds", "parrot:e2e_request_latency_seconds",
                 "parrot:time_per_output_token_seconds"):
        assert value(fams, name, f"{name}_count") == choices, name
        assert value(fams, name, f"{name}_sum") > 0, name
        assert value(fams, name, f"{name}_bucket", le="+Inf") == choices, name
    assert value(fams, "parrot:request_queue_time_seconds", "parrot:request_queue_time_seconds_count") >= choices
    assert value(fams, "parrot:inter_token_latency_seconds", "parrot:inter_token_latency_seconds_count") > 0
    assert value(fams, "parrot:request_success", "parrot:request_success_total",
                 endpoint="chat", finished_reason="length") == 3
    assert value(fams, "parrot:request_success", "parrot:request_success_total",
                 endpoint="completions", finished_reason="length") == 2
    assert value(fams, "parrot:generation_tokens", "parrot:generation_tokens_total") == sum(
        u.completion_tokens for u in usages)
    # the n=2 choices both read the prompt, usage counts it once
    assert value(fams, "parrot:prompt_tokens", "parrot:prompt_tokens_total") == sum(
        u.prompt_tokens for u in usages) + usages[-1].prompt_tokens
    assert value(fams, "parrot:num_requests_running") == 0
    assert value(fams, "parrot:num_requests_waiting") == 0
    assert value(fams, "parrot:engines_live") == 1
    assert 0.0 <= value(fams, "parrot:kv_cache_usage_perc", engine="local") <= 1.0
    written = value(fams, "parrot:kv_cache_written_pages", engine="local")  # the prompts' pages at least
    assert 0 < written <= core.engines.runtime("local").total_pages
    assert value(fams, "parrot:kv_cache_released_pages", "parrot:kv_cache_released_pages_total",
                 engine="local") == core.engines.runtime("local").released_pages >= 0
    assert value(fams, "parrot:engine_mixed_steps", "parrot:engine_mixed_steps_total", engine="local") >= 0
    # plain calls are all latency-critical: the throughput hold holds nothing
    assert value(fams, "parrot:engine_held_steps", "parrot:engine_held_steps_total", engine="local") == 0
    assert value(fams, "parrot:engine_priority_preemptions", "parrot:engine_priority_preemptions_total",
                 engine="local") == 0  # plain calls are all of one priority
    assert value(fams, "parrot:engine_fair_preemptions", "parrot:engine_fair_preemptions_total",
                 engine="local") == 0  # and of no API key
    assert value(fams, "parrot:engine_preemptions", "parrot:engine_preemptions_total", engine="local") >= 0
    # speculative decoding is off by default: nothing drafted
    assert value(fams, "parrot:engine_spec_draft_tokens", "parrot:engine_spec_draft_tokens_total", engine="local") == 0
    assert value(fams, "parrot:engine_spec_accepted_tokens", "parrot:engine_spec_accepted_tokens_total",
                 engine="local") == 0
    hit_rate = value(fams, "parrot:prefix_cache_hit_rate")
    assert 0.0 < hit_rate <= 1.0 and hit_rate == pytest.approx(core.contexts.hit_rate)
    assert value(fams, "parrot:prefix_cache_hits", "parrot:prefix_cache_hits_total") >= sum(
        u.prompt_tokens_details.cached_tokens for u in usages[:3]) > 0


def test_registry_per_instance_and_timer() -> None:
    core = ParrotServeCore(model="tiny")
    a, b = ParrotMetrics(core), ParrotMetrics(core)  # two registries: no duplicate-name clash
    timer = a.start_request("chat", start=10.0)
    timer.delta(now=10.5)  # TTFT 0.5
    timer.delta(now=10.7)
    timer.delta(now=10.9)
    timer.finish(prompt_tokens=7, completion_tokens=3, finish_reason="stop", now=11.0)
    timer.finish(prompt_tokens=7, completion_tokens=3, finish_reason="stop", now=12.0)  # counted once
    a.start_request("completions").fail()
    left = a.start_request("completions")
    left.abort()  # the client went away: not a failure
    left.fail()  # counted once
    fams = {f.name: f for f in text_string_to_metric_families(a.render().decode())}

    def sample(family: str, name: str, **labels: str) -> float:
        return next(s.value for s in fams[family].samples if s.name == name and s.labels == {"model_name": "tiny",
                                                                                              **labels})

    assert sample("parrot:time_to_first_token_seconds", "parrot:time_to_first_token_seconds_sum") == 0.5
    assert sample("parrot:time_per_output_token_seconds",
                  "parrot:time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert sample("parrot:inter_token_latency_seconds", "parrot:inter_token_latency_seconds_count") == 2
    assert sample("parrot:e2e_request_latency_seconds", "parrot:e2e_request_latency_seconds_sum") == 1.0
    assert sample("parrot:prompt_tokens", "parrot:prompt_tokens_total") == 7
    assert sample("parrot:request_failure", "parrot:request_failure_total", endpoint="completions") == 1
    assert sample("parrot:request_success", "parrot:request_success_total", endpoint="completions",
                  finished_reason="abort") == 1
    assert sample("parrot:engines_live", "parrot:engines_live") == 0
    assert not list(fams["parrot:kv_cache_usage_perc"].samples)  # no engine, no sample
    other = {f.name: f for f in text_string_to_metric_families(b.render().decode())}
    assert next(iter(other["parrot:time_to_first_token_seconds"].samples)).value == 0  # b saw nothing
    # queue time is observed for whatever the scheduler places (both instances hook it)
    a.observe_queue_time(0.25)
    counts = {m: next(s.value for s in m.queue_time.collect()[0].samples if s.name.endswith("_count")) for m in (a, b)}
    assert (counts[a], counts[b]) == (1, 0)


def test_semantic_calls_are_timed(server) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as c:
        body = c.post("/v1/session", json={}).json()
        sid, auth = body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}
        before = scrape(url)
        r = c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": "Say something: {{x}}",
            "parameters": [{"name": "x", "is_output": True, "sampling_config": {"max_tokens": 4, "ignore_eos": True}}]})
        var = r.json()["param_info"][0]["var_id"]
        got = c.get(f"/v1/semantic_var/{var}", params={"session_id": sid, "timeout": 60}, headers=auth)
        assert got.status_code == 200
    after = scrape(url)
    key = ("parrot:request_success_total", (("endpoint", "semantic_call"), ("finished_reason", "length")))
    assert after["parrot:request_success"][key] - before.get("parrot:request_success", {}).get(key, 0.0) == 1
    ttft = "parrot:time_to_first_token_seconds"
    assert after[ttft][(ttft + "_count", ())] > before[ttft][(ttft + "_count", ())]


def test_engine_processes_show_in_health_and_metrics(server) -> None:
    """`parrot serve --engines N`'s processes: each one's state and restarts in /health (status "degraded"
    while one is down) and /metrics."""
    import sys

    from parrot.serve.engine_processes import EngineProcesses
    from tests.servers import free_ports

    url, core = server
    base = free_ports(2)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    exits = [sys.executable, "-c", "import sys; sys.exit(5)"]
    procs = EngineProcesses([("engine-0", base, sleep), ("engine-1", base + 1, exits)], max_restarts=1,
                            backoff_s=0.05, poll_s=0.05, grace_s=5).start()
    core.engine_processes = procs
    try:
        deadline = time.monotonic() + 20
        while procs.status()[1]["state"] != "given_up":
            assert time.monotonic() < deadline, procs.status()
            time.sleep(0.05)
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["status"] == "degraded"
        by_name = {p["name"]: p for p in health["engine_processes"]}
        assert by_name["engine-0"]["state"] == "running" and by_name["engine-0"]["restarts"] == 0
        assert by_name["engine-1"] == {**by_name["engine-1"], "state": "given_up", "restarts": 1,
                                       "last_exit_code": 5, "port": base + 1}
        families = scrape(url)
        assert value(families, "parrot:engine_process_up", engine="engine-0") == 1
        assert value(families, "parrot:engine_process_up", engine="engine-1") == 0
        assert value(families, "parrot:engine_process_restarts", "parrot:engine_process_restarts_total",
                     engine="engine-1") == 1
        core.engine_deaths["engine-1"] += 2  # what the core counts as engines die (tests/serve/test_core.py)
        families = scrape(url)
        assert value(families, "parrot:engine_deaths", "parrot:engine_deaths_total", engine="engine-1") == 2
        assert value(families, "parrot:redispatched_tasks", "parrot:redispatched_tasks_total") == core.redispatched
    finally:
        core.engine_processes = None
        procs.stop()
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["status"] in ("ok", "warming_up") and "engine_processes" not in health
