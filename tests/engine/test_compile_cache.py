"""The persistent compilation cache: an unusable directory or bad entries give a warning and a normal
compile, never a crash or a different result."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parrot.engine.compile_cache import enable_compilation_cache, fingerprint

ROOT = Path(__file__).resolve().parents[2]

# a tiny engine with one shape of each kind compiled through the cache; prints its greedy tokens as JSON
SCRIPT = """
import json, sys
from parrot.engine.engine import LLMEngine
from parrot.protocol import SamplingParams
from tests.conftest import tiny_engine_config, tiny_model
cfg = tiny_engine_config(compilation_cache_dir=sys.argv[1], token_buckets=[32], bs_buckets=[1],
                         max_batch_size=1, kv_buckets=[64], max_num_batched_tokens=32,
                         prefill_bs_buckets=[1], shared_prefix_attention=False)
engine = LLMEngine(tiny_model(), cfg).start(precompile=True)
out = engine.complete(list(range(3, 30)), SamplingParams(max_tokens=12, ignore_eos=True))
engine.shutdown()
print(json.dumps(out.response.token_ids))
"""


def _run(cache: Path) -> tuple[list[int], str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep what is there
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_unusable_directory_warns_once_and_compiles(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="parrot.engine.compile_cache"):
        assert enable_compilation_cache(str(blocker / "cache")) is None
    assert [r.message for r in caplog.records if "not usable" in r.message][0].count("\n") == 0


def test_entries_are_namespaced_by_versions_and_cpu(tmp_path: Path) -> None:
    assert fingerprint() == fingerprint() and fingerprint().startswith("jax")


def test_corrupt_truncated_and_foreign_entries_recompile(tmp_path: Path) -> None:
    """Garbage and half-written entries are recompiled (same tokens, one warning line at most); entries
    another JAX build or CPU wrote live in another namespace and are never read."""
    cache = tmp_path / "cache"
    reference, _ = _run(cache)
    (namespace,) = [d for d in cache.iterdir() if d.is_dir()]
    entries = sorted(p for p in namespace.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(entries) >= 3, entries
    foreign = cache / "jax0.0.0-000000000000"  # what another version or CPU would have written
    foreign.mkdir()
    for i, p in enumerate(entries):
        (foreign / p.name).write_bytes(os.urandom(100))
        p.write_bytes(os.urandom(200) if i % 2 else p.read_bytes()[: p.stat().st_size // 2])
    tokens, stderr = _run(cache)
    assert tokens == reference
    assert stderr.count("cannot be read or written") == 1
    assert all(len(p.read_bytes()) == 100 for p in foreign.iterdir())  # untouched
    # the unreadable entries were removed and written again: the next start reads them all
    tokens, stderr = _run(cache)
    assert tokens == reference and "cannot be read or written" not in stderr, stderr[-2000:]
    assert {p.name for p in namespace.rglob("*-cache")} >= {p.name for p in entries if p.name.endswith("-cache")}
