"""The application benchmarks' parts: corpus, prompts, metrics, and one app run on both runtimes against
a real server (uvicorn on loopback, the serve core, a tiny random-weight model)."""

from __future__ import annotations

import asyncio

import pytest

from parrot.bench import corpus, workloads
from parrot.bench.metrics import median_summary, primary_speedup, speedups, summarize
from parrot.bench.run import combine_runs
from parrot.bench.runtime import (
    AppRecord,
    OpenAIRuntime,
    ParrotRuntime,
    Recorder,
    RequestRecord,
    output_port,
    render_prompt,
)
from parrot.bench.systems import build


def test_corpus_chunks_are_real_text_in_order() -> None:
    doc = corpus.text("gpl-3.0.txt")
    parts = corpus.chunks(doc, 512)
    assert len(parts) == 16 and all(unit in doc for p in parts for unit in p.split("\n\n"))
    assert "".join("".join(parts).split()) == "".join(doc.split())  # nothing lost or added but whitespace
    assert max(map(len, parts)) <= 512 * corpus.CHARS_PER_TOKEN
    assert corpus.head(doc, 100) == parts[0][: len(corpus.head(doc, 100))]
    assert all(40 <= len(s) <= 400 for s in corpus.sentences(doc, 40, 400))


def test_every_workload_prompt_ends_with_its_output() -> None:
    for fn in (workloads.refine_summary, workloads.summarize_chunk, workloads.reduce_summaries,
               workloads.ask_license, workloads.architect, workloads.engineer, workloads.reviewer,
               workloads.explain):
        name, out = output_port(fn)
        assert out.sampling_config()["ignore_eos"] is True
        assert fn.template.endswith("<|im_start|>assistant\n{{" + name + "}}")
    prompt = render_prompt(workloads.summarize_chunk, {"chunk": "Some text."})
    assert prompt.endswith("Some text.<|im_end|>\n<|im_start|>assistant\n") and "{{" not in prompt
    assert set(workloads.WORKLOADS) == {"chain", "map_reduce", "shared_prompt", "multi_agent", "mixed",
                                        "chain_under_load", "map_reduce_under_load"}
    for w in workloads.WORKLOADS.values():
        assert set(w.params) == {"quick", "full"}
    assert len(set(workloads.passages(48, seed=2))) == 48


def test_poisson_arrivals_are_reproducible() -> None:
    a = workloads.poisson_starts(200, rate=8.0, seed=1)
    assert a == workloads.poisson_starts(200, rate=8.0, seed=1) and a[0] == 0.0
    assert a == sorted(a) and 200 / 8 * 0.7 < a[-1] < 200 / 8 * 1.3


def test_summary_and_speedups() -> None:
    def rec(jcts: list[float], kind: str = "app", cached: int = 0) -> Recorder:
        r = Recorder()
        r.apps = [AppRecord(kind, j) for j in jcts]
        r.requests = [RequestRecord(kind, 100, cached, 10, 0.5, 0.05, j) for j in jcts]
        return r

    parrot = summarize(rec([1.0, 2.0, 3.0], cached=50), wall_s=4.0)
    base = summarize(rec([2.0, 4.0, 6.0]), wall_s=8.0)
    assert parrot["jct_mean_s"] == 2.0 and parrot["jct_p50_s"] == 2.0 and parrot["prefix_cache_hit_rate"] == 0.5
    assert parrot["output_tok_s"] == 30 / 4 and parrot["request_throughput_rps"] == 3 / 4
    s = speedups(parrot, base)
    assert s["jct_mean"] == 2.0 and s["output_tok_s"] == 2.0 and s["by_kind"]["app"]["jct_mean"] == 2.0
    assert primary_speedup("jct_mean_s", parrot, base) == 2.0
    assert primary_speedup("request_throughput_rps", parrot, base) == 2.0
    mixed = rec([1.0])
    mixed.apps.append(AppRecord("chat", 0.25))
    assert summarize(mixed, 1.0)["chat_jct_mean_s"] == 0.25


def test_repeated_runs_report_each_metrics_median() -> None:
    runs = [{"wall_s": w, "summary": {"jct_mean_s": j, "ttft_p50_s": None, "by_kind": {"chat": {"jct_mean_s": j}}}}
            for w, j in ((3.0, 1.0), (9.0, 5.0), (4.0, 2.0))]
    entry = combine_runs([*runs, {"error": "timed out after 9 s"}])
    assert entry["wall_s"] == 4.0 and entry["summary"]["jct_mean_s"] == 2.0
    assert entry["summary"]["ttft_p50_s"] is None and entry["summary"]["by_kind"]["chat"]["jct_mean_s"] == 2.0
    assert entry["errors"] == ["timed out after 9 s"] and len(entry["runs"]) == 4
    assert combine_runs([{"error": "x"}])["error"] == "x"
    assert median_summary([runs[0]["summary"]]) is runs[0]["summary"]


def test_systems_report_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    import parrot.bench.systems as systems

    monkeypatch.setattr(systems, "PEERS_DIR", tmp_path)
    made = {s.name: s for s in build(["parrot", "baseline-apc", "baseline", "llama-server"], 9900, quick=True)}
    assert "--no-prefix-sharing" in made["baseline"].command and "--no-app-awareness" in made["baseline"].command
    apc = made["baseline-apc"].command
    assert "--no-app-awareness" in apc and "--no-prefix-sharing" not in apc and made["baseline-apc"].port == 9901
    assert made["parrot"].missing is None and made["parrot"].port == 9900
    assert "install_llama_server.sh" in (made["llama-server"].missing or "")
    with pytest.raises(ValueError, match="unknown system"):
        build(["vllm"], 9900)


def test_parrot_args_go_to_the_parrot_system_only() -> None:
    made = {s.name: s for s in build(["parrot", "baseline-apc"], 9900, quick=True,
                                     parrot_args=["--prefill-tokens-beside-latency", "64"])}
    cmd = made["parrot"].command
    assert cmd[cmd.index("--prefill-tokens-beside-latency") + 1] == "64"
    assert "--prefill-tokens-beside-latency" not in made["baseline-apc"].command
    made = {s.name: s for s in build(["parrot", "baseline-apc", "baseline"], 9900, quick=True,
                                     engine_args=["--decode-bursts", "256"])}
    for system in made.values():  # an engine setting goes to every system `parrot serve` runs
        assert system.command[system.command.index("--decode-bursts") + 1] == "256"


def test_param_overrides_apply_where_a_workload_has_the_key() -> None:
    params = workloads.override_params(["chain_under_load", "map_reduce_under_load", "chain"], "quick",
                                       ["chat_rate=2", "chats=20"])
    for name in ("chain_under_load", "map_reduce_under_load"):
        assert params[name]["chat_rate"] == 2.0 and isinstance(params[name]["chat_rate"], float)
        assert params[name]["chats"] == 20 and isinstance(params[name]["chats"], int)
    assert params["chain"] == workloads.WORKLOADS["chain"].params["quick"]  # no such keys: unchanged
    assert workloads.WORKLOADS["chain_under_load"].params["quick"]["chat_rate"] == 0.3  # the defaults stay
    bad_ones = [("chat_rate", "KEY=VALUE"), ("users=4", "no selected workload"), ("chats=many", "not of type int")]
    for bad, why in bad_ones:
        with pytest.raises(ValueError, match=why):
            workloads.override_params(["chain_under_load"], "quick", [bad])


@pytest.fixture(scope="module")
def server():
    from tests.servers import tiny_serving_core

    with tiny_serving_core() as served:
        yield served


def test_one_app_logic_same_results_on_both_runtimes(server) -> None:
    """Map-reduce as semantic variables (Parrot) and as client control flow over the OpenAI API give
    the same greedy outputs and the same prompts; both runtimes record every generation."""
    url, _ = server
    chunks = ["The cat sat on the mat.", "The dog chased the cat.", "Both fell asleep."]

    async def run(rt) -> tuple[str, Recorder]:  # noqa: ANN001
        rec, out = Recorder(), []

        async def logic(app) -> None:  # noqa: ANN001
            out.append(await workloads.map_reduce(app, chunks))

        await rt.run_app("map_reduce", rec, logic)
        return out[0], rec

    text_p, rec_p = asyncio.run(run(ParrotRuntime(url)))
    text_o, rec_o = asyncio.run(run(OpenAIRuntime("baseline", url, "tiny", {"ignore_eos": True})))
    assert text_p == text_o and text_p
    for rec in (rec_p, rec_o):
        assert len(rec.apps) == 1 and rec.apps[0].jct_s > 0
        assert sorted(r.output_tokens for r in rec.requests) == [48, 48, 48, 96]
        assert all(0 < r.ttft_s <= r.latency_s for r in rec.requests)
    assert sorted(r.prompt_tokens for r in rec_p.requests) == sorted(r.prompt_tokens for r in rec_o.requests)
    assert sum(r.cached_tokens for r in rec_p.requests) > 0  # the maps share the system prompt's KV
