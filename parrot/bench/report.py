"""Reporting the application benchmark: the result as JSON, a Markdown summary and PNG plots.

    write_report(result, Path("benchmarks/results"), "apps-quick")

Every field of ``result`` may be None or missing; systems that failed carry ``{"error": ...}``.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DASH = "—"

# Summary columns of a workload's per-system table: (header, summary key, formatter name).
_SYSTEM_COLUMNS = [
    ("JCT mean (s)", "jct_mean_s", "s"), ("JCT p50 (s)", "jct_p50_s", "s"), ("JCT p99 (s)", "jct_p99_s", "s"),
    ("req/s", "request_throughput_rps", "rate"), ("out tok/s", "output_tok_s", "rate"),
    ("TTFT p50 (s)", "ttft_p50_s", "s"), ("TTFT p99 (s)", "ttft_p99_s", "s"),
    ("TPOT p50 (ms)", "tpot_p50_s", "ms"), ("TPOT p99 (ms)", "tpot_p99_s", "ms"),
    ("prefix hit", "prefix_cache_hit_rate", "pct"),
    ("serve first (ms)", "serve_first_mean_s", "ms"), ("serve gap (ms)", "serve_gap_mean_s", "ms"),
    ("apps", "n_apps", "int"), ("requests", "n_requests", "int"),
]
_KIND_COLUMNS = [
    ("apps", "n_apps", "int"), ("JCT mean (s)", "jct_mean_s", "s"), ("JCT p50 (s)", "jct_p50_s", "s"),
    ("JCT p99 (s)", "jct_p99_s", "s"), ("TTFT p50 (s)", "ttft_p50_s", "s"), ("TTFT p99 (s)", "ttft_p99_s", "s"),
    ("TPOT p50 (ms)", "tpot_p50_s", "ms"), ("TPOT p99 (ms)", "tpot_p99_s", "ms"),
]
_SPEEDUP_LABELS = {"jct_mean": "JCT mean", "jct_p50": "JCT p50", "jct_p99": "JCT p99",
                   "output_tok_s": "out tok/s", "request_throughput": "req/s"}


# ---------------------------------------------------------------------------------------------- formatting


def _num(v: Any) -> float | None:
    """``v`` as a finite float, or None (for None, booleans, strings, NaN, inf)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _d(v: Any) -> dict:
    """``v`` if it is a dict, else an empty dict."""
    return v if isinstance(v, dict) else {}


def _fixed(v: Any, digits: int) -> str:
    x = _num(v)
    return DASH if x is None else f"{x:.{digits}f}"


def _short(v: Any, digits: int, small: float, scale: float = 1.0) -> str:
    """`v * scale` with `digits` decimals, or 3 significant digits when it is below `small`."""
    x = _num(v)
    if x is None:
        return DASH
    x *= scale
    return f"{x:.3g}" if 0 < abs(x) < small else f"{x:.{digits}f}"


def _secs(v: Any) -> str:
    """Seconds with 2 decimals, or 3 significant digits below 0.1 s."""
    return _short(v, 2, 0.1)


def _ms(v: Any) -> str:
    """Seconds shown as milliseconds with 1 decimal (3 significant digits below 1 ms)."""
    return _short(v, 1, 1.0, 1000.0)


def _rate(v: Any) -> str:
    """Throughput with 1 decimal, or 3 significant digits below 1."""
    return _short(v, 1, 1.0)


def _ratio(v: Any) -> str:
    x = _num(v)
    return DASH if x is None else f"{x:.2f}x"


def _pct(v: Any) -> str:
    x = _num(v)
    return DASH if x is None else f"{100 * x:.1f}%"


def _int(v: Any) -> str:
    x = _num(v)
    return DASH if x is None else f"{x:.0f}"


_FORMATTERS = {"s": _secs, "ms": _ms, "rate": _rate, "pct": _pct, "int": _int}


def _metric(name: str | None, v: Any) -> str:
    """Format a summary value by its key's unit (``*tok_s``/``*_rps`` throughput, ``*_s`` seconds, ...)."""
    name = name or ""
    if name.endswith(("tok_s", "_rps", "tokens_per_s")):
        return _rate(v)
    if "rate" in name:
        return _pct(v)
    if name.endswith("_s"):
        return _secs(v)
    x = _num(v)
    return DASH if x is None else f"{x:.3g}"


def _cell(v: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return DASH if v is None or v == "" else str(v).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


# ---------------------------------------------------------------------------------------------- result access


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _workloads(result: dict) -> dict[str, dict]:
    return {name: _d(wl) for name, wl in _d(result.get("workloads")).items()}


def _system_order(result: dict) -> list[str]:
    """Systems in display order: the top-level ``systems`` first, then any only seen in workloads."""
    names = list(_d(result.get("systems")))
    for wl in _workloads(result).values():
        names += list(_d(wl.get("systems")))
    return _unique(names)


def _pairs(result: dict) -> list[str]:
    """Speedup pairs ("parrot/baseline", ...) across all workloads, in order of appearance."""
    return _unique(p for wl in _workloads(result).values() for p in _d(wl.get("speedups")))


def _summary(entry: Any) -> dict | None:
    """The summary of a system's run, or None when it failed or is missing."""
    if not isinstance(entry, dict) or entry.get("error"):
        return None
    return _d(entry.get("summary"))


def primary_speedup(primary: str | None, ratios: Any) -> float | None:
    """The speedup matching a workload's primary metric (``jct_mean_s`` -> ``jct_mean``, ...)."""
    ratios = _d(ratios)
    if _num(ratios.get("primary")) is not None:  # computed by the runner
        return _num(ratios.get("primary"))
    if not primary:
        return None
    for key in (primary, primary.removesuffix("_s"), primary.removesuffix("_rps")):
        if _num(ratios.get(key)) is not None:
            return _num(ratios.get(key))
    return None


# ---------------------------------------------------------------------------------------------- markdown


def markdown(result: dict) -> str:
    """The Markdown report of an application-benchmark result."""
    result = _d(result)
    lines = [f"# Parrot application benchmark ({result.get('mode') or DASH})", ""]
    duration = _num(result.get("duration_s"))
    machine = ", ".join(f"{k}: {v}" for k, v in _d(result.get("machine")).items() if v is not None)
    lines += [
        f"- **Started:** {result.get('started') or DASH}",
        f"- **Duration:** {DASH if duration is None else f'{duration:.1f} s ({duration / 60:.1f} min)'}",
        f"- **Model:** {result.get('model') or DASH}",
        f"- **Machine:** {machine or DASH}",
        f"- **Runs:** {_runs(result.get('repeats'))}",
        "",
    ]
    lines += _systems_section(result) + _headline_section(result)
    for name, wl in _workloads(result).items():
        lines += _workload_section(name, wl)
    lines += _engine_section(result.get("engine_micro"))
    return "\n".join(lines).rstrip() + "\n"


def _runs(repeats: Any) -> str:
    n = _num(repeats)
    fresh = "every workload on freshly started servers, all systems up side by side, each measured alone"
    if n is None or n <= 1:
        return f"one run of each workload per system; {fresh}"
    return (f"{n:.0f} runs of each workload per system (the systems take turns going first); {fresh}; every "
            "figure is the median over the runs")


def _systems_section(result: dict) -> list[str]:
    systems = _d(result.get("systems"))
    if not systems:
        return []
    rows = []
    for name, info in systems.items():
        info = _d(info)
        cmd = info.get("command")
        cmd = shlex.join(str(c) for c in cmd) if isinstance(cmd, list) else cmd
        rows.append([name, info.get("description"), _secs(info.get("startup_s")), f"`{cmd}`" if cmd else None])
    return ["## Systems", ""] + _table(["System", "Description", "Startup (s)", "Command"], rows) + [""]


def _headline_section(result: dict) -> list[str]:
    workloads, systems, pairs = _workloads(result), _system_order(result), _pairs(result)
    if not workloads:
        return []
    rows = []
    for name, wl in workloads.items():
        primary = wl.get("primary")
        row = [name, primary]
        for system in systems:
            entry = _d(wl.get("systems")).get(system)
            summary = _summary(entry)
            if _d(entry).get("error"):
                row.append("error")
            else:
                row.append(_metric(primary, summary.get(primary)) if summary is not None and primary else DASH)
        speedups = _d(wl.get("speedups"))
        row += [_ratio(primary_speedup(primary, speedups.get(p))) for p in pairs]
        rows.append(row)
    headers = ["Workload", "Primary metric", *systems, *pairs]
    return (["## Headline", "", "Each workload's primary metric per system; speedups are Parrot relative to "
             "the other system on that metric (> 1 means Parrot is better).", ""]
            + _table(headers, rows) + [""])


def _workload_section(name: str, wl: dict) -> list[str]:
    lines = [f"## {name}", ""]
    if wl.get("description"):
        lines += [str(wl["description"]), ""]
    params = _d(wl.get("params"))
    if params:
        lines += ["Params: " + ", ".join(f"`{k}={v}`" for k, v in params.items()), ""]
    if wl.get("primary"):
        lines += [f"Primary metric: `{wl['primary']}`", ""]
    systems = dict(_d(wl.get("systems")))
    if systems:
        rows = []
        for system, entry in systems.items():
            summary = _summary(entry)
            if summary is None:
                error = _d(entry).get("error") or "no result"
                rows.append([system, f"error: {error}", *[""] * len(_SYSTEM_COLUMNS)])
                continue
            wall = _secs(_d(entry).get("wall_s"))
            rows.append([system, wall, *[_FORMATTERS[f](summary.get(k)) for _, k, f in _SYSTEM_COLUMNS]])
        lines += _table(["System", "wall (s)", *[h for h, _, _ in _SYSTEM_COLUMNS]], rows) + [""]
        lines += _by_kind_table(systems)
    lines += _speedup_table(_d(wl.get("speedups")))
    return lines


def _by_kind_table(systems: dict[str, Any]) -> list[str]:
    by_kind = {s: _d(summary.get("by_kind")) for s, e in systems.items() if (summary := _summary(e)) is not None}
    kinds = _unique(k for kinds in by_kind.values() for k in kinds)
    if len(kinds) <= 1:
        return []
    rows = [[system, kind, *[_FORMATTERS[f](_d(per_kind.get(kind)).get(k)) for _, k, f in _KIND_COLUMNS]]
            for system, per_kind in by_kind.items() for kind in kinds if kind in per_kind]
    return ["Per app kind:", ""] + _table(["System", "Kind", *[h for h, _, _ in _KIND_COLUMNS]], rows) + [""]


def _speedup_table(speedups: dict) -> list[str]:
    if not speedups:
        return []
    keys = _unique(k for ratios in speedups.values() for k in _d(ratios) if k != "by_kind")
    has_kinds = any(_d(_d(r).get("by_kind")) for r in speedups.values())
    rows = []
    for pair, ratios in speedups.items():
        ratios = _d(ratios)
        row = [pair, *[_ratio(ratios.get(k)) for k in keys]]
        if has_kinds:
            row.append("; ".join(f"{kind} " + ", ".join(f"{_SPEEDUP_LABELS.get(m, m)} {_ratio(v)}"
                                                        for m, v in _d(per).items())
                                 for kind, per in _d(ratios.get("by_kind")).items()))
        rows.append(row)
    headers = ["Speedup", *[_SPEEDUP_LABELS.get(k, k) for k in keys], *(["By kind"] if has_kinds else [])]
    return ["Speedups (> 1 means Parrot is better):", ""] + _table(headers, rows) + [""]


def _engine_section(micro: Any) -> list[str]:
    if not isinstance(micro, dict) or not micro:
        return []
    prefill, floors, ratios = _d(micro.get("prefill")), _d(micro.get("floors")), _d(micro.get("ratios"))
    decode = _d(micro.get("decode"))
    rows = [[f"Prefill {_int(prefill.get('tokens'))} tokens (tok/s)", _fixed(prefill.get("tokens_per_s"), 1),
             _fixed(floors.get("prefill_floor_tokens_per_s"), 1), _ratio(ratios.get("prefill_fraction_of_floor"))]]

    def batch_size(key: str) -> int:
        digits = key.removeprefix("batch_")
        return int(digits) if digits.isdigit() else 1 << 30

    for key in sorted(decode, key=batch_size):
        step = _d(decode[key])
        label = f"Decode {key.replace('_', ' ')}, context {_int(step.get('context'))} (ms/step)"
        measured = f"{_fixed(step.get('ms_per_step'), 1)} ({_fixed(step.get('tokens_per_s'), 1)} tok/s)"
        floor, ratio = (floors.get("decode_floor_ms"), ratios.get("decode_batch_1_over_floor")) \
            if key == "batch_1" else (None, None)
        rows.append([label, measured, _fixed(floor, 2), _ratio(ratio)])
    weights = _num(floors.get("weight_bytes"))
    return (["## Engine vs machine floor", ""] + _table(["Metric", "Measured", "Floor", "Ratio"], rows)
            + ["", f"Machine: memory read {_fixed(floors.get('memory_read_gbs'), 1)} GB/s, "
               f"GEMM fp32 {_fixed(floors.get('gemm_fp32_gflops'), 1)} GFLOP/s, "
               f"weights {DASH if weights is None else f'{weights / 1e6:.1f} MB'}.", ""])


# ---------------------------------------------------------------------------------------------- plots


def plot(result: dict, out_dir: Path, stem: str) -> list[Path]:
    """Write ``<stem>-jct.png``, ``<stem>-speedup.png`` and ``<stem>-latency.png``; plots without data are skipped."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    result = _d(result)
    systems = _system_order(result)
    colors = {s: f"C{i % 10}" for i, s in enumerate(systems)}
    paths = []
    for suffix, draw in (("jct", _plot_jct), ("speedup", _plot_speedup), ("latency", _plot_latency)):
        fig = Figure(dpi=110, layout="constrained")
        FigureCanvasAgg(fig)
        if draw(fig, result, colors):
            path = Path(out_dir) / f"{stem}-{suffix}.png"
            fig.savefig(path)
            paths.append(path)
    return paths


def _p50_p99(summary: dict, prefix: str, scale: float = 1.0) -> tuple[float | None, float | None]:
    p50, p99 = _num(summary.get(f"{prefix}_p50_s")), _num(summary.get(f"{prefix}_p99_s"))
    return (None if p50 is None else p50 * scale), (None if p99 is None else p99 * scale)


def _bar_whisker(ax: Any, x: float, p50: float | None, p99: float | None, width: float, color: str) -> None:
    """A bar at the p50 and a black whisker up to the p99."""
    if p50 is not None:
        ax.bar(x, p50, width, color=color)
    if p99 is not None:
        ax.plot([x, x], [p50 or 0.0, p99], color="black", linewidth=1)
        ax.plot([x], [p99], marker="_", markersize=10, color="black")


def _legend(fig: Any, systems: list[str], colors: dict[str, str]) -> None:
    """A figure legend: one p50 patch per system and the p99 whisker."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[s], label=f"{s} p50") for s in systems]
    handles.append(Line2D([], [], color="black", marker="_", markersize=10, label="p99"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=9)


def _plot_jct(fig: Any, result: dict, colors: dict[str, str]) -> bool:
    """One subplot per workload: JCT p50 bar and p99 whisker per system."""
    data = {}
    for name, wl in _workloads(result).items():
        per_sys = {s: _p50_p99(summary, "jct") for s, e in _d(wl.get("systems")).items()
                   if (summary := _summary(e)) is not None}
        per_sys = {s: v for s, v in per_sys.items() if v != (None, None)}
        if per_sys:
            data[name] = per_sys
    if not data:
        return False
    ncols = min(len(data), 3)
    nrows = math.ceil(len(data) / ncols)
    fig.set_size_inches(4.2 * ncols, 3.4 * nrows + 0.6)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax, (name, per_sys) in zip(axes, data.items(), strict=False):
        for x, (system, (p50, p99)) in enumerate(per_sys.items()):
            _bar_whisker(ax, x, p50, p99, 0.7, colors[system])
        ax.set_xticks(range(len(per_sys)), list(per_sys), rotation=20, fontsize=9)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("JCT (s)")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[len(data):]:
        ax.set_visible(False)
    fig.suptitle("Job completion time per workload (s): bar = p50, whisker = p99")
    _legend(fig, _unique(s for per_sys in data.values() for s in per_sys), colors)
    return True


def _plot_speedup(fig: Any, result: dict, colors: dict[str, str]) -> bool:
    """Horizontal bars: Parrot's speedup on each workload's primary metric against each other system."""
    pairs = [p for p in _pairs(result) if p.startswith("parrot/")]
    rows = []  # (workload label, {pair: speedup})
    for name, wl in _workloads(result).items():
        primary = wl.get("primary")
        values = {p: v for p in pairs if (v := primary_speedup(primary, _d(wl.get("speedups")).get(p))) is not None}
        if values:
            rows.append((f"{name}\n({primary})", values))
    pairs = [p for p in pairs if any(p in values for _, values in rows)]
    if not rows:
        return False
    height = 0.8 / len(pairs)
    fig.set_size_inches(8, 1.0 + 0.35 * len(rows) * len(pairs) + 0.4 * len(rows))
    ax = fig.subplots()
    labelled = set()
    for i, (_, values) in enumerate(rows):
        for j, pair in enumerate(pairs):
            if pair not in values:
                continue
            y = i + (j - (len(pairs) - 1) / 2) * height
            other = pair.split("/", 1)[1]
            ax.barh(y, values[pair], height * 0.9, color=colors.get(other, f"C{j % 10}"),
                    label=None if pair in labelled else pair)
            labelled.add(pair)
            ax.annotate(f"{values[pair]:.2f}x", (values[pair], y), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=8)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(v.values()) for _, v in rows) * 1.15 + 0.1)
    ax.set_xlabel("speedup (×, > 1 means Parrot is better)")
    ax.set_title("Parrot speedup on each workload's primary metric")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=9, loc="lower right")
    return True


def _plot_latency(fig: Any, result: dict, colors: dict[str, str]) -> bool:
    """TTFT (s) and TPOT (ms) per workload, grouped bars per system: p50 bar and p99 whisker."""
    workloads = _workloads(result)
    panels = [("ttft", 1.0, "Time to first token (s)", "TTFT (s)"),
              ("tpot", 1000.0, "Time per output token (ms)", "TPOT (ms)")]
    data = {}  # (panel prefix, workload, system) -> (p50, p99)
    for name, wl in workloads.items():
        for system, entry in _d(wl.get("systems")).items():
            if (summary := _summary(entry)) is None:
                continue
            for prefix, scale, _, _ in panels:
                if (values := _p50_p99(summary, prefix, scale)) != (None, None):
                    data[prefix, name, system] = values
    if not data:
        return False
    names = _unique(name for _, name, _ in data)
    systems = [s for s in colors if any(s == key[2] for key in data)]
    width = 0.8 / len(systems)
    fig.set_size_inches(max(7.0, 1.2 + len(names) * (0.35 * len(systems) + 0.5)), 7.5)
    for ax, (prefix, _, title, ylabel) in zip(fig.subplots(2, 1), panels, strict=True):
        for i, name in enumerate(names):
            for j, system in enumerate(systems):
                if (values := data.get((prefix, name, system))) is not None:
                    _bar_whisker(ax, i + (j - (len(systems) - 1) / 2) * width, *values, width * 0.9, colors[system])
        ax.set_xticks(range(len(names)), names, fontsize=9)
        ax.set_title(f"{title}: bar = p50, whisker = p99", fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Per-request latency by workload and system")
    _legend(fig, systems, colors)
    return True


# ---------------------------------------------------------------------------------------------- entry point


def write_report(result: dict, out_dir: Path, stem: str) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and the ``<stem>-*.png`` plots into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    md_path.write_text(markdown(result))
    paths = [json_path, md_path, *plot(result, out_dir, stem)]
    for path in paths:
        print(f"wrote {path}")
    return paths
