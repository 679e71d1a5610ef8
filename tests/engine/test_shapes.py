"""ShapeBook: the bucket shape each kind of step pads to, and that every such shape is among the shapes
precompile compiles (a step never waits for a shape compiled while serving)."""

from __future__ import annotations

import itertools

import pytest

from parrot.config import EngineConfig
from parrot.engine.sampling import GREEDY, PLAIN, Stages
from parrot.engine.shapes import MIN_BATCHED_Q, Shape, ShapeBook


def book(in_place: bool, multi_step: int = 4, host_stages: bool = False, **cfg: object) -> ShapeBook:
    ecfg = EngineConfig(**{"max_batch_size": 16, "kv_buckets": [256, 512, 1024, 2048], **cfg})
    return ShapeBook(ecfg, max_len=2048, in_place=in_place, mixed=in_place, multi_step=multi_step,
                     multi_max_batch=16, host_stages=host_stages)


def test_buckets_end_at_the_model_length() -> None:
    b = ShapeBook(EngineConfig(kv_buckets=[256, 512, 1024, 2048]), max_len=768, in_place=False)
    assert b.kv_buckets == [256, 512, 768]
    assert b.kv_pages_bucket(300) == 512 // b.page_size
    with pytest.raises(ValueError, match="multiple of page_size"):
        ShapeBook(EngineConfig(), max_len=1000, in_place=True)


def test_one_page_table_width_where_attention_reads_pages_in_place() -> None:
    """In place, a step's cost follows its lengths, not its table's width: every step takes the model's
    length, and the KV buckets no longer multiply the shapes."""
    b = ShapeBook(EngineConfig(kv_buckets=[256, 512, 1024, 2048]), max_len=768, in_place=True)
    assert b.kv_buckets == [768]
    assert b.kv_pages_bucket(1) == b.kv_pages_bucket(700) == 768 // b.page_size
    gathered, flat = book(in_place=False), book(in_place=True)
    assert {s.pages for s in flat.all_shapes() if not s.prefix_pages} == {2048 // 16}
    assert len(flat.all_shapes()) < len(gathered.all_shapes()) / 2


def test_prefill_pads_per_sequence_or_flat() -> None:
    gathered, flat = book(in_place=False), book(in_place=True)
    assert gathered.prefill_shape(1, 100, 100) == Shape(128, 1, 128, 256 // 16)
    # several sequences: each padded to the longest chunk's bucket where attention gathers pages ...
    assert gathered.prefill_shape(3, 40, 600, 90) == Shape(4 * 64, 4, 64, 1024 // 16)
    # ... to the bucket of their total tokens where it reads the pages in place
    assert flat.prefill_shape(3, 40, 600, 90) == Shape(128, 4, 128, 2048 // 16)
    assert flat.prefill_shape(2, 4, 10, 8).tokens == MIN_BATCHED_Q


def test_multi_step_shapes_only_where_they_apply() -> None:
    on = book(in_place=True)
    assert on.multi_shape(3, 700) == Shape(4, 4, 1, 2048 // 16, steps=4)  # in place: the longest page table
    assert book(in_place=False).multi_shape(3, 700) == Shape(4, 4, 1, 1024 // 16, steps=4)
    assert on.multi_shape(17, 700) is None  # above multi_max_batch
    assert on.multi_shape(3, 2049) is None  # beyond the model's length
    assert book(in_place=True, multi_step=1).multi_shape(3, 700) is None


def test_loops_per_named_sampler_parts() -> None:
    """Where the host names the sampler's parts (accelerators), a loop's shape carries them: greedy and
    plain-temperature loops are listed for precompile, others are named when a batch needs them."""
    named, branching = book(in_place=False, host_stages=True), book(in_place=False)
    wide = Stages(stochastic=True, top_p=True)
    assert named.multi_shape(3, 700) == Shape(4, 4, 1, 1024 // 16, steps=4, sampler=GREEDY)
    assert named.multi_shape(3, 700, wide).sampler == wide
    assert branching.multi_shape(3, 700, wide).sampler is None  # the device branches: one loop for all
    loops = [s for s in named.all_shapes() if s.steps > 1]
    assert {s.sampler for s in loops} == {GREEDY, PLAIN}
    assert len(loops) == 2 * len([s for s in branching.all_shapes() if s.steps > 1])
    assert [s for s in named.all_shapes() if s.steps == 1] == [s for s in branching.all_shapes() if s.steps == 1]


def test_cascade_and_mixed_shapes() -> None:
    b = book(in_place=True)
    assert b.cascade_shape(1, 32, 1000) is None  # one sequence shares with nobody
    own = b.ecfg.cascade_suffix_buckets[0]
    assert b.cascade_shape(5, own - 1, 1000) == Shape(8, 8, 1, own // 16, 2048 // 16)
    assert b.cascade_shape(5, b.ecfg.cascade_suffix_buckets[-1] + 1, 1000) is None
    assert b.mixed_shape(12, 140, 900) == Shape(256, 16, 256, 2048 // 16)
    assert b.mixed_shape(3, 140, 900) == b.prefill_shape(3, 140, 900, 140)
    assert b.mixed_shape(12, b.ecfg.token_buckets[-1] + 1, 900) is None
    assert book(in_place=False).mixed_shapes() == []


@pytest.mark.parametrize("in_place", [True, False])
def test_every_step_shape_is_precompiled(in_place: bool) -> None:
    b = book(in_place)
    every = set(b.all_shapes())
    assert len(every) == len(b.all_shapes())  # listed once each
    cfg = b.ecfg
    for batch, kv_len in itertools.product(range(1, cfg.max_batch_size + 1), (1, 200, 256, 257, 1500, 2048)):
        assert b.decode_shape(batch, kv_len) in every
        multi = b.multi_shape(batch, kv_len)
        assert multi is None or multi in every
        for own in (16, 100):
            cascade = b.cascade_shape(batch, own, kv_len)
            assert cascade is None or cascade in every
    for batch in cfg.prefill_bs_buckets:
        for q in (1, 15, 16, 100, 300, cfg.max_num_batched_tokens):
            tokens = min(batch * q, cfg.max_num_batched_tokens)
            if in_place or batch == 1 or pick_fits(b, batch, q):
                for kv_len in (q, 900, 2048):
                    assert b.prefill_shape(batch, q, max(kv_len, q), tokens) in every, (batch, q, kv_len)
    if in_place:
        for batch in (5, 9, 16):
            for tokens in (batch, batch + 100, batch + cfg.prefill_tokens_beside_decodes):
                assert b.mixed_shape(batch, tokens, 900) in every, (batch, tokens)


def pick_fits(b: ShapeBook, batch: int, q: int) -> bool:
    """Where attention gathers pages, the scheduler takes several chunks into one step only while the padded
    step stays within max_num_batched_tokens (the shapes precompile lists)."""
    shape = b.prefill_shape(batch, q, q)
    return shape.tokens <= b.ecfg.max_num_batched_tokens
