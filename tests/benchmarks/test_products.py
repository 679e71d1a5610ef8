"""products times the real quantized products: another build runs beside this one, each code in turns."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import floors, products
from parrot.engine import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native CPU kernels unavailable")


def test_another_build_runs_beside_this_one(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(floors, "measure", lambda: {"memory_read_gbs": 20.0, "gemm_fp32_gflops": 100.0})
    monkeypatch.setattr(products, "SHAPES", {"small q4_1 64x64": ("q4_1", 64, 64, False)})
    monkeypatch.setattr(products, "LAYERS", 2)
    out = tmp_path / "p.json"
    monkeypatch.setattr(sys, "argv", ["products", "--rows", "1", "3", "--repeats", "2", "--codes", "avx2 int8",
                                      "avx2 float32", "--other-build", f"again={kernels._library_path()}",
                                      "--out", str(out)])
    products.main()
    r = json.loads(out.read_text())
    want = ["avx2 float32", "avx2 int8", "avx2 float32 @again", "avx2 int8 @again"]
    assert r["codes"] == want and r["builds"] == {"again": str(kernels._library_path())}
    for rows in ("1", "3"):
        us = r["us_per_matrix"]["small q4_1 64x64"][rows]
        assert list(us) == want and all(t > 0 for t in us.values())
    assert kernels._routed_lib() is kernels._state["lib"]  # this process's build in use again
