"""Engine micro-benchmark: load, compile, prefill and decode on the default model, next to this
machine's floors measured in the same run.

    python -m benchmarks.engine_micro [--model smollm2] [--out benchmarks/results/engine_micro.json]
    python -m benchmarks.engine_micro --other-build before=/path/to/an/older/checkout   # two kernel builds in turns

`--other-build LABEL=PATH` (repeatable) measures another build of the native kernels beside this one, in one
process and in turns (`kernels.use_build`): PATH is a built library, or a checkout (or its cpu_kernels.cc),
which is built first for this CPU. Its configuration is the first one's, named `<first>@LABEL`. The other
build must read the weights' tiled copies as this one lays them out, or make its own: a runner of another
build tiles its copies with that build.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import floors
from benchmarks.report import write_json
from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine import attention, kernels
from parrot.engine.batch import SequenceSlice, build_batch
from parrot.engine.loader import load_model
from parrot.engine.runner import MULTI_STOP_IDS, ModelRunner
from parrot.engine.sampling import SamplingBatch
from parrot.engine.shapes import Shape
from parrot.protocol import SamplingParams


def _time_interleaved(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turns so that machine noise hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def _name(layers_per_call: int, weights: str, several_layers: bool, attention: str, several_attention: bool,
          matmul: str = "auto", cpu_attention: str = "auto", tiled: str = "on", team: str = "on",
          huge: str = "on", avx2_int8: str = "on", amx_few: str = "on") -> str:
    name = f"weights_{weights}"
    if amx_few != "on":
        name += f"_amx_few_{amx_few}"
    if avx2_int8 != "on":
        name += f"_avx2_int8_{avx2_int8}"
    if huge != "on":
        name += f"_huge_pages_{huge}"
    if matmul != "auto":
        name += f"_matmul_{matmul}"
    if cpu_attention != "auto":
        name += f"_decode_attention_{cpu_attention}"
    if tiled != "on":
        name += f"_tiled_{tiled}"
    if team != "on":
        name += f"_team_{team}"
    if several_layers:
        name += "_fused" if layers_per_call == 0 else f"_layers_per_call_{layers_per_call}"
    if several_attention:
        name += f"_attention_{attention}"
    return name


def run(model: str, prompt_len: int, decode_ctx: int, batches: list[int], repeats: int,
        layers: list[int], weights: list[str], load_format: str = "auto", attention: list[str] | None = None,
        matmuls: list[str] | None = None, cpu_attention: list[str] | None = None, tiled: list[str] | None = None,
        team: list[str] | None = None, huge: list[str] | None = None, avx2_int8: list[str] | None = None,
        loop_steps: int = 0, amx_few: list[str] | None = None, builds: dict[str, str] | None = None,
        kv_dtypes: list[str] | None = None, kv_fill: str = "unwritten") -> dict:
    t0 = time.perf_counter()
    loaded = load_model(model, load_format=load_format, dtype="bfloat16" if weights == ["bf16"] else None)
    t_read = time.perf_counter() - t0
    runners = {}
    load_s = {}
    # the CPU kernels' quantized product per configuration: one runner serves both (the compiled steps
    # call the same FFI target; kernels.use_matmul switches the code behind it before each call)
    matmul: dict[str, str] = {}
    cpu_att: dict[str, str] = {}  # decode attention's products on a CPU: auto, bf16 (where it can) or f32
    # the tiled weights' reading, the kernels' team and the AVX2 code's integer generated rows: on or off
    switches: dict[str, tuple[str, str, str]] = {}
    attention = attention or ["auto"]
    # the pool holds every page the steps below write (pages 1.. of each sequence; page 0 is scratch): the
    # native CPU kernels index it without bounds checks
    ps0 = EngineConfig().page_size
    pages = 1 + max(-(-prompt_len // ps0), max(batches) * -(-(decode_ctx - 1 + max(loop_steps, 1)) // ps0))
    kv_dtypes = kv_dtypes or ["auto"]
    for w in weights:
        for lpc in layers:
            for att, hp, kvd in itertools.product(attention, huge or ["on"], kv_dtypes):
                t = time.perf_counter()
                keys, _, values = kvd.partition(":")  # "bf16:fp8": the keys' and the values' types
                cfg = EngineConfig(model=model, kv_pages=pages, compilation_cache_dir=None,
                                   layers_per_call=lpc or None, weights=w, decode_attention=att, kv_dtype=keys,
                                   v_dtype=values or None)
                with _huge_pages(hp):
                    r = ModelRunner(loaded.config, loaded.weights, cfg)
                jax.block_until_ready(r.weights)
                if kv_fill == "random":
                    _fill_kv(r)
                for mm, ca, ti, tm, ai, af in itertools.product(matmuls or ["auto"], cpu_attention or ["auto"],
                                                                tiled or ["on"], team or ["on"], avx2_int8 or ["on"],
                                                                amx_few or ["on"]):
                    name = _name(lpc, w, len(layers) > 1, att, len(attention) > 1, mm, ca, ti, tm, hp, ai, af)
                    if len(kv_dtypes) > 1:
                        name += f"_kv_{kvd}"
                    runners[name], matmul[name], cpu_att[name], switches[name] = r, mm, ca, (ti, tm, ai, af)
                    load_s[name] = t_read + time.perf_counter() - t
    # other builds of the native kernels (label -> library): a runner each, of the first configuration, its
    # weights tiled by that build; its steps traced and run with that build in use (select)
    build_of: dict[str, str] = {}
    first_name, first_runner = next(iter(runners.items()))
    for label, lib in (builds or {}).items():
        name = f"{first_name}@{label}"
        kernels.use_build(lib)
        try:
            t = time.perf_counter()
            r = ModelRunner(loaded.config, loaded.weights, first_runner.ecfg)
            jax.block_until_ready(r.weights)
        finally:
            kernels.use_build(None)
        runners[name], matmul[name], cpu_att[name] = r, matmul[first_name], cpu_att[first_name]
        switches[name], load_s[name], build_of[name] = switches[first_name], t_read + time.perf_counter() - t, lib
    default_path = kernels.matmul_path()
    default_fills = kernels.bf16_fills() is not None
    default_decode_bf16 = kernels.decode_bf16()
    default_team = kernels.team()

    def select(name: str) -> None:
        if kernels.available():
            kernels.use_build(build_of.get(name))  # the build the runner was made with: its switches below
            mm = matmul[name]
            code = {"amx": "amx-int8", "avx512-bf16": "avx512-vnni"}.get(mm, mm)  # with bf16 fills
            kernels.use_matmul(default_path if mm == "auto" else code)
            kernels.use_bf16_fills(default_fills if mm == "auto" else mm in ("amx", "avx512-bf16"))
            kernels.use_decode_bf16(default_decode_bf16 if cpu_att[name] == "auto" else cpu_att[name] == "bf16")
            kernels.use_tiled(switches[name][0] == "on")
            kernels.use_team(switches[name][1] == "on")
            kernels.use_avx2_int8(switches[name][2] == "on")
            kernels.use_amx_few(switches[name][3] == "on")
    t_load = next(iter(load_s.values()))
    runner = next(iter(runners.values()))
    ps = runner.page_size
    result: dict = {
        "model": loaded.source, "params": loaded.config.num_params, "decode_weight_dtype": str(runner.dtype),
        "prefill_weight_dtype": str(runner.prefill_dtype), "activation_dtype": str(runner.act_dtype),
        "load_s": t_load, "load_s_by_config": load_s, "load_read_s": t_read,
        "weights_by_config": {name: r.weights_mode for name, r in runners.items()},
        "cpu_matmul_by_config": {name: _matmul_path(name, select) for name in runners},
        "decode_kernel_by_config": {name: r.decode_kernel for name, r in runners.items()},
        "decode_attention_by_config": {name: r.decode_attention for name, r in runners.items()},
        "kv_dtype_by_config": {name: r.kv_dtype_name for name, r in runners.items()}, "kv_fill": kv_fill,
        # loops' samplers: parts named on the host (no device branch: accelerators) or branching on the device
        "loop_sampler": "named" if next(iter(runners.values())).host_stages else "branching",
        "cpu_decode_attention_by_config": {name: _decode_attention(name, select) for name in runners},
        "weight_bytes_by_config": {name: _weight_bytes(r) for name, r in runners.items()},
        "compile_s": {}, "jax": jax.__version__, "other_builds": build_of,
        "backend": jax.default_backend(), "machine": procinfo.cpu_name(), "configs": list(runners),
    }

    def steps(shape: Shape, seqs: list[SequenceSlice]) -> dict[str, object]:
        batch = jax.device_put(build_batch(seqs, ps, shape.tokens, shape.batch, shape.q_len, shape.pages))
        fns = {}
        for name, r in runners.items():
            def go(r: ModelRunner = r, name: str = name) -> None:
                select(name)
                np.asarray(r.sample(r.forward(batch), None))  # forward + greedy sample, host sync

            t = time.perf_counter()
            go()
            result["compile_s"][f"{name}: tokens={shape.tokens},batch={shape.batch},kv={shape.pages * ps}"] = (
                time.perf_counter() - t)
            fns[name] = go
        return fns

    # prefill: one prompt of prompt_len tokens
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, loaded.config.vocab_size, prompt_len).tolist()
    pages = list(range(1, 1 + -(-prompt_len // ps)))
    t_prefill = _time_interleaved(steps(runner.shapes.prefill_shape(1, prompt_len, prompt_len),
                                        [SequenceSlice(prompt, 0, pages, fill=True)]), repeats)
    result["prefill"] = {name: {"tokens": prompt_len, "median_s": t, "tokens_per_s": prompt_len / t}
                         for name, t in t_prefill.items()}

    # decode: each sequence has decode_ctx - 1 tokens cached and decodes one more
    per_seq = -(-decode_ctx // ps)
    result["decode"] = {name: {} for name in runners}
    for b in batches:
        seqs = [SequenceSlice([int(rng.integers(100, 1000))], decode_ctx - 1,
                              list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(b)]
        shape = runner.shapes.decode_shape(b, decode_ctx)
        for name, t in _time_interleaved(steps(shape, seqs), repeats * 2).items():
            ms = t * 1e3
            select(name)
            piped = _pipelined_ms(runners[name], build_batch(seqs, ps, shape.tokens, shape.batch, 1, shape.pages))
            result["decode"][name][f"batch_{b}"] = {"context": decode_ctx, "ms_per_step": ms,
                                                    "tokens_per_s": b * 1e3 / ms, "pipelined_ms_per_step": piped}
        if loop_steps > 1:  # multi-step decode: loop_steps decode steps a call, as the engine runs a stable batch
            per_loop = -(-(decode_ctx - 1 + loop_steps) // ps)
            lseqs = [SequenceSlice(s.tokens, s.start, list(range(1 + i * per_loop, 1 + (i + 1) * per_loop)))
                     for i, s in enumerate(seqs)]
            for name, r in runners.items():
                select(name)
                t = time.perf_counter()
                _loop_ms_per_token(r, lseqs, loop_steps, calls=1)  # compiles the loop
                result["compile_s"][f"{name}: loop of {loop_steps}, batch={b}"] = time.perf_counter() - t
                result["decode"][name][f"batch_{b}"] |= {
                    "loop_steps": loop_steps, "loop_ms_per_token": _loop_ms_per_token(r, lseqs, loop_steps)}
    result["rss_gb"] = (procinfo.rss_bytes() or 0) / 1e9

    fl = floors.measure()
    weight_bytes = loaded.config.num_params * 4  # float32 weights: what a float32 decode step reads
    decode_floor_ms = weight_bytes / (fl["memory_read_gbs"] * 1e9) * 1e3
    prefill_floor = fl["gemm_fp32_gflops"] * 1e9 / (2 * loaded.config.num_params)
    result["floors"] = fl | {
        "weight_bytes": weight_bytes, "decode_floor_ms": decode_floor_ms, "prefill_floor_tokens_per_s": prefill_floor,
    }
    result["ratios"] = {name: {
        "decode_batch_1_over_floor": result["decode"][name].get("batch_1", {}).get("ms_per_step", float("nan"))
        / decode_floor_ms,
        "prefill_fraction_of_floor": result["prefill"][name]["tokens_per_s"] / prefill_floor,
    } for name in runners}
    # the first configuration's figures at the top level (what `parrot bench` reads); all of them by name
    result["by_config"] = {name: {k: result[k][name] for k in ("prefill", "decode", "ratios")} for name in runners}
    first = result["configs"][0]
    for k in ("prefill", "decode", "ratios"):
        result[k] = result[k][first]
    if kernels.available():
        kernels.use_build(None)
    if default_path:
        kernels.use_matmul(default_path)
    kernels.use_bf16_fills(default_fills)
    kernels.use_decode_bf16(default_decode_bf16)
    kernels.use_tiled(True)
    kernels.use_team(default_team)
    kernels.use_avx2_int8(True)
    kernels.use_amx_few(True)
    return result


@contextlib.contextmanager
def _huge_pages(setting: str) -> Iterator[None]:
    """A runner's weights placed in huge pages (on, the default) or in XLA's own memory (off), see
    parrot.engine.huge_pages."""
    before = os.environ.get("PARROT_HUGE_PAGES")
    os.environ["PARROT_HUGE_PAGES"] = "0" if setting == "off" else before or "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PARROT_HUGE_PAGES"]
        else:
            os.environ["PARROT_HUGE_PAGES"] = before


def _matmul_path(name: str, select: object) -> str | None:
    select(name)  # type: ignore[operator]
    path = kernels.matmul_path()
    fills = kernels.bf16_fills()
    return f"{path}, fills on {fills}" if fills else path


def _decode_attention(name: str, select: object) -> str:
    select(name)  # type: ignore[operator]
    return "bf16 products" if kernels.decode_bf16() else "float32"


def _other_builds(specs: list[str], build_dir: Path) -> dict[str, str]:
    """LABEL=PATH -> {label: library}: a library as it is; a checkout or source built into `build_dir`."""
    builds = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--other-build takes LABEL=PATH, not {spec!r}")
        p = Path(path)
        if p.suffix == ".so":
            builds[label] = str(p)
            continue
        out = build_dir / f"{label}.so"
        t = time.perf_counter()
        kernels.build_library(out, p)
        print(f"built the kernels of {p} for this CPU in {time.perf_counter() - t:.1f} s: {out}", flush=True)
        builds[label] = str(out)
    return builds


def _fill_kv(r: ModelRunner, seed: int = 0) -> None:
    """Every page of the runner's KV pool written with normal random keys and values (stored as the cache
    stores them): decode attention then reads its pages from memory, as in serving, where pages never
    written are the operating system's one page of zeros, which stays in the CPU's caches."""
    rng = np.random.default_rng(seed)
    ks, vs = r.kv
    values = jnp.asarray(rng.standard_normal(ks[0].shape).astype(np.float32))  # one layer's values, reused

    def stored(storage: jnp.dtype) -> jax.Array:
        if storage == jnp.uint16:
            return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
        if storage == jnp.uint8:
            return jax.lax.bitcast_convert_type(attention.to_fp8(values), jnp.uint8)
        return values.astype(storage)

    copy = jax.jit(lambda x: x + jnp.zeros_like(x), out_shardings=ks[0].sharding)  # fresh memory each layer
    k, v = stored(ks[0].dtype), stored(vs[0].dtype)
    r.kv = (tuple(copy(k) for _ in ks), tuple(copy(v) for _ in vs))
    jax.block_until_ready(r.kv)


def _pipelined_ms(r: ModelRunner, batch: object, steps: int = 20) -> float:
    """Median ms per decode step dispatched back to back, the host waiting only at the end (as the engine's
    overlap runs a stable batch: step n+1 is launched before step n's tokens reach the host)."""
    times = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready([r.sample(r.forward(batch), None) for _ in range(steps)])
        times.append((time.perf_counter() - t) / steps * 1e3)
    return float(np.median(times))


def _loop_ms_per_token(r: ModelRunner, seqs: list[SequenceSlice], steps: int, calls: int = 5) -> float:
    """Median ms per decode step of `steps`-step decode loops (`ModelRunner.run_loop`, greedy), `calls` of them
    dispatched back to back and waited for at the end, as the engine chains a stable batch's loops."""
    b = len(seqs)
    params = [SamplingParams(max_tokens=steps)] * b
    shape = r.shapes.decode_shape(b, max(s.start for s in seqs) + steps)
    sampling = SamplingBatch.build(params, [0] * b, shape.batch, [0] * b)
    # the loop the engine runs: its sampler's parts named where the host names them (accelerators)
    shape = dataclasses.replace(shape, steps=steps, sampler=r.loop_stages(params) if r.host_stages else None)
    batch = build_batch(seqs, r.page_size, shape.tokens, shape.batch, shape.q_len, shape.pages)
    stops = np.full((shape.batch, MULTI_STOP_IDS), -1, np.int32)
    limit = np.where(np.arange(shape.batch) < b, steps, 0).astype(np.int32)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready([r.run_loop(shape, batch, sampling, stops, limit)[0] for _ in range(calls)])
        times.append((time.perf_counter() - t) / (calls * steps) * 1e3)
    return float(np.median(times))


def _weight_bytes(r: ModelRunner) -> int:
    """Bytes of the weights a decode step reads (quantized matrices at their stored size; a tied
    embedding, which is also the LM head, once; a matrix with a copy tiled for the VNNI code, `name_t`
    beside `name`, as that copy, which the decode products read instead)."""
    unique = {id(a): a for a in jax.tree.leaves(r.weights)}
    replaced = [r.weights.head.proj] if r.weights.head.tiled is not None else []

    def walk(d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif f"{k}_t" in d:
                replaced.append(v)

    for layer in r.weights.layers:
        walk(layer)
    for a in replaced:
        unique.pop(id(a), None)
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in unique.values())


def report(r: dict) -> str:
    fl = r["floors"]
    lines = [
        f"CPU {r['machine']}; model {Path(r['model']).name} ({r['params'] / 1e6:.1f}M params, {r['backend']}; "
        f"weights: prefill {r['prefill_weight_dtype']}, decode {r['decode_weight_dtype']}; activations "
        f"{r['activation_dtype']})",
        f"floors: read {fl['memory_read_gbs']:.1f} GB/s, fp32 GEMM {fl['gemm_fp32_gflops']:.0f} GFLOP/s; decode floor "
        f"{fl['weight_bytes'] / 1e6:.0f} MB / {fl['memory_read_gbs']:.1f} GB/s = {fl['decode_floor_ms']:.1f} ms/step, "
        f"prefill floor {fl['prefill_floor_tokens_per_s']:.0f} tok/s",
        f"load: read {r['load_read_s']:.2f} s; "
        + ", ".join(f"{k} {v:.2f} s" for k, v in r["load_s_by_config"].items())
        + f"; resident after the run {r['rss_gb']:.2f} GB",
        "weights a decode step reads: " + ", ".join(
            f"{k} {v / 1e6:.0f} MB ({r['weights_by_config'][k]})" for k, v in r["weight_bytes_by_config"].items()),
        "quantized products: " + ", ".join(f"{k} {v or 'XLA'}" for k, v in r["cpu_matmul_by_config"].items()),
        "decode attention (bfloat16 mode, bf16 cache): " + ", ".join(
            f"{k} {v}" for k, v in r["cpu_decode_attention_by_config"].items()),
    ]
    lines += [f"compile {k}: {v:.2f} s" for k, v in r["compile_s"].items()]
    for name, c in r["by_config"].items():
        p = c["prefill"]
        lines.append(f"[{name}] prefill {p['tokens']} tokens: {p['median_s']:.3f} s = {p['tokens_per_s']:.0f} tok/s "
                     f"({c['ratios']['prefill_fraction_of_floor']:.0%} of floor)")
        for batch, d in c["decode"].items():
            loop = (f"; loops of {d['loop_steps']} steps {d['loop_ms_per_token']:.2f} ms/step "
                    f"({r['loop_sampler']} sampler)" if "loop_steps" in d else "")
            lines.append(f"[{name}] decode {batch} (context {d['context']}): {d['ms_per_step']:.1f} ms/step = "
                         f"{d['tokens_per_s']:.0f} tok/s; pipelined {d['pipelined_ms_per_step']:.2f} ms/step{loop}")
        lines.append(f"[{name}] decode batch 1 is {c['ratios']['decode_batch_1_over_floor']:.2f}x the float32 floor")
        d = c["decode"]
        for batch in d:
            if batch != "batch_1" and "batch_1" in d:
                lines.append(f"[{name}] decode {batch} / batch_1: "
                             f"{d[batch]['ms_per_step'] / d['batch_1']['ms_per_step']:.2f}x the step time")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers-per-call", type=int, nargs="+", default=[1],
                    help="configurations measured side by side (0: the whole model in one call)")
    ap.add_argument("--weights", nargs="+", default=["auto"], choices=["auto", "f32", "bf16", "q8_0", "q4_1", "q4_0"],
                    help="weight settings measured side by side (auto: quantized files stay quantized)")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights of --model's shape (a preset such as llama-3-8b or smollm2-1.7b, "
                         "or a directory with a config.json)")
    ap.add_argument("--decode-attention", nargs="+", default=["auto"], choices=["auto", "xla", "kernel", "fused"],
                    help="decode attention per configuration (GPUs; see EngineConfig.decode_attention)")
    ap.add_argument("--cpu-matmul", nargs="+", default=["auto"],
                    choices=["auto", "amx", "amx-int8", "avx512-bf16", "avx512-vnni", "avx2"],
                    help="the native kernels' quantized product, side by side (amx: VNNI and the tile units where "
                         "the CPU has AMX, prompt fills on the bf16 tiles where it has AMX-BF16; amx-int8: every "
                         "row on the integer path; avx512-bf16: VNNI, prompt fills with AVX512-BF16's pair "
                         "products; avx512-vnni: every row as exact integer sums on VNNI; avx2: the vector "
                         "code); a code the CPU lacks runs as the best it has")
    ap.add_argument("--kv-dtype", nargs="+", default=["auto"], choices=["auto", "f32", "bf16", "fp8", "bf16:fp8"],
                    help="KV cache element types measured side by side (a runner each; see EngineConfig.kv_dtype; "
                         "bf16:fp8: bfloat16 keys, float8 values)")
    ap.add_argument("--kv-fill", choices=["unwritten", "random"], default="unwritten",
                    help="the KV pool's pages before timing: unwritten (zeros; on a CPU pages never written are "
                         "the OS's one zero page, read from the caches) or random (every page written: decode "
                         "attention reads memory, as in serving)")
    ap.add_argument("--cpu-decode-attention", nargs="+", default=["auto"], choices=["auto", "bf16", "f32"],
                    help="decode attention's products on a CPU in the bfloat16 mode, side by side (bf16: bfloat16 "
                         "pairs where the CPU has AVX512-BF16; f32: float32)")
    switches = {  # on/off settings measured side by side in one process
        "--cpu-tiled": "the products of few rows reading the weights' copy tiled for VNNI's lanes (on) or the GGUF "
                       "rows (off; the same results)",
        "--cpu-team": "a decode step's kernel calls on the kernels' own hot helper threads (on) or XLA's intra-op "
                      "pool (off)",
        "--cpu-avx2-int8": "the AVX2 code's generated rows on 2 limbs in integer sums (on: the VNNI code's bits) or "
                           "in float32 (off)",
        "--cpu-amx-few": "on a CPU with AMX, decode products of 5-15 rows on the tiles (on: every limb a tile row "
                         "at 5-8 rows, the tiled copy's tiles from 9) or on VNNI below 16 rows (off; the same results)",
        "--huge-pages": "the weights in transparent huge pages (on) or in XLA's own memory (off; a runner each, the "
                        "same results)",
    }
    for flag, text in switches.items():
        ap.add_argument(flag, nargs="+", default=["on"], choices=["on", "off"], help=text)
    ap.add_argument("--loop-steps", type=int, default=0, metavar="K",
                    help="also time decode loops of K steps a call (multi-step decode, as the engine runs a stable "
                         "batch), per step")
    ap.add_argument("--other-build", action="append", default=[], metavar="LABEL=PATH",
                    help="another build of the native kernels measured beside this one: a library, or a checkout "
                         "(or its cpu_kernels.cc) built first for this CPU (repeatable)")
    ap.add_argument("--out", default="benchmarks/results/engine_micro.json")
    args = ap.parse_args()
    builds = _other_builds(args.other_build, Path(args.out).with_suffix(".builds"))
    r = run(args.model, args.prompt_len, args.decode_context, args.batches, args.repeats, args.layers_per_call,
            args.weights, args.load_format, args.decode_attention, args.cpu_matmul, args.cpu_decode_attention,
            args.cpu_tiled, args.cpu_team, args.huge_pages, args.cpu_avx2_int8, args.loop_steps, args.cpu_amx_few,
            builds, args.kv_dtype, args.kv_fill)
    print(report(r))
    write_json(r, args.out)


if __name__ == "__main__":
    main()
