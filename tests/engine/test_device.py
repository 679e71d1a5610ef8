"""Device-aware defaults: the KV pool's size from device memory (as vLLM's --gpu-memory-utilization) and
bigger bucket lists on accelerators; a CPU keeps kv_memory_mb and the small buckets."""

from __future__ import annotations

import pytest

from parrot.config import EngineConfig
from parrot.engine.batch import pick_bucket
from parrot.engine.device import (
    ACCELERATOR_DEFAULTS,
    CPU_KV_MEMORY_MB,
    DeviceMemory,
    auto_decode_bursts,
    for_device,
    kv_budget_bytes,
)
from parrot.engine.kv_cache import KVCacheManager
from parrot.engine.scheduler import AUTO_DECODE_BURSTS, Scheduler
from parrot.engine.sequence import Job, JobKind
from parrot.protocol import SamplingParams

GIB = 2**30
H100 = DeviceMemory("gpu", "NVIDIA H100 80GB HBM3", 80 * GIB, 1 * GIB)


def test_kv_pool_from_device_memory() -> None:
    weights = 16 * GIB  # an 8B model in bf16
    got = kv_budget_bytes(EngineConfig(), weights, H100)
    assert got == int(0.9 * 80 * GIB) - 1 * GIB - weights - int(0.05 * 80 * GIB)
    half = kv_budget_bytes(EngineConfig(memory_utilization=0.5), weights, H100)
    assert half == int(0.5 * 80 * GIB) - 1 * GIB - weights - int(0.05 * 80 * GIB)
    # room for a temporary copy of one of the pool's arrays (64: K and V of 32 layers)
    share = got - got // 65
    assert kv_budget_bytes(EngineConfig(), weights, H100, arrays=64) == share
    assert share + share // 64 <= got
    # an explicit size wins; a CPU (no memory limit reported) gets 1024 MB
    assert kv_budget_bytes(EngineConfig(kv_memory_mb=300), weights, H100) == 300 * 2**20
    cpu = DeviceMemory("cpu", "cpu", None, 0)
    assert kv_budget_bytes(EngineConfig(), weights, cpu) == CPU_KV_MEMORY_MB * 2**20


def test_weights_that_leave_no_room_fail_clearly() -> None:
    with pytest.raises(ValueError, match="leave no room for a KV cache"):
        kv_budget_bytes(EngineConfig(memory_utilization=0.2), 16 * GIB, H100)
    with pytest.raises(ValueError, match="memory_utilization"):
        EngineConfig(memory_utilization=1.5)


def test_accelerator_buckets_keep_what_the_user_set() -> None:
    cpu = for_device(EngineConfig(), "cpu")
    assert cpu.bs_buckets == EngineConfig().bs_buckets and cpu.max_num_batched_tokens == 512
    gpu = for_device(EngineConfig(), "gpu")
    assert gpu.bs_buckets == ACCELERATOR_DEFAULTS["bs_buckets"] and gpu.max_batch_size == 256
    assert gpu.max_num_batched_tokens == 2048 and max(gpu.token_buckets) == 2048
    assert gpu.prefill_tokens_beside_decodes == 512 and EngineConfig().prefill_tokens_beside_decodes == 128
    assert gpu.prefill_bs_buckets == [1, 2, 4] and cpu.prefill_bs_buckets == [1, 4]
    assert gpu.layers_per_call == 4 and cpu.layers_per_call == 1
    kept = for_device(EngineConfig(layers_per_call=1, explicit=("layers_per_call",)), "gpu")
    assert kept.layers_per_call == 1 and for_device(EngineConfig(layers_per_call=None), "gpu").layers_per_call is None
    # multi-step decode for small batches only (loops where one step a call is host-bound)
    assert (gpu.multi_step, gpu.multi_step_max_batch) == (4, 4) and cpu.multi_step is None
    assert for_device(EngineConfig(multi_step=1), "gpu").multi_step == 1  # set by the user: kept
    mine = for_device(EngineConfig(bs_buckets=[1, 8], max_batch_size=8), "gpu")
    assert mine.bs_buckets == [1, 8] and mine.max_batch_size == 8  # set by the user: kept
    assert mine.max_num_batched_tokens == 2048
    # a value equal to the default but named in `explicit` (the CLI names the options it was given) is kept
    fixed = for_device(EngineConfig(max_batch_size=64, max_num_batched_tokens=512,
                                    explicit=("max_batch_size", "max_num_batched_tokens")), "gpu")
    assert fixed.max_batch_size == 64 and fixed.max_num_batched_tokens == 512
    assert fixed.bs_buckets == ACCELERATOR_DEFAULTS["bs_buckets"]
    with pytest.raises(ValueError, match="explicit names fields"):
        EngineConfig(explicit=("max_batch",))


def test_a_cpu_whose_bf16_tiles_fill_prompts_takes_longer_chunks_beside_decodes() -> None:
    from parrot.engine import kernels

    fast = kernels.available() and kernels.bf16_tiles()
    assert for_device(EngineConfig(), "cpu").prefill_tokens_beside_decodes == (512 if fast else 128)
    # float32 mode, or a value the user gave (even the default), keeps its chunk
    assert for_device(EngineConfig(dtype="float32"), "cpu").prefill_tokens_beside_decodes == 128
    given = EngineConfig(prefill_tokens_beside_decodes=128, explicit=("prefill_tokens_beside_decodes",))
    assert for_device(given, "cpu").prefill_tokens_beside_decodes == 128
    small = EngineConfig(max_num_batched_tokens=256, token_buckets=[16, 32, 64, 128, 256])
    assert for_device(small, "cpu").prefill_tokens_beside_decodes == (256 if fast else 128)


def test_decode_bursts_take_the_chunk_beside_decodes_on_accelerators() -> None:
    gpu = for_device(EngineConfig(), "gpu")
    assert auto_decode_bursts(gpu, "gpu") == 512 and auto_decode_bursts(EngineConfig(), "cpu") == AUTO_DECODE_BURSTS
    given = for_device(EngineConfig(prefill_tokens_beside_decodes=128, explicit=("prefill_tokens_beside_decodes",)),
                       "gpu")
    assert auto_decode_bursts(given, "gpu") == 128  # what the user set
    small = EngineConfig(max_num_batched_tokens=256, token_buckets=[16, 32, 64, 128, 256],
                         explicit=("max_num_batched_tokens", "token_buckets"))
    assert auto_decode_bursts(for_device(small, "gpu"), "gpu") == 256  # within the step's budget


def test_accelerator_prompt_steps_between_bursts_fill_two_prompts_unpadded() -> None:
    """engine_serving's 16 clients on an accelerator: a chat decodes while 256-token prompts wait. Each prompt
    step between two decode bursts fills two of them (512 tokens) as a batch of two sequences, where the
    CPU's settings filled one a step (256-token bursts; two prompts would pad to a batch of four)."""
    gpu = for_device(EngineConfig(), "gpu")
    s = Scheduler(KVCacheManager(1024, gpu.page_size), gpu, max_len=2048, decode_bursts=auto_decode_bursts(gpu, "gpu"))
    s.add(Job(JobKind.FILL, "chat", None, fill_tokens=[5] * 256))
    s.add(Job(JobKind.GENERATE, "chat", None, sampling=SamplingParams(max_tokens=100)))
    fits = lambda jobs, pages, kv_len, k: True  # noqa: E731
    plan = s.schedule(4, fits)
    s.update(plan, [7] * len(plan.slots))
    for i in range(15):
        s.add(Job(JobKind.FILL, f"user{i}", None, fill_tokens=[5] * 256))
    kinds = []
    for _ in range(6):
        plan = s.schedule(4, fits)
        if plan.prefill:
            assert not plan.decode and [len(slot.tokens) for slot in plan.prefill] == [256, 256]
            assert pick_bucket(len(plan.prefill), gpu.prefill_bs_buckets) == 2
        kinds.append("p" if plan.prefill else f"dx{plan.steps}")
        sampled = [[7] * len(plan.slots)] * plan.steps if plan.steps > 1 else [7] * len(plan.slots)
        s.update(plan, sampled)
    assert kinds == ["p", "dx4"] * 3
