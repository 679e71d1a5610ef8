"""An engine answers while its shapes still compile: same tokens as a warm engine, no shape misses, and
the warm-up progress in ping()."""

from __future__ import annotations

import time

import pytest

from parrot.engine.engine import LLMEngine
from parrot.protocol import FillRequest, SamplingParams
from tests.conftest import tiny_engine_config, tiny_model

SMALL = dict(token_buckets=[16, 32, 64], bs_buckets=[1, 2, 4], max_batch_size=4, kv_buckets=[64, 128],
             max_num_batched_tokens=64, prefill_bs_buckets=[1, 2], cascade_suffix_buckets=[64])


@pytest.mark.usefixtures("without_compilation_cache")  # compiles that take their time
def test_serves_while_warming_up_with_the_same_tokens() -> None:
    prompt, params = list(range(3, 45)), SamplingParams(max_tokens=10, ignore_eos=True)
    alone = LLMEngine(tiny_model(), tiny_engine_config(**SMALL)).start(precompile=False)  # its shapes as met
    try:
        expected = alone.complete(prompt, params).response.token_ids
    finally:
        alone.shutdown()
    eng = LLMEngine(tiny_model(), tiny_engine_config(**SMALL)).start(precompile=True, wait=False)
    try:
        info = eng.ping()
        assert info.total_shapes > 0 and info.warmup_s is None
        assert eng.complete(prompt, params, timeout=300).response.token_ids == expected
        deadline = time.monotonic() + 300
        while eng.ping().compiled_shapes < eng.ping().total_shapes and time.monotonic() < deadline:
            time.sleep(0.2)
        info = eng.ping()
        assert info.compiled_shapes == info.total_shapes and info.shape_misses == 0
        deadline = time.monotonic() + 30
        while eng.ping().warmup_s is None and time.monotonic() < deadline:  # set just after the last shape
            time.sleep(0.1)
        assert eng.ping().warmup_s is not None and eng.ping().rss_bytes
    finally:
        eng.shutdown()


def test_the_precompiled_page_copy_serves_the_first_fork() -> None:
    """The page copy (copy-on-write of a fork's partial page) compiled by precompile() is the one the first
    real copy runs: the KV pool starts on the device as every step leaves it, so nothing compiles again."""
    eng = LLMEngine(tiny_model(), tiny_engine_config(**SMALL)).start(precompile=False)
    try:
        eng.runner.precompile(shapes=[], progress=False)  # the page copy (the steps' shapes compile as met)
        copies = eng.runner._copy._cache_size()
        eng.fill_future(FillRequest(context_id="parent", token_ids=list(range(3, 40)))).result(300)
        eng.fill_future(FillRequest(context_id="child", parent_context_id="parent", token_ids=[7, 8])).result(300)
        assert eng.kv.get("child").num_tokens == 39
        assert eng.runner._copy._cache_size() == copies  # (the jit cache is shared with other engines)
    finally:
        eng.shutdown()


def test_a_warm_engine_keeps_no_traced_programs() -> None:
    """Once the last queued shape is compiled, JAX's traced programs are dropped (compiler.forget_traces):
    the executables are all the engine needs; it still serves, tracing again what it meets anew."""
    from jax._src.interpreters import partial_eval

    eng = LLMEngine(tiny_model(), tiny_engine_config(**SMALL)).start(precompile=True)
    try:
        assert eng.ping().compiled_shapes == eng.ping().total_shapes > 0
        assert partial_eval.trace_to_jaxpr.cache_info().currsize == 0
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        assert len(eng.complete(list(range(3, 30)), params).response.token_ids) == 6
        assert eng.ping().shape_misses == 0
    finally:
        eng.shutdown()


def _warm(eng: LLMEngine) -> None:
    deadline = time.monotonic() + 60
    while eng.ping().warmup_s is None and time.monotonic() < deadline:  # set in the warm-up thread
        time.sleep(0.05)
    assert eng.ping().warmup_s is not None


def test_a_warm_server_engine_freezes_its_heap_for_the_collector() -> None:
    """With gc_freeze (servers), the objects alive once every shape is compiled go to the garbage collector's
    permanent generation: a full collection then walks none of them. Without it (the library default),
    nothing is frozen."""
    import gc

    gc.unfreeze()
    eng = LLMEngine(tiny_model(), tiny_engine_config(**SMALL)).start(precompile=True)
    try:
        _warm(eng)
        # the engine froze nothing (a library may freeze a few hundred objects of its own: 375 were frozen
        # on a GPU machine; a frozen warm heap is many thousands, as below)
        assert gc.get_freeze_count() < 1000 and eng.settings()["gc_freeze"] is False
    finally:
        eng.shutdown()
    eng = LLMEngine(tiny_model(), tiny_engine_config(**SMALL, gc_freeze=True)).start(precompile=True)
    try:
        _warm(eng)
        assert gc.get_freeze_count() > 1000 and eng.settings()["gc_freeze"] is True
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        assert len(eng.complete(list(range(3, 30)), params).response.token_ids) == 6
    finally:
        eng.shutdown()
        gc.unfreeze()  # the rest of the test process collects as before
