"""Decoder layers in blocks per compiled call (`EngineConfig.layers_per_call`, `runner.block_size`): blocks of
equal size, one block function per shape, and the same tokens whatever the block size."""

from __future__ import annotations

import dataclasses

from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.engine.models.llama import random_weights
from parrot.engine.runner import block_size
from parrot.protocol import SamplingParams
from tests.conftest import TINY, tiny_engine_config, tiny_tokenizer


def test_blocks_divide_the_depth() -> None:
    assert [block_size(n, 4) for n in (32, 24, 28, 30, 2, 7)] == [4, 4, 4, 3, 2, 1]
    assert block_size(30, None) == 30 and block_size(30, 1) == 1 and block_size(30, 64) == 30


def test_blocks_of_layers_give_the_same_tokens() -> None:
    """A 6-layer model one layer a call, in blocks of 3 (4 asked: the largest divisor of 6 up to 4) and whole:
    the same greedy tokens; each engine compiles one block size."""
    cfg = dataclasses.replace(TINY, num_layers=6)
    model = LoadedModel(cfg, random_weights(cfg, seed=3), tiny_tokenizer(), "tiny-6-layers")
    tokens = []
    for per_call, blocks in ((1, [1] * 6), (4, [3, 3]), (None, [6])):
        eng = LLMEngine(model, tiny_engine_config(layers_per_call=per_call, explicit=("layers_per_call",)))
        eng.start(precompile=False)
        try:
            assert [b - a for a, b in eng.runner.blocks] == blocks
            done = eng.complete(list(b"blocks of layers"), SamplingParams(max_tokens=10, ignore_eos=True), timeout=300)
            tokens.append(done.response.token_ids)
        finally:
            eng.shutdown()
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 10
