"""Summaries of one workload run (job completion times, throughput, TTFT / TPOT percentiles, prefix-cache
hit rate) and Parrot's speedups over the other systems."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parrot.bench.runtime import AppRecord, Recorder, RequestRecord


def pct(values: Sequence[float | None], q: float) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _latency(apps: list[AppRecord], reqs: list[RequestRecord]) -> dict[str, float | int | None]:
    jct = [a.jct_s for a in apps]
    return {"n_apps": len(apps), "n_requests": len(reqs), "jct_mean_s": _mean(jct), "jct_p50_s": pct(jct, 50),
            "jct_p99_s": pct(jct, 99), "ttft_p50_s": pct([r.ttft_s for r in reqs], 50),
            "ttft_p99_s": pct([r.ttft_s for r in reqs], 99), "tpot_p50_s": pct([r.tpot_s for r in reqs], 50),
            "tpot_p99_s": pct([r.tpot_s for r in reqs], 99)}


def summarize(rec: Recorder, wall_s: float) -> dict:
    """The workload's numbers on one system. Throughputs are over the wall time of the whole workload.
    With several app kinds (mixed), `<kind>_jct_*` keys repeat the per-kind job completion times."""
    out = _latency(rec.apps, rec.requests)
    out["request_throughput_rps"] = len(rec.requests) / wall_s if wall_s > 0 else None
    out["output_tok_s"] = sum(r.output_tokens for r in rec.requests) / wall_s if wall_s > 0 else None
    known = [r for r in rec.requests if r.prompt_tokens and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in known)
    out["prompt_tokens"] = sum(r.prompt_tokens or 0 for r in rec.requests) or None
    out["prefix_cache_hit_rate"] = sum(r.cached_tokens or 0 for r in known) / prompt if prompt else None
    kinds = sorted({a.kind for a in rec.apps})
    out["by_kind"] = {k: _latency([a for a in rec.apps if a.kind == k], [r for r in rec.requests if r.kind == k])
                      for k in kinds}
    if len(kinds) > 1:
        for k in kinds:
            for key in ("jct_mean_s", "jct_p50_s", "jct_p99_s"):
                out[f"{k}_{key}"] = out["by_kind"][k][key]
    return out


def median_summary(summaries: list[dict]) -> dict:
    """Each metric's median over several runs' summaries (nested dicts alike; a metric missing or None in
    every run stays None). With one run, that run's summary."""
    if len(summaries) == 1:
        return summaries[0]
    out: dict = {}
    for key in dict.fromkeys(k for s in summaries for k in s):
        values = [s.get(key) for s in summaries]
        if any(isinstance(v, dict) for v in values):
            out[key] = median_summary([v for v in values if isinstance(v, dict)])
            continue
        nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        out[key] = float(np.median(nums)) if nums else None
    return out


_LOWER = ("jct_mean_s", "jct_p50_s", "jct_p99_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
_HIGHER = ("request_throughput_rps", "output_tok_s")


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den not in (None, 0) else None


def speedups(parrot: dict, other: dict) -> dict:
    """Parrot relative to another system, > 1 meaning Parrot is better: other / parrot for times,
    parrot / other for throughputs; the same per app kind."""
    out: dict = {k.removesuffix("_s").removesuffix("_rps"): _ratio(other.get(k), parrot.get(k)) for k in _LOWER}
    out |= {k.removesuffix("_rps"): _ratio(parrot.get(k), other.get(k)) for k in _HIGHER}
    out["by_kind"] = {kind: {k.removesuffix("_s"): _ratio((other.get("by_kind") or {}).get(kind, {}).get(k), v.get(k))
                             for k in ("jct_mean_s", "jct_p50_s", "jct_p99_s", "ttft_p99_s", "tpot_p99_s")}
                      for kind, v in (parrot.get("by_kind") or {}).items()}
    return out


def primary_speedup(primary: str, parrot: dict, other: dict) -> float | None:
    if primary.endswith("_s"):
        return _ratio(other.get(primary), parrot.get(primary))
    return _ratio(parrot.get(primary), other.get(primary))
