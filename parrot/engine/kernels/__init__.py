"""Native CPU kernels (cpu_kernels.cc), compiled on first use for this machine's CPU and called from
jitted code through XLA's FFI.

The shared library is built with the system's C++ compiler (`-O3 -march=native`; `PARROT_KERNEL_MARCH=haswell`
builds and runs what an AVX2-only CPU would, on any x86-64 CPU with AVX2) into
`~/.cache/parrot/kernels/` (or `$PARROT_KERNEL_DIR`), named by a hash of the source, the compiler flags,
the jaxlib version and the CPU's flags, so a source change, a jaxlib upgrade or another CPU builds anew
(once: processes starting at once wait for one build). Where
they cannot be used (no compiler, a CPU without AVX2/FMA/F16C, not a CPU backend, or
`PARROT_CPU_KERNELS=0`), `available()` is False, one warning says why, and callers take their XLA path.

The quantized product has three codes: "avx2" (vector code, every CPU the kernels run on; generated rows
asked for on 2 limbs in the integer sums of the VNNI code, the same bits, avx2_int8.h, unless
`PARROT_AVX2_INT8=0` or `use_avx2_int8(False)`), "avx512-vnni"
(exact integer sums on AVX-512 VNNI for any number of rows, vnni_matmul.h: Intel since Cascade Lake, AMD
since Zen 4) and "amx-int8" (VNNI for a few rows, AMX's integer tiles for more, amx_matmul.h: Intel since
Sapphire Rapids). The best the CPU has runs unless `PARROT_CPU_MATMUL` names another; `matmul_path()`
says which runs, `matmul_paths()` which the CPU can run, and `use_matmul()` switches at run time (the
compiled steps call the same FFI target either way). The rows asked for in bfloat16
(`qmatmul(..., fill=...)`: prompt tokens, where the engine fills prompts in bfloat16) run on
AMX's bf16 tiles (amx_bf16.h) where the AMX path is on and the CPU has AMX-BF16 (`bf16_tiles()`), or with
AVX512-BF16's pair products (avx512_bf16.h) where an integer path runs on a CPU without them
(`bf16_fills()` says which), unless `PARROT_BF16_FILLS=0` (or `PARROT_AMX_BF16=0`, or
`use_bf16_fills(False)`): then they run exactly. Decode attention asked for
in bfloat16 (`paged_decode(..., bf16=True)`: the engine's bfloat16 mode) multiplies bfloat16 pairs on
AVX512-BF16 (decode_bf16.h) unless `PARROT_DECODE_BF16=0` (or `use_decode_bf16(False)`).

`other_build(path)` routes the kernel calls traced inside it to another build of the library (one made for
an AVX2-only CPU, say, or of other code): tests run the AVX2-only build's code on any CPU this way, and two
builds can be compared in one process.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from parrot import procinfo

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
HEADERS = tuple(Path(__file__).with_name(h) for h in ("aligned.h", "vnni_matmul.h", "amx_matmul.h", "amx_bf16.h",
                                                     "avx512_bf16.h", "decode_bf16.h", "prefill_attention.h",
                                                     "sampler.h", "logprobs.h", "team.h", "tiled_rows.h",
                                                     "avx2_int8.h", "decode_pairs.h"))
FILL_PATHS = (None, "amx-bf16", "avx512-bf16")  # parrot_bf16_enable's answers 0, 1, 2
MATMUL_PATHS = ("avx2", "avx512-vnni", "amx-int8")  # parrot_matmul_select's codes 0, 1, 2
_REQUIRED_FLAGS = ("avx2", "fma", "f16c")
_TARGETS = {"parrot_qmatmul": "ParrotQMatmul", "parrot_paged_decode": "ParrotPagedDecode",
            "parrot_paged_prefill": "ParrotPagedPrefill", "parrot_lazy_zeros": "ParrotLazyZeros",
            "parrot_release_pages": "ParrotReleasePages",
            "parrot_sample": "ParrotSample", "parrot_logprobs": "ParrotLogprobs",
            "parrot_qmatmul_pick": "ParrotQMatmulPick", "parrot_paged_decode_pick": "ParrotPagedDecodePick",
            "parrot_rope_kv_pick": "ParrotRopeKvPick"}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str, "lib": ctypes.CDLL
_others: dict[str, ctypes.CDLL] = {}  # other builds (`use_build`) by their targets' suffix
_others_paths: dict[str, list[str]] = {}  # their product codes (as _state["paths"])
_route = threading.local()  # .suffix: the build that kernel calls traced on this thread go to ("": this one)


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def source_hash() -> str:
    """Identifies the kernels' code and ABI (part of the compilation-cache namespace)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in (SOURCE, *HEADERS))).hexdigest()[:12]


def _library_path() -> Path:
    base = Path(os.environ.get("PARROT_KERNEL_DIR") or Path.home() / ".cache" / "parrot" / "kernels")
    key = f"{source_hash()}|{jaxlib.__version__}|{_cpu_flags()}|{' '.join(_cxxflags())}"
    return base / f"cpu_kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


# hidden by default: the library exports its entry points alone (cpu_kernels.cc), so a second build loaded in
# the same process (`use_build`) shares no state with the first
CXXFLAGS = ("-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-fPIC", "-fvisibility=hidden")
# The translation units the library is built from, compiled at once (cpu_kernels.cc: PARROT_PART_*). The
# products of each block type take most of the compile time (~8 s each on a 2-core Xeon, the rest ~9 s, and
# each unit ~4 s of its own): on 2-3 cores two units (32.7 s -> 19.5 s on that Xeon), from 4 cores four.


def _cxxflags(march: str | None = None) -> tuple[str, ...]:
    """CXXFLAGS for `-march=march`; by default the flags this process builds its library with, for
    `-march=$PARROT_KERNEL_MARCH` where set (e.g. `haswell`: the build an AVX2-only CPU makes, run on this one
    to test that CPU's code paths)."""
    march = march or os.environ.get("PARROT_KERNEL_MARCH", "native")
    return tuple(f"-march={march}" if f == "-march=native" else f for f in CXXFLAGS)


UNITS = {1: (("Q8_0", "Q4_0", "Q4_1", "REST"),),
         2: (("Q8_0", "Q4_0"), ("Q4_1", "REST")),
         4: (("Q8_0",), ("Q4_0",), ("Q4_1",), ("REST",))}


def _units() -> tuple[tuple[str, ...], ...]:
    """The units for the cores this process may run on."""
    cores = procinfo.usable_cores()
    return UNITS[max(n for n in UNITS if n <= cores)]


STALE_BUILD_S = 3600  # a build directory this old was left by a process that died while building


def _remove_stale_builds(directory: Path) -> None:
    """Remove build directories (and files) that processes killed while building left behind."""
    now = time.time()
    for entry in directory.glob(".build-*"):
        try:
            if now - entry.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        except OSError:  # another process removed it, or cannot: harmless
            pass


# Runs its arguments as a command that gets SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG,
# kept across exec), or exits at once if that thread is already gone. A launcher process rather than a
# preexec_fn: Python forks (instead of vfork) for a preexec_fn, which JAX warns against in its processes.
_LAUNCH = ("import ctypes, os, sys\n"
           "parent = os.getppid()\n"
           "ctypes.CDLL(None).prctl(1, 9)\n"
           "if os.getppid() != parent:\n"
           "    sys.exit(1)\n"
           "os.execvp(sys.argv[1], sys.argv[1:])\n")


def _die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that it ends with the thread that starts it (Linux; elsewhere `cmd` as it is): a server
    killed mid-build, even by SIGKILL, leaves no compiler running."""
    return [sys.executable, "-c", _LAUNCH, *cmd] if sys.platform.startswith("linux") else cmd


def _build(path: Path, units: tuple[tuple[str, ...], ...] | None = None, source: Path | None = None,
           flags: tuple[str, ...] | None = None) -> None:
    """Compile the units (default: UNITS for this machine's cores) of `source` (default: SOURCE) with `flags`
    (default: `_cxxflags()`) side by side into a temporary directory, link them, and rename the library into place
    (processes may build concurrently)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(path.parent)
    units = units or _units()
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        cmds = [[compiler, *(flags or _cxxflags()), *(f"-DPARROT_PART_{p}=1" for p in parts),
                 f"-I{jax.ffi.include_dir()}", "-c", str(source or SOURCE), "-o", str(Path(tmp) / f"unit{i}.o")]
                for i, parts in enumerate(units)]
        link = [compiler, "-shared", *(c[-1] for c in cmds), "-o", str(Path(tmp) / "cpu_kernels.so")]
        logs = [Path(tmp) / f"unit{i}.log" for i in range(len(cmds))]  # files: a full pipe would stall a unit
        procs = []
        try:
            for cmd, log_path in zip(cmds, logs, strict=True):
                with open(log_path, "w") as err:
                    procs.append(subprocess.Popen(_die_with_parent(cmd), stdout=subprocess.DEVNULL, stderr=err))
            codes = [p.wait(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        done = [(c, log_path.read_text(errors="replace"), code) for c, log_path, code in zip(cmds, logs, codes,
                                                                                             strict=True)]
        if all(code == 0 for _, _, code in done):
            linked = subprocess.run(_die_with_parent(link), capture_output=True, text=True, timeout=300)
            done.append((link, linked.stderr, linked.returncode))
        for cmd, stderr, code in done:
            if code:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-2000:]}")
        os.replace(Path(tmp) / "cpu_kernels.so", path)


def _register(path: Path, suffix: str) -> ctypes.CDLL:
    """Load a build of the kernels, register its FFI targets under their names + `suffix`, and declare its
    switches' C signatures."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target + suffix, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    for switch in ("parrot_matmul_select", "parrot_decode_bf16_enable", "parrot_team_enable", "parrot_tiled_enable",
                   "parrot_amx_few_enable", "parrot_avx2_int8_enable", "parrot_bf16_enable"):
        getattr(lib, switch).argtypes = [ctypes.c_int]
    lib.parrot_tile_rows.restype = ctypes.c_int64
    lib.parrot_tile_rows.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def _ffi_call(target: str, *args: object, **kwargs: object):  # noqa: ANN202
    """jax.ffi.ffi_call of one of the kernels' targets, in this process's build or the one `other_build` names."""
    return jax.ffi.ffi_call(target + getattr(_route, "suffix", ""), *args, **kwargs)


def use_build(path: str | Path | None) -> ctypes.CDLL:
    """From now on, the kernel calls traced on this thread go to the library at `path`, another build of these
    kernels (one made for another CPU's flags, or of other code: `build_library`), for a comparison in one
    process; None: this process's own build again. A function jitted before keeps the build it was traced
    with. The other build's targets are registered once, under a suffix of their own, its best product code
    chosen and its other switches as built; the weights' tiled copies made meanwhile (`tile_rows`) are its
    own, and the switches below (`matmul_path`, `use_matmul`, `use_tiled`, ...) read and set its. Returns the
    library now in use. Needs this process's own build (`available()`)."""
    if not available():
        raise RuntimeError(f"the native CPU kernels are unavailable: {unavailable_reason()}")
    if path is None:
        _route.suffix = ""
        return _state["lib"]
    path = Path(path).resolve()
    suffix = "_build_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    with _lock:
        if suffix not in _others:
            _others[suffix] = _register(path, suffix)
            _others_paths[suffix] = list(MATMUL_PATHS[: _others[suffix].parrot_matmul_select(-1) + 1])
    _route.suffix = suffix
    return _others[suffix]


def _routed_lib() -> ctypes.CDLL:
    """The build in use on this thread (`use_build`), whose switches the functions below read and set."""
    suffix = getattr(_route, "suffix", "")
    return _others[suffix] if suffix else _state["lib"]


def _routed_paths() -> list[str]:
    suffix = getattr(_route, "suffix", "")
    return _others_paths[suffix] if suffix else _state["paths"]


@contextlib.contextmanager
def other_build(path: str | Path) -> Iterator[ctypes.CDLL]:
    """`use_build(path)` inside, the build in use before it after; yields the library."""
    before = getattr(_route, "suffix", "")
    try:
        yield use_build(path)
    finally:
        _route.suffix = before


def build_library(out: str | Path, source: str | Path | None = None, march: str = "native") -> Path:
    """Build the kernels' library into `out` from `source` (a checkout's root, or its cpu_kernels.cc; default:
    this one) for `-march=march`, as the first start builds this one (`use_build` runs it beside it)."""
    src = Path(source).resolve() if source is not None else SOURCE
    if src.is_dir():
        src = src / "parrot" / "engine" / "kernels" / "cpu_kernels.cc"
    if not src.is_file():
        raise FileNotFoundError(f"no kernels' source at {src}")
    out = Path(out).resolve()
    text = src.read_text()
    flags = tuple(f for f in _cxxflags(march)
                  if f != "-fvisibility=hidden" or "visibility push(default)" in text)  # older code exports all
    # a source without the units' macros builds whole in each unit: one unit then
    _build(out, None if "PARROT_PART_REST" in text else UNITS[1], src, flags)
    return out


def _build_once(path: Path, build: Callable[[Path], None] | None = None) -> None:
    """Build the library at `path` unless it is there, one process (or thread) at a time: others starting at
    once (`parrot serve --engines N`, test workers) wait for its build and load it instead of building too."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():
            return
        t0 = time.perf_counter()
        log.info("building the native CPU kernels for this CPU with %d unit(s) side by side (once for this "
                 "machine, source and jaxlib: ~20 s on 2 cores)", len(_units()))
        (build or _build)(path)
        log.info("native CPU kernels built in %.1f s: %s", time.perf_counter() - t0, path)


def _load() -> None:
    if os.environ.get("PARROT_CPU_KERNELS", "1") == "0":
        raise RuntimeError("turned off by PARROT_CPU_KERNELS=0")
    if jax.default_backend() != "cpu":
        raise RuntimeError(f"the backend is {jax.default_backend()}, not cpu")
    flags = set(_cpu_flags().split())
    missing = [f for f in _REQUIRED_FLAGS if f not in flags]
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing)}")
    path = _library_path()
    _build_once(path)
    lib = _register(path, "")
    _state["lib"] = lib
    wanted = os.environ.get("PARROT_CPU_MATMUL", "auto")
    if wanted != "auto" and wanted not in MATMUL_PATHS:
        raise RuntimeError(f"PARROT_CPU_MATMUL={wanted!r} is not one of auto, {', '.join(MATMUL_PATHS)}")
    best = lib.parrot_matmul_select(-1)
    _state["paths"] = list(MATMUL_PATHS[: best + 1])  # every code up to the best one runs on this CPU
    if wanted != "auto" and wanted not in _state["paths"]:
        log.warning("PARROT_CPU_MATMUL=%s: this CPU cannot run it; using %s", wanted, MATMUL_PATHS[best])
    elif wanted != "auto":
        lib.parrot_matmul_select(MATMUL_PATHS.index(wanted))
    lib.parrot_decode_bf16_enable(0 if os.environ.get("PARROT_DECODE_BF16", "1") == "0" else 1)
    lib.parrot_team_enable(0 if os.environ.get("PARROT_KERNEL_TEAM", "1") == "0" else 1)
    lib.parrot_avx2_int8_enable(0 if os.environ.get("PARROT_AVX2_INT8", "1") == "0" else 1)
    fills_off = "0" in (os.environ.get("PARROT_BF16_FILLS", "1"), os.environ.get("PARROT_AMX_BF16", "1"))
    lib.parrot_bf16_enable(0 if fills_off else 1)


def available() -> bool:
    """Whether the native kernels can be used in this process (built and registered on first call)."""
    with _lock:
        if "ok" not in _state:
            try:
                _load()
                _state["ok"] = True
            except Exception as exc:  # noqa: BLE001 - any failure means: use the XLA path
                _state["ok"], _state["why"] = False, str(exc)
                log.warning("native CPU kernels unavailable (%s); using XLA's kernels", exc)
        return bool(_state["ok"])


def trace_state() -> str:
    """What kernel calls traced on this thread depend on: the build they go to and its switches (a compiled
    executable is kept on disk under it, executable_cache.py)."""
    if not available():
        return f"unavailable: {unavailable_reason()}"
    lib = _routed_lib()
    switches = [lib.parrot_matmul_select(-2)] + [  # -2 and -1: read, not set
        getattr(lib, name)(-1) for name in ("parrot_bf16_enable", "parrot_decode_bf16_enable", "parrot_team_enable",
                                            "parrot_tiled_enable", "parrot_amx_few_enable", "parrot_avx2_int8_enable")]
    return repr((getattr(_route, "suffix", ""), _routed_paths(), switches))


def unavailable_reason() -> str | None:
    return None if available() else str(_state.get("why"))


def matmul_path() -> str | None:
    """Which code multiplies quantized matrices: "amx-int8" (tiles and VNNI), "avx512-vnni", "avx2", or None
    (XLA)."""
    if not available():
        return None
    return MATMUL_PATHS[_routed_lib().parrot_matmul_select(-2)]


def matmul_paths() -> list[str]:
    """The codes this CPU can multiply quantized matrices with (none where the kernels are unavailable)."""
    return list(_routed_paths()) if available() else []


def bf16_fills() -> str | None:
    """How products asked for in bfloat16 (prompt rows) are multiplied: "amx-bf16" (AMX's bf16 tiles),
    "avx512-bf16" (AVX512-BF16's pair products), or None (exactly, as generated rows)."""
    return FILL_PATHS[_routed_lib().parrot_bf16_enable(-1)] if available() else None


def bf16_tiles() -> bool:
    """Whether products asked for in bfloat16 run on AMX's bf16 tiles (the prefill attention of the bfloat16
    mode uses them too)."""
    return bf16_fills() == "amx-bf16"


def decode_bf16() -> bool:
    """Whether decode attention asked for in bfloat16 multiplies bfloat16 pairs (AVX512-BF16; else float32)."""
    return available() and bool(_routed_lib().parrot_decode_bf16_enable(-1))


def use_decode_bf16(on: bool) -> bool:
    """Turn decode attention's bfloat16 products on or off for this process; returns whether they are on
    (False where this build has no AVX512-BF16)."""
    return available() and bool(_routed_lib().parrot_decode_bf16_enable(1 if on else 0))


def use_tiled(on: bool) -> bool:
    """Whether the quantized products read the tiled copies they are given (on, the default) or their GGUF
    rows alone (a same-process comparison: the results are the same bits); returns whether they do."""
    return available() and bool(_routed_lib().parrot_tiled_enable(1 if on else 0))


def use_amx_few(on: bool) -> bool:
    """Whether the AMX path multiplies 5-15 generated rows on its tiles (on, the default: every limb a tile
    row from 5 to 8 rows, the tiled copy's tiles from 9) or on VNNI below 16 rows (off; a same-process
    comparison: the results are the same bits); returns whether it does."""
    return available() and bool(_routed_lib().parrot_amx_few_enable(1 if on else 0))


def avx2_int8() -> bool:
    """Whether the AVX2 code multiplies generated rows asked for on 2 limbs in integers (see `use_avx2_int8`)."""
    return available() and bool(_routed_lib().parrot_avx2_int8_enable(-1))


def use_avx2_int8(on: bool) -> bool:
    """Whether the AVX2 code multiplies generated rows asked for on 2 limbs (the bfloat16 mode) in exact
    integer sums, the VNNI code's bits (on, the default; `PARROT_AVX2_INT8=0` starts a
    process with it off), or in float32 with the dequantized weights (off); returns whether it does."""
    return available() and bool(_routed_lib().parrot_avx2_int8_enable(1 if on else 0))


def team() -> bool:
    """Whether the kernels' own helper threads take a decode step's calls (see `use_team`)."""
    return available() and bool(_routed_lib().parrot_team_enable(-1))


def use_team(on: bool) -> bool:
    """Split the kernels' work over helper threads of their own, which stay hot between the calls of a
    step (on, the default; `PARROT_KERNEL_TEAM=0` starts a process with it off), or over XLA's intra-op
    pool; returns whether the team is on."""
    return available() and bool(_routed_lib().parrot_team_enable(1 if on else 0))


def use_bf16_fills(on: bool) -> str | None:
    """Turn the bfloat16 products of rows asked for in bfloat16 on or off (off: they run exactly, as
    generated rows do); returns bf16_fills() (None where this build or the code in use has none)."""
    if not available():
        return None
    with _lock:
        _routed_lib().parrot_bf16_enable(1 if on else 0)
    return bf16_fills()


def use_matmul(path: str) -> str | None:
    """Multiply quantized matrices with `path` ("auto": the best this CPU has) from now on, in this process;
    returns the code in use (unchanged where the CPU cannot run `path`)."""
    if not available():
        return None
    if path == "auto" or path in _routed_paths():
        with _lock:
            _routed_lib().parrot_matmul_select(-1 if path == "auto" else MATMUL_PATHS.index(path))
    return matmul_path()


# ---- calls (inside jitted functions) --------------------------------------------------------------
QTYPES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}


def qmatmul(x: jax.Array, w: jax.Array, qtype: str, fill: jax.Array | None = None, limbs: int = 3,
            tiled: jax.Array | None = None, swiglu: bool = False) -> jax.Array:
    """x [T, K] float32 @ W.T, W [N, K] stored as GGUF block rows (`w`: uint8 [N, K/32 * block bytes]).
    `fill` ([T]; positive: a prompt token's row): those rows with the weights and activations rounded to
    bfloat16 and the products summed in float32, on AMX's bf16 tiles where `bf16_tiles()` (decided at run
    time: elsewhere every row is exact). Each kind of row is computed apart from the other. Negative: a
    padding row; the trailing ones are not computed (their outputs are zeros). `limbs` (the
    integer paths, VNNI and AMX-INT8): 3 writes each activation to 23 bits below its block's largest, 2 to
    15 bits, which saves a third of the integer products (the engine's bfloat16 mode; float32 mode keeps 3).
    `tiled`: the same matrix as `tile_rows` lays it out, which the VNNI code reads for the products of few
    rows (the same results, less time); None: `w` alone. `swiglu`: W is a fused gate|up matrix (the gate's
    N / 2 rows, then the up's) and the result is silu(gate) * up, [T, N / 2] (on AMX's bf16 tiles, prompt
    rows' in the product's epilogue: the [T, N] product is never written)."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0] // 2 if swiglu else w.shape[0]), jnp.float32)
    fill = jnp.zeros(x.shape[0], jnp.int32) if fill is None else fill.astype(jnp.int32)
    tiled = jnp.zeros((0,), jnp.uint8) if tiled is None else tiled
    return _ffi_call("parrot_qmatmul", out)(x.astype(jnp.float32), w, tiled, fill,
                                            qtype=np.int32(QTYPES[qtype]), limbs=np.int32(limbs),
                                            swiglu=np.int32(swiglu))


def tile_rows(data: np.ndarray, qtype: str, k: int) -> np.ndarray | None:
    """A quantized [N, k] matrix's GGUF block rows (uint8 [N, k / 32 * block bytes]) laid out for the integer
    codes' lanes (tiled_rows.h, `tile_rows`: per 16 rows and block, their scales, then their weight bytes in
    the order the lanes take them): uint8 [bytes], for `qmatmul(..., tiled=...)`, which VNNI's products of
    few rows and the AVX2 code's generated rows on 2 limbs read. None where the kernels are not available,
    or `PARROT_TILED_WEIGHTS=0` (the products then read `data` alone: the same results)."""
    if not available() or os.environ.get("PARROT_TILED_WEIGHTS") == "0":
        return None
    lib, n, q = _routed_lib(), data.shape[0], QTYPES[qtype]
    size = lib.parrot_tile_rows(q, None, n, k, None)
    if size < 0:
        return None
    src = np.ascontiguousarray(data, dtype=np.uint8)
    out = np.empty(size, np.uint8)
    lib.parrot_tile_rows(q, src.ctypes.data, n, k, out.ctypes.data)
    return out


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
           u: jax.Array) -> jax.Array:
    """One token per row of logits [B, V] (int32 [B]): the argmax where temperature <= 0, else a draw with
    `u` ([B] in [0, 1)) by the inverse CDF over the tokens that top-k, min-p and top-p (renormalized over what
    those two keep) leave, weighted by exp(logits / temperature); sampling._choose's semantics (sampler.h)."""
    f32, i32 = jnp.float32, jnp.int32
    out = jax.ShapeDtypeStruct((logits.shape[0],), i32)
    return _ffi_call("parrot_sample", out)(logits.astype(f32), temperature.astype(f32), top_k.astype(i32),
                                           top_p.astype(f32), min_p.astype(f32), u.astype(f32))


def logprobs(logits: jax.Array, targets: jax.Array, want: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw log probabilities (log_softmax) of rows of logits [R, V]: at `targets` [R] (negative: token 0) and
    for the k most likely tokens, most likely first (the first of equal values first, as lax.top_k) ->
    (chosen [R], top_ids [R, k] int32, top_logprobs [R, k]); rows where `want` [R] is false get zeros
    (logprobs.h)."""
    r = logits.shape[0]
    out = (jax.ShapeDtypeStruct((r,), jnp.float32), jax.ShapeDtypeStruct((r, k), jnp.int32),
           jax.ShapeDtypeStruct((r, k), jnp.float32))
    return tuple(_ffi_call("parrot_logprobs", out)(logits.astype(jnp.float32), targets.astype(jnp.int32),
                                                   want.astype(jnp.int32)))


def lazy_zeros(shapes: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """Arrays of zeros of these shapes whose memory is resident only once written (the whole pages given
    back to the OS, which maps them as zeros on first touch): a KV pool costs memory in proportion to the
    pages used, as llama.cpp's does. Inside a jitted function, like the other calls."""
    return list(_ffi_call("parrot_lazy_zeros", shapes)())


def release_pages(release: jax.Array, caches: list[jax.Array]) -> list[jax.Array]:
    """The KV pool's `caches` ([Hkv, P, page_size, D] each) with the pages where `release` [P] (uint8) is 1 given
    back to the OS: the whole OS pages within a run of them (a 2 KiB page of one KV head shares its OS page with a
    neighbour) read as zeros again and take memory only once written, as `lazy_zeros`'s. Each cache is aliased to
    its result: jit it with the caches donated, and the call changes them in place."""
    out = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]
    aliases = {i + 1: i for i in range(len(caches))}
    return list(_ffi_call("parrot_release_pages", out, input_output_aliases=aliases)(release.astype(jnp.uint8),
                                                                                    *caches))


def paged_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_index: jax.Array, positions: jax.Array,
                  block_tables: jax.Array, kv_offset: jax.Array, kv_lens: jax.Array, scale: float,
                  bf16: bool = False) -> jax.Array:
    """The query tokens of a prefill step (q [T, H, D] flat; `q_index` [B, Q]: sequence b's query tokens, T
    where none) attending causally to their sequences' keys and values read in place from the paged caches
    ([Hkv, pages, page_size, D], float32 or bfloat16): key l of sequence b is at position kv_offset[b] + l
    (pages `block_tables[b]`), seen by a query at position p when it is <= p and < kv_lens[b]. Each token's
    result is the same whatever chunk or batch it is computed in. Returns [T, H, D], zeros for tokens no
    query names. `bf16` (prompts of the engine's bfloat16 mode): over a bfloat16 cache, with head sizes
    that are multiples of 32, the queries and probabilities are rounded to bfloat16 and multiplied on AMX's
    bf16 tiles where `bf16_tiles()` (decided at run time); elsewhere in float32."""
    i32 = jnp.int32
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return _ffi_call("parrot_paged_prefill", out)(
        q.astype(jnp.float32), k_cache, v_cache, q_index.astype(i32), positions.astype(i32),
        block_tables.astype(i32), kv_offset.astype(i32), kv_lens.astype(i32), scale=np.float32(scale),
        bf16=np.int32(1 if bf16 else 0))


def paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                 kv_offset: jax.Array, kv_lens: jax.Array, prefix_pages: jax.Array, prefix_len: jax.Array,
                 in_prefix: jax.Array, scale: float, bf16: bool = False) -> jax.Array:
    """One query per sequence (q [B, H, D]) attending to its KV read in place from the paged caches
    ([Hkv, pages, page_size, D], float32 or bfloat16): own pages `block_tables` from position `kv_offset` up to
    `kv_lens`, after the shared prefix `prefix_pages[:prefix_len]` where `in_prefix`. Returns [B, H, D].
    `bf16` (the engine's bfloat16 mode): over a bfloat16 cache, with head sizes that are multiples of 64, the
    scaled queries and the probabilities are rounded to bfloat16 and multiplied by AVX512-BF16's pair
    products where the CPU has them (`decode_bf16()`); elsewhere in float32."""
    i32 = jnp.int32
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if prefix_pages.shape[0] == 0:  # no shared prefix: one unread page (XLA 0.11's CPU compiler crashes on an
        prefix_pages = jnp.zeros((1,), i32)  # empty operand of a custom call inside shard_map)
    return _ffi_call("parrot_paged_decode", out)(
        q.astype(jnp.float32), k_cache, v_cache, block_tables.astype(i32), kv_offset.astype(i32),
        kv_lens.astype(i32), prefix_pages.astype(i32), jnp.reshape(prefix_len, (1,)).astype(i32),
        in_prefix.astype(i32), scale=np.float32(scale), bf16=np.int32(1 if bf16 else 0))


# ---- one layer's operands out of every layer's (a decode loop over its layers) --------------------------
def qmatmul_pick(x: jax.Array, layer: jax.Array, ws: list[jax.Array], tiled: list[jax.Array | None], qtype: str,
                 fill: jax.Array, limbs: int, swiglu: bool = False) -> jax.Array:
    """`qmatmul` with the weights `ws[layer]` (and `tiled[layer]`), `layer` a traced int32: every layer's
    matrix is an operand (XLA passes pointers; nothing is copied), so a loop over the layers holds one
    layer's code. The same products, the same bits as `qmatmul` on that layer's matrix."""
    out = jax.ShapeDtypeStruct((x.shape[0], ws[0].shape[0] // 2 if swiglu else ws[0].shape[0]), jnp.float32)
    none = jnp.zeros((0,), jnp.uint8)
    return _ffi_call("parrot_qmatmul_pick", out)(
        jnp.reshape(layer, (1,)).astype(jnp.int32), x.astype(jnp.float32), fill.astype(jnp.int32), *ws,
        *(none if t is None else t for t in tiled), qtype=np.int32(QTYPES[qtype]), limbs=np.int32(limbs),
        swiglu=np.int32(swiglu))


def paged_decode_pick(q: jax.Array, layer: jax.Array, ks: list[jax.Array], vs: list[jax.Array],
                      block_tables: jax.Array, kv_offset: jax.Array, kv_lens: jax.Array, prefix_pages: jax.Array,
                      prefix_len: jax.Array, in_prefix: jax.Array, scale: float, bf16: bool = False) -> jax.Array:
    """`paged_decode` over the caches `ks[layer]`, `vs[layer]` (see `qmatmul_pick`)."""
    i32 = jnp.int32
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if prefix_pages.shape[0] == 0:
        prefix_pages = jnp.zeros((1,), i32)
    return _ffi_call("parrot_paged_decode_pick", out)(
        jnp.reshape(layer, (1,)).astype(i32), q.astype(jnp.float32), block_tables.astype(i32),
        kv_offset.astype(i32), kv_lens.astype(i32), prefix_pages.astype(i32),
        jnp.reshape(prefix_len, (1,)).astype(i32), in_prefix.astype(i32), *ks, *vs, scale=np.float32(scale),
        bf16=np.int32(1 if bf16 else 0))


def rope_kv(qkv: jax.Array, cos: jax.Array, sin: jax.Array, slots: jax.Array, k_cache: jax.Array,
            v_cache: jax.Array, heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """models/llama.py's `qkv_heads` (RoPE of q and k) and attention.write_kv of k and v in one native pass:
    qkv [T, (heads + 2 Hkv) D] float32 -> (q [T, heads, D], the key cache, the value cache), the caches
    ([Hkv, pages, page_size, D]: float32, or uint16 bfloat16 bit patterns) updated in place (aliased). The
    same bits as XLA's code of them. (`rope_kv_pick` over this one layer.)"""
    q, ks, vs = rope_kv_pick(jnp.int32(0), qkv, cos, sin, slots, [k_cache], [v_cache], heads)
    return q, ks[0], vs[0]


def rope_kv_pick(layer: jax.Array, qkv: jax.Array, cos: jax.Array, sin: jax.Array, slots: jax.Array,
                 ks: list[jax.Array], vs: list[jax.Array],
                 heads: int) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """`rope_kv` over the caches `ks[layer]`, `vs[layer]` (every cache an operand aliased to its result; see
    `qmatmul_pick`): the same bits."""
    n = len(ks)
    caches = [*ks, *vs]
    outs = [jax.ShapeDtypeStruct((qkv.shape[0], heads, ks[0].shape[3]), jnp.float32),
            *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)]
    f32 = jnp.float32
    got = _ffi_call("parrot_rope_kv_pick", outs, input_output_aliases={5 + i: 1 + i for i in range(2 * n)})(
        jnp.reshape(layer, (1,)).astype(jnp.int32), qkv.astype(f32), cos.astype(f32), sin.astype(f32),
        slots.astype(jnp.int32), *caches, heads=np.int32(heads))
    return got[0], list(got[1 : 1 + n]), list(got[1 + n :])
