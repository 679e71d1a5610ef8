"""engine_micro measures another build of the native kernels beside this one (`--other-build`): a runner of
its own, traced with that build, in the same report."""

from __future__ import annotations

import pytest

from benchmarks import engine_micro
from parrot.engine import kernels


@pytest.mark.skipif(not kernels.available(), reason="native CPU kernels unavailable")
def test_another_build_is_measured_beside_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_micro.floors, "measure", lambda: {"memory_read_gbs": 20.0, "gemm_fp32_gflops": 100.0})
    r = engine_micro.run("tiny-llama", 32, 32, [1], 1, [1], ["auto"], load_format="dummy",
                         builds={"again": str(kernels._library_path())})
    assert r["configs"] == ["weights_auto", "weights_auto@again"]
    assert r["other_builds"] == {"weights_auto@again": str(kernels._library_path())}
    for name in r["configs"]:
        assert r["by_config"][name]["prefill"]["tokens_per_s"] > 0
        assert r["by_config"][name]["decode"]["batch_1"]["ms_per_step"] > 0
    assert kernels._routed_lib() is kernels._state["lib"]  # this build in use again


def test_other_builds_take_label_and_path(tmp_path) -> None:  # noqa: ANN001
    lib = tmp_path / "x.so"
    assert engine_micro._other_builds([f"old={lib}"], tmp_path) == {"old": str(lib)}
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        engine_micro._other_builds(["no-label"], tmp_path)
