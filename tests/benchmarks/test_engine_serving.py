"""engine_serving's clients: a refused request fails the run instead of lending it a figure, and the
shared-prefix part fits the model's context."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.engine_serving import Client, run_clients, shared_prefix
from parrot.engine.engine import LLMEngine
from tests.conftest import tiny_engine_config, tiny_model


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    yield eng
    eng.shutdown()


def test_a_refused_client_fails_the_run(engine: LLMEngine) -> None:
    ok = Client(engine, "ok", [5, 6, 7], 4)
    too_long = Client(engine, "long", [5] * 500, 64)  # 500 + 64 tokens: beyond the model's 512
    with pytest.raises(RuntimeError, match=r"1 of 2 clients failed, e\.g\. long: .*maximum length"):
        run_clients([ok, too_long])
    assert len(ok.token_times) == 4 and ok.error is None
    assert run_clients([Client(engine, "again", [5, 6], 3)]) > 0


def test_the_shared_prefix_fits_the_context(engine: LLMEngine) -> None:
    r = shared_prefix(engine, np.random.default_rng(0), 3, 1000, 8, 8)
    assert r["prefix_tokens"] == engine.runner.max_len - 16 == 496
    assert r["forked_s"] > 0 and r["independent_s"] > 0
