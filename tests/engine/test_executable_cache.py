"""Executables kept on disk by what they are built from: a second engine loads them instead of compiling and
computes the same tokens; a changed input, setting or kernel switch misses; bad entries and unusable
directories compile as if there were no cache."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parrot.engine import executable_cache
from parrot.engine.compile_cache import set_cache_dir
from parrot.engine.engine import LLMEngine
from parrot.engine.executable_cache import ExecutableCache
from parrot.protocol import SamplingParams
from tests.conftest import tiny_engine_config, tiny_model
from tests.engine.test_compile_cache import SCRIPT as COMPILE_SCRIPT


@pytest.fixture
def jax_cache(tmp_path: Path) -> Iterator[Path]:
    """JAX's persistent cache (and so this one) on in `tmp_path` for the test, then as it was."""
    before = jax.config.jax_compilation_cache_dir
    set_cache_dir(str(tmp_path))
    executable_cache._warned.clear()
    try:
        yield tmp_path
    finally:
        set_cache_dir(before)


def _fn() -> Callable:
    """A new function each time: JAX's in-memory caches never give its executable (such a one is not kept)."""
    def fn(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.tanh(x @ y) + 1

    return jax.jit(fn)


X = jax.ShapeDtypeStruct((4, 8), jnp.float32)
Y = jax.ShapeDtypeStruct((8, 3), jnp.float32)


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 8), np.float32), rng.standard_normal((8, 3), np.float32)


def _counts() -> tuple[int, int]:
    return executable_cache.stats["loaded"], executable_cache.stats["compiled"]


def test_a_second_cache_loads_what_the_first_kept(jax_cache: Path) -> None:
    x, y = _inputs()
    want = np.asarray(_fn()(x, y))
    loaded, compiled = _counts()
    first = ExecutableCache("ctx").compile("fn", _fn(), X, Y)
    assert _counts() == (loaded, compiled + 1)
    (entry,) = (jax_cache / executable_cache.SUBDIR).iterdir()
    second = ExecutableCache("ctx").compile("fn", _fn(), X, Y)
    assert _counts() == (loaded + 1, compiled + 1)
    np.testing.assert_array_equal(np.asarray(first(x, y)), want)
    np.testing.assert_array_equal(np.asarray(second(x, y)), want)
    assert [p.name for p in (jax_cache / executable_cache.SUBDIR).iterdir()] == [entry.name]


def test_another_input_context_setting_or_kernel_switch_misses(jax_cache: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ExecutableCache("ctx")
    keys = {cache.key("fn", (X, Y), {})}
    keys.add(cache.key("fn", (jax.ShapeDtypeStruct((5, 8), jnp.float32), Y), {}))  # a shape
    keys.add(cache.key("fn", (jax.ShapeDtypeStruct((4, 8), jnp.bfloat16), Y), {}))  # a dtype
    keys.add(cache.key("fn", (X, Y), {"steps": 4}))  # a static argument
    keys.add(cache.key("other", (X, Y), {}))  # another function
    keys.add(ExecutableCache("another model").key("fn", (X, Y), {}))
    keys.add(ExecutableCache("ctx", trace_state=lambda: "another build").key("fn", (X, Y), {}))
    monkeypatch.setenv("PARROT_SOME_SWITCH", "0")
    keys.add(ExecutableCache("ctx").key("fn", (X, Y), {}))
    monkeypatch.delenv("PARROT_SOME_SWITCH")
    with jax.default_matmul_precision("highest"):
        keys.add(ExecutableCache("ctx").key("fn", (X, Y), {}))
    assert len(keys) == 9
    assert ExecutableCache("ctx").key("fn", (X, Y), {}) == cache.key("fn", (X, Y), {})  # and nothing else


def test_an_entry_that_does_not_load_is_compiled_again_and_rewritten(jax_cache: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    x, y = _inputs()
    ExecutableCache("ctx").compile("fn", _fn(), X, Y)
    (entry,) = (jax_cache / executable_cache.SUBDIR).iterdir()
    good = entry.read_bytes()
    for bad in (b"garbage", good[: len(good) // 2]):
        entry.write_bytes(bad)
        loaded, compiled = _counts()
        with caplog.at_level(logging.WARNING, logger="parrot.engine.executable_cache"):
            got = ExecutableCache("ctx").compile("fn", _fn(), X, Y)
        assert _counts() == (loaded, compiled + 1)
        np.testing.assert_array_equal(np.asarray(got(x, y)), np.asarray(_fn()(x, y)))
        loaded, compiled = _counts()
        again = ExecutableCache("ctx").compile("fn", _fn(), X, Y)  # written again: read now
        assert _counts() == (loaded + 1, compiled)
        np.testing.assert_array_equal(np.asarray(again(x, y)), np.asarray(got(x, y)))
    assert len([r for r in caplog.records if "does not load" in r.message]) == 1  # one warning for all


def test_an_executable_from_jaxs_memory_is_not_kept(jax_cache: Path) -> None:
    """One compiled before in this process comes from JAX's in-memory cache, maybe read from its disk cache
    then: its serialization may lack its compiled functions, so it is not written."""
    fn = _fn()
    x, y = _inputs()
    fn(x, y)  # compiled (and cached in memory) by the call
    got = ExecutableCache("ctx").compile("fn", fn, X, Y)
    np.testing.assert_array_equal(np.asarray(got(x, y)), np.asarray(fn(x, y)))
    assert not (jax_cache / executable_cache.SUBDIR).exists()


def test_without_jax_cache_nothing_is_kept(tmp_path: Path) -> None:
    before = jax.config.jax_compilation_cache_dir
    set_cache_dir(None)
    try:
        loaded, compiled = _counts()
        ExecutableCache("ctx").compile("fn", _fn(), X, Y)
        assert _counts() == (loaded, compiled + 1)
        assert ExecutableCache.directory() is None
    finally:
        set_cache_dir(before)


def test_an_unwritable_directory_warns_once_and_compiles(jax_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    (jax_cache / executable_cache.SUBDIR).write_text("a file where the directory would be")
    x, y = _inputs()
    with caplog.at_level(logging.WARNING, logger="parrot.engine.executable_cache"):
        for _ in range(2):
            got = ExecutableCache("ctx").compile("fn", _fn(), X, Y)
            np.testing.assert_array_equal(np.asarray(got(x, y)), np.asarray(_fn()(x, y)))
    assert len([r for r in caplog.records if "cannot be written" in r.message]) == 1


def test_a_second_engine_loads_every_executable_and_computes_the_same_tokens(jax_cache: Path) -> None:
    cfg = tiny_engine_config(compilation_cache_dir=str(jax_cache), token_buckets=[32], bs_buckets=[1, 2],
                             max_batch_size=2, kv_buckets=[64], max_num_batched_tokens=32, prefill_bs_buckets=[1],
                             shared_prefix_attention=False, multi_step=4, multi_step_max_batch=2)
    prompts = [list(range(3, 30)), list(range(40, 52))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    runs = []
    for _ in range(2):
        loaded, compiled = _counts()
        engine = LLMEngine(tiny_model(), cfg).start(precompile=True)
        try:
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # decoded side by side
                outs = list(pool.map(lambda p, e=engine: e.complete(p, params), prompts))
            kept = sorted(p.name.split("-")[0] for p in ExecutableCache.directory().iterdir())  # (namespaced)
            runs.append(([o.response.token_ids for o in outs], _counts()[0] - loaded, _counts()[1] - compiled, kept))
        finally:
            engine.shutdown()
    (tokens, loads, compiles, kept), (tokens2, loads2, compiles2, kept2) = runs
    assert loads == 0 and compiles > 0
    # every executable the first engine kept is read back; the ones it did not keep came from JAX's in-memory
    # cache (functions shared by engines, compiled by an earlier test in this process) and compile again
    # (and may keep them then, where those caches have dropped them)
    assert loads2 == len(kept) and compiles2 == compiles - len(kept) and set(kept) <= set(kept2)
    assert {"block1", "decode_loop", "embed", "head"} <= set(kept)  # the model's own executables, all read back
    assert tokens2 == tokens
    assert all(len(t) == 10 for t in tokens)


# test_compile_cache's script (a tiny engine, one shape of each kind), printing how many executables it read from
# this cache and compiled as well as its greedy tokens
_PRINT = "print(json.dumps(out.response.token_ids))"
assert _PRINT in COMPILE_SCRIPT
SCRIPT = "from parrot.engine import executable_cache\n" + COMPILE_SCRIPT.replace(
    _PRINT, "print(json.dumps([out.response.token_ids, executable_cache.stats]))")


def _run(cache: Path) -> tuple[list[int], dict[str, int]]:
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens, stats = json.loads(proc.stdout.strip().splitlines()[-1])
    return tokens, stats


def test_executables_jax_read_from_its_own_cache_are_kept_whole(tmp_path: Path) -> None:
    """A start that finds JAX's entries but not these (a cache from before, or these removed) keeps the bytes JAX
    read: re-serialized, such an executable would lack its compiled functions and fail at its first call."""
    cache = tmp_path / "cache"
    reference, stats = _run(cache)  # cold: both caches written
    assert stats["loaded"] == 0 and stats["compiled"] > 0
    (kept,) = cache.glob(f"*/{executable_cache.SUBDIR}")
    shutil.rmtree(kept)
    tokens, stats = _run(cache)  # JAX's entries read, these written from them
    assert tokens == reference and stats["loaded"] == 0
    tokens, again = _run(cache)  # these read
    assert tokens == reference
    assert again == {"loaded": stats["compiled"], "compiled": 0}
