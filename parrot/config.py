"""Typed settings with their defaults, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field


def _pow2(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


@dataclass
class EngineConfig:
    model: str = "smollm2"
    page_size: int = 16
    kv_memory_mb: int = 1024  # budget for the paged KV pool
    kv_pages: int | None = None  # exact page count (overrides kv_memory_mb), page 0 included
    max_batch_size: int = 64
    max_num_batched_tokens: int = 512  # prefill chunk / token budget per step
    # padding buckets (the JAX global-JIT design): flat token counts, batch sizes, attended KV lengths
    token_buckets: list[int] = field(default_factory=lambda: _pow2(16, 512))
    bs_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # decode batches
    prefill_bs_buckets: list[int] = field(default_factory=lambda: [1, 4])  # fills batched in one prefill step
    kv_buckets: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    # shared-prefix (cascade) decode attention: forks of one context read the shared pages once
    shared_prefix_attention: bool = True
    cascade_suffix_buckets: list[int] = field(default_factory=lambda: [256])  # own-KV lengths of forks
    precompile: bool = True
    compilation_cache_dir: str | None = "~/.cache/parrot/jax"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on accelerators

    def __post_init__(self) -> None:
        for name in ("token_buckets", "bs_buckets", "prefill_bs_buckets", "kv_buckets", "cascade_suffix_buckets"):
            values = sorted(set(getattr(self, name)))
            if not values or values[0] <= 0:
                raise ValueError(f"{name} must be positive integers")
            setattr(self, name, values)
        if self.max_batch_size > self.bs_buckets[-1]:
            raise ValueError("max_batch_size must not exceed the largest batch-size bucket")
        if self.max_num_batched_tokens > self.token_buckets[-1]:
            raise ValueError("max_num_batched_tokens must not exceed the largest token bucket")
        if any(b % self.page_size for b in self.kv_buckets + self.cascade_suffix_buckets):
            raise ValueError(f"kv_buckets must be multiples of page_size {self.page_size}")
