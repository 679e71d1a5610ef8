"""decode_attention times the real kernel on a real step: its step equals attention computed here from the same
pages, and another build runs beside this one."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from benchmarks import decode_attention
from parrot.engine import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native CPU kernels unavailable")


def _floats(cache: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32 numbers."""
    return (cache.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize(("dtype", "placement"), [("bf16", "random"), ("f32", "random"), ("bf16", "runs")])
def test_the_step_is_attention_over_each_layers_pages(dtype: str, placement: str) -> None:
    # 40 tokens: two whole pages of 16 and a part of the third (the kernel's tail loops)
    batch, context, layers, heads, kv_heads, d, page = 3, 40, 2, 4, 2, 64, 16
    step, (q, ks, vs), tables = decode_attention.step_fn(batch, context, layers, heads, kv_heads, d, page, dtype,
                                                         placement=placement)
    got = np.asarray(step(q, ks, vs))
    tables = np.asarray(tables)
    if placement == "runs":  # each sequence's pages one after another
        assert np.all(np.diff(tables, axis=1) == 1)
    qn = np.asarray(q)
    want = np.zeros_like(qn)
    for k, v in zip(ks, vs, strict=True):
        kn, vn = np.asarray(k), np.asarray(v)
        if dtype == "bf16":
            kn, vn = _floats(kn), _floats(vn)
        for b in range(batch):
            pages = tables[b][: -(-context // page)]
            for h in range(heads):
                g = h // (heads // kv_heads)
                keys = kn[g][pages].reshape(-1, d)[:context]
                values = vn[g][pages].reshape(-1, d)[:context]
                s = keys @ qn[b, h] * d ** -0.5
                p = np.exp(s - s.max())
                want[b, h] += (p / p.sum()) @ values
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_another_build_runs_beside_this_one(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(decode_attention.floors, "measure",
                        lambda: {"memory_read_gbs": 20.0, "gemm_fp32_gflops": 100.0})
    out = tmp_path / "a.json"
    monkeypatch.setattr(sys, "argv", ["decode_attention", "--batches", "2", "--context", "32", "--layers", "2",
                                      "--repeats", "2", "--other-build", f"again={kernels._library_path()}",
                                      "--out", str(out)])
    decode_attention.main()
    row = json.loads(out.read_text())["by_batch"]["2"]
    assert set(row) == {"this", "again"}
    assert all(r["ms"] > 0 and r["read_mb"] == 2 * 32 * 2 * 3 * 64 * 2 * 2 / 1e6 for r in row.values())
    assert kernels._routed_lib() is kernels._state["lib"]  # this build in use again
