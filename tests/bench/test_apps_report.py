"""The application-benchmark report: JSON, Markdown and PNG plots from a result dict, robust to missing data."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from parrot.bench.report import markdown, primary_speedup, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LLAMACPP_ERROR = "not installed: run sh parrot/bench/peers/install_llamacpp.sh"


def _kind(jct: float) -> dict:
    return {"n_apps": 2, "jct_mean_s": jct, "jct_p50_s": jct * 0.9, "jct_p99_s": jct * 1.5,
            "ttft_p50_s": 0.4, "ttft_p99_s": 1.2, "tpot_p50_s": 0.05, "tpot_p99_s": 0.09}


def _run(jct: float, kinds: dict[str, dict]) -> dict:
    summary = {"n_apps": 4, "n_requests": 40, "jct_mean_s": jct, "jct_p50_s": jct * 0.9, "jct_p99_s": jct * 1.6,
               "request_throughput_rps": 2.0 / jct, "output_tok_s": 800 / jct, "ttft_p50_s": 0.03 * jct,
               "ttft_p99_s": 0.2 * jct, "tpot_p50_s": 0.12, "tpot_p99_s": 0.2, "prefix_cache_hit_rate": 0.13,
               "by_kind": kinds}
    return {"wall_s": jct * 1.1, "summary": summary, "apps": [{"kind": "map_reduce", "jct_s": jct}],
            "requests": [{"kind": "map_reduce", "prompt_tokens": 560, "cached_tokens": 40, "output_tokens": 48,
                          "ttft_s": 0.8, "tpot_s": 0.11, "latency_s": 6.0}]}


def fake_result() -> dict:
    """Two workloads (``mixed`` with two app kinds), llama.cpp failing, engine_micro present."""
    return {
        "benchmark": "apps", "mode": "quick", "started": "2026-11-22T03:10:00Z", "duration_s": 512.3,
        "machine": {"cpu": "Test CPU", "cores": 2, "python": "3.11.7", "jax": "0.10.2"},
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "systems": {
            "parrot": {"description": "Parrot with semantic variables", "command": ["parrot", "serve", "--port", "1"],
                       "startup_s": 41.2},
            "baseline": {"description": "request-level serving", "command": ["parrot", "serve", "--baseline"],
                         "startup_s": 40.0},
            "llamacpp": {"description": "llama.cpp server", "command": None, "startup_s": None},
        },
        "workloads": {
            "map_reduce": {
                "description": "16 chunks of ~512 tokens summarized in parallel, then one reduce",
                "params": {"chunks": 16, "chunk_tokens": 512},
                "primary": "jct_mean_s",
                "systems": {"parrot": _run(19.8, {"map_reduce": _kind(19.8)}),
                            "baseline": _run(41.6, {"map_reduce": _kind(41.6)}),
                            "llamacpp": {"error": LLAMACPP_ERROR}},
                "speedups": {"parrot/baseline": {"jct_mean": 2.1, "jct_p99": 1.9, "output_tok_s": 2.0,
                                                 "request_throughput": 2.0}},
            },
            "mixed": {
                "description": "chat sessions next to map-reduce apps",
                "params": {"chat_apps": 8, "map_reduce_apps": 2},
                "primary": "output_tok_s",
                "systems": {"parrot": _run(12.0, {"chat": _kind(3.0), "map_reduce": _kind(20.0)}),
                            "baseline": _run(18.0, {"chat": _kind(2.7), "map_reduce": _kind(35.0)}),
                            "llamacpp": {"error": LLAMACPP_ERROR}},
                "speedups": {"parrot/baseline": {
                    "jct_mean": 1.5, "jct_p99": 1.4, "output_tok_s": 1.5, "request_throughput": 1.5,
                    "by_kind": {"chat": {"jct_p99": 0.9}, "map_reduce": {"jct_p99": 1.75}}}},
            },
        },
        "engine_micro": {
            "prefill": {"tokens": 512, "median_s": 0.317, "tokens_per_s": 1614.8},
            "decode": {"batch_1": {"context": 512, "ms_per_step": 35.1, "tokens_per_s": 28.5},
                       "batch_32": {"context": 512, "ms_per_step": 249.8, "tokens_per_s": 128.1}},
            "floors": {"memory_read_gbs": 30.6, "gemm_fp32_gflops": 327.0, "weight_bytes": 538060032,
                       "decode_floor_ms": 17.58, "prefill_floor_tokens_per_s": 1215.5},
            "ratios": {"decode_batch_1_over_floor": 2.0, "prefill_fraction_of_floor": 1.33},
        },
    }


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) > 5000, (path, len(data))


def test_write_report_writes_json_markdown_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = fake_result()
    paths = write_report(result, tmp_path / "out", "apps-quick")

    out = tmp_path / "out"
    assert {p.name for p in paths} == {"apps-quick.json", "apps-quick.md", "apps-quick-jct.png",
                                       "apps-quick-speedup.png", "apps-quick-latency.png"}
    assert all(p.parent == out and p.exists() for p in paths)
    printed = capsys.readouterr().out
    assert all(f"wrote {p}" in printed for p in paths)

    assert json.loads((out / "apps-quick.json").read_text()) == result

    md = (out / "apps-quick.md").read_text()
    assert md == markdown(result)
    for text in ("quick", "2026-11-22T03:10:00Z", "SmolLM2-135M-Instruct.Q4_1.gguf", "## Systems",
                 "`parrot serve --port 1`", "## map_reduce", "## mixed", "2.10x", "1.50x", LLAMACPP_ERROR,
                 "## Engine vs machine floor", "1614.8", "1215.5", "17.58", "249.8", "30.6 GB/s", "327.0 GFLOP/s"):
        assert text in md, text
    # headline row: map_reduce's primary is JCT mean (seconds), mixed's is output tok/s
    assert "| map_reduce | jct_mean_s | 19.80 | 41.60 | error | 2.10x |" in md
    assert "| mixed | output_tok_s | 66.7 | 44.4 | error | 1.50x |" in md
    # the per-kind table only for the workload with two kinds, and per-kind speedups
    assert md.count("Per app kind:") == 1
    assert "| parrot | chat |" in md and "| baseline | map_reduce |" in md
    assert "chat JCT p99 0.90x" in md
    # TPOT in ms, prefix-cache hit rate as a percentage
    assert "| 120.0 | 200.0 | 13.0% |" in md

    for path in paths[2:]:
        _assert_png(path)


def test_degenerate_results_still_write(tmp_path: Path) -> None:
    result = fake_result()
    del result["engine_micro"]
    result["duration_s"] = None
    result["machine"] = None
    result["systems"]["parrot"]["command"] = None
    mr = result["workloads"]["map_reduce"]
    mr["primary"] = None
    mr["params"] = None
    mr["systems"]["baseline"]["summary"] = {k: None for k in mr["systems"]["baseline"]["summary"]}
    mr["speedups"] = {"parrot/baseline": None, "parrot/llamacpp": {"jct_mean": None}}
    result["workloads"]["all_failed"] = {
        "description": "every system failed", "primary": "jct_p99_s",
        "systems": {"parrot": {"error": "boom"}, "baseline": {"error": "timeout"}, "llamacpp": None},
        "speedups": {}}
    result["workloads"]["empty"] = None

    paths = write_report(result, tmp_path, "deg")
    md = (tmp_path / "deg.md").read_text()
    assert "Engine vs machine floor" not in md
    assert "## all_failed" in md and "error: boom" in md and "error: timeout" in md
    assert json.loads((tmp_path / "deg.json").read_text()) == result
    for path in paths[2:]:
        _assert_png(path)


def test_nothing_measured_writes_no_plots(tmp_path: Path) -> None:
    result = {"benchmark": "apps", "mode": "full", "workloads": {
        "chat": {"primary": "jct_mean_s", "systems": {"parrot": {"error": "crashed"}}, "speedups": None}}}
    paths = write_report(copy.deepcopy(result), tmp_path, "none")
    assert [p.name for p in paths] == ["none.json", "none.md"]
    assert "error: crashed" in (tmp_path / "none.md").read_text()
    assert write_report({}, tmp_path, "empty")[1].read_text().startswith("# Parrot application benchmark")


def test_primary_speedup_maps_metric_names() -> None:
    ratios = {"jct_mean": 2.0, "jct_p99": 1.5, "output_tok_s": 3.0, "request_throughput": 4.0}
    assert primary_speedup("jct_mean_s", ratios) == 2.0
    assert primary_speedup("jct_p99_s", ratios) == 1.5
    assert primary_speedup("output_tok_s", ratios) == 3.0
    assert primary_speedup("request_throughput_rps", ratios) == 4.0
    assert primary_speedup("jct_mean_s", None) is None
    assert primary_speedup(None, ratios) is None
