"""Device-aware defaults: how big the KV pool is and which padding buckets a device gets.

On a CPU the KV pool takes `kv_memory_mb` (default 1024 MB) of host memory and the buckets stay small
(a step of 64 sequences or 512 tokens is already compute bound there); where AMX's bf16 tiles fill
prompts, the prefill chunk beside decodes grows from 128 to 512 tokens. On an accelerator, as vLLM's
`--gpu-memory-utilization`, weights plus KV take `memory_utilization` (default 0.9) of the device's
memory: the pool gets what is left after the weights and a reserve for a step's activations. Bucket
lists grow to batches of 256 sequences and prefill chunks of 2048 tokens, where the device is still
far from compute bound, and a step's decoder layers run 4 to a call; what the user set is kept as it is.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from parrot.config import EngineConfig
from parrot.engine import kernels
from parrot.engine.scheduler import AUTO_DECODE_BURSTS, beside_decodes

log = logging.getLogger(__name__)

CPU_KV_MEMORY_MB = 1024  # the KV pool on a CPU when `kv_memory_mb` is not set
DEFAULT_MEMORY_UTILIZATION = 0.9  # on accelerators when `memory_utilization` is not set
ACTIVATION_RESERVE = 0.05  # of device memory, kept free for a step's activations and temporaries
MIN_KV_BYTES = 64 * 2**20

# accelerators' defaults (`for_device`): padding buckets where an accelerator's step time is still flat in the
# batch (H100: decode at batch 64 costs 1.5x batch 1 for an 8B model) and prefill chunks amortize the
# per-step cost; multi-step decode for small batches (below)
ACCELERATOR_DEFAULTS = {
    "bs_buckets": [1, 2, 4, 8, 16, 32, 64, 128, 256],
    "max_batch_size": 256,
    "token_buckets": [16, 32, 64, 128, 256, 512, 1024, 2048],
    "max_num_batched_tokens": 2048,
    "prefill_tokens_beside_decodes": 512,  # a 512-token chunk of an 8B model is ~16 ms on an H100
    # two prompts in one prefill step run as two sequences, not padded to four (on a CPU the native kernels
    # skip padding rows; an accelerator computes them): 39 more prefill shapes for `parrot serve` (236 in all)
    "prefill_bs_buckets": [1, 2, 4],
    # multi-step decode for small batches (one step a call is host-bound there; at 16 sequences an H100's
    # step was device-bound, and loops only delayed prompts): 1.7B shape on an H100, medians of two runs
    # (docs/benchmarks.md): 1 stream 156 -> 321 tok/s, 4 streams 783 -> 1,120, with 4 steps a call
    "multi_step": 4,
    "multi_step_max_batch": 4,
    # decoder layers per compiled call (blocks of equal size: `runner.block_size`). On an H100 (2026-11-27) a
    # call cost the host ~0.2 ms, so one layer a call was host-bound: Llama-3-8B at batch 1 took 7.13 ms a
    # step pipelined against 6.12 ms with the whole model in one call; at batch 64 they were level (10.74 / 10.80).
    # Compiling a decode shape took 2.1 s with one layer and 5.7 s with all 32 (~0.12 s a layer more): blocks
    # of 4 cut an 8B step's calls from 34 to 10 for ~0.35 s more a shape
    "layers_per_call": 4,
}


def auto_decode_bursts(cfg: EngineConfig, platform: str | None = None) -> int:
    """Prompt tokens per step between decode bursts where `cfg.decode_bursts` is unset and the engine runs
    multi-step decode: `scheduler.AUTO_DECODE_BURSTS` on a CPU (measured there); on accelerators the chunk a
    step that decodes takes beside the decodes (`prefill_tokens_beside_decodes`, 512 by default), since a
    waiting decode batch waits as long for a prompt step alone as for a chunk beside it. On an H100
    (2026-11-27) engine_serving's 16 clients waited ~0.17 s for their last first token, of a 0.75 s run: with
    256 tokens between bursts and 512-token steps, their 256-token prompts filled one a step, 16 prompt steps
    with decode steps between them (the step sequence replayed on a CPU with those settings); with these
    defaults, two a step, 7-9 prompt steps."""
    platform = platform or jax.devices()[0].platform
    return AUTO_DECODE_BURSTS if platform == "cpu" else beside_decodes(cfg)


@dataclass(frozen=True)
class DeviceMemory:
    """What the device says of its memory: the usable total and what is in use (bytes), if it says."""

    platform: str
    kind: str
    limit_bytes: int | None
    in_use_bytes: int


def device_memory(device: jax.Device | None = None) -> DeviceMemory:
    dev = device or jax.devices()[0]
    stats = {}
    if dev.platform != "cpu":
        try:
            stats = dev.memory_stats() or {}
        except Exception:  # some backends do not report it
            stats = {}
    limit = stats.get("bytes_limit")
    return DeviceMemory(dev.platform, getattr(dev, "device_kind", dev.platform), int(limit) if limit else None,
                        int(stats.get("bytes_in_use", 0)))


# on a CPU whose AMX bf16 tiles fill prompts (the default bfloat16 mode), a 512-token prefill chunk takes
# ~0.3 s for SmolLM2-135M on 2 cores, against ~1 s for the float32 chunk the CPU default of 128 was set for:
# bench --quick on a 2-core Xeon, 512 against 128, map-reduce 9.7 against 17.2 s and mixed's chats 6.8
# against 13.8 s (OpenAI API with automatic prefix caching)
CPU_BF16_FILL_BESIDE_DECODES = 512


def for_device(cfg: EngineConfig, platform: str | None = None) -> EngineConfig:
    """`cfg` with the device's bucket lists where `cfg` keeps EngineConfig's defaults and does not name the
    field in `cfg.explicit` (accelerators); on a CPU whose bf16 tiles fill prompts, a longer prefill chunk
    beside decodes (`CPU_BF16_FILL_BESIDE_DECODES`), on the same terms."""
    platform = platform or jax.devices()[0].platform
    if platform == "cpu":
        return _for_cpu(cfg)
    base = EngineConfig()
    changes = {k: v for k, v in ACCELERATOR_DEFAULTS.items()
               if k not in cfg.explicit and getattr(cfg, k) == getattr(base, k)}
    if not changes:
        return cfg
    if "token_buckets" not in changes and "max_num_batched_tokens" in changes:
        changes["max_num_batched_tokens"] = min(changes["max_num_batched_tokens"], max(cfg.token_buckets))
    if "bs_buckets" not in changes and "max_batch_size" in changes:
        changes["max_batch_size"] = min(changes["max_batch_size"], max(cfg.bs_buckets))
    return dataclasses.replace(cfg, **changes)


def _for_cpu(cfg: EngineConfig) -> EngineConfig:
    key = "prefill_tokens_beside_decodes"
    if key in cfg.explicit or cfg.prefill_tokens_beside_decodes != EngineConfig().prefill_tokens_beside_decodes:
        return cfg
    if (cfg.dtype is not None and jnp.dtype(cfg.dtype) != jnp.bfloat16) or not kernels.bf16_tiles():
        return cfg  # float32 mode, or prompts multiplied exactly: the short chunk
    return dataclasses.replace(cfg, **{key: min(CPU_BF16_FILL_BESIDE_DECODES, cfg.max_num_batched_tokens)})


def kv_budget_bytes(cfg: EngineConfig, weight_bytes: int, memory: DeviceMemory | None = None,
                    arrays: int = 0) -> int:
    """Bytes for the paged KV pool: `kv_memory_mb` when set (or on a CPU); else the device's share
    (`memory_utilization`) of its memory, less what is in use, the weights still to be placed, a
    reserve for activations and room for a temporary copy of one of the pool's `arrays` (one K or V per
    layer: seen on an H100, a step that did not update a layer's cache in place needed one). Raises when
    the weights alone exceed that share."""
    if cfg.kv_memory_mb is not None:
        return cfg.kv_memory_mb * 2**20
    memory = memory or device_memory()
    if memory.limit_bytes is None:
        return CPU_KV_MEMORY_MB * 2**20
    util = cfg.memory_utilization if cfg.memory_utilization is not None else DEFAULT_MEMORY_UTILIZATION
    budget = int(util * memory.limit_bytes) - memory.in_use_bytes - weight_bytes
    budget -= int(ACTIVATION_RESERVE * memory.limit_bytes)
    if arrays:
        budget -= budget // (arrays + 1)
    if budget < MIN_KV_BYTES:
        raise ValueError(
            f"the model's weights ({weight_bytes / 2**30:.1f} GiB) leave no room for a KV cache within "
            f"{util:.0%} of the {memory.kind}'s {memory.limit_bytes / 2**30:.1f} GiB "
            f"({memory.in_use_bytes / 2**30:.1f} GiB in use): raise memory_utilization or use a smaller model")
    log.info("KV cache: %.1f GiB (%.0f%% of %.1f GiB on %s, weights %.1f GiB)", budget / 2**30, util * 100,
             memory.limit_bytes / 2**30, memory.kind, weight_bytes / 2**30)
    return budget
