"""Typed settings with their defaults, in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# the GGUF block types float weights can be quantized to at load (EngineConfig.weights)
QUANTIZE_AT_LOAD = ("q8_0", "q4_1", "q4_0")


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
    # budget for the paged KV pool; None: 1024 MB on a CPU, on an accelerator what `memory_utilization`
    # of its memory leaves after the weights (engine/device.py)
    kv_memory_mb: int | None = None
    memory_utilization: float | None = None  # accelerators: weights + KV share of device memory (default 0.9)
    kv_pages: int | None = None  # exact page count (overrides kv_memory_mb), page 0 included
    # a CPU's pool takes memory where its pages are written: after the engine has idled this many seconds, the
    # free pages written since are given back to the OS, so that its memory follows the pages in use after a
    # peak (those pages are zero-filled again by the OS when next written). 0: never (the pool keeps its peak)
    kv_release_idle_s: float = 10.0
    max_batch_size: int = 64
    max_num_batched_tokens: int = 512  # prefill chunk / token budget per step
    # prefill tokens in a step that also decodes (each decoding sequence waits for them: inter-token
    # latency); None: max_num_batched_tokens
    prefill_tokens_beside_decodes: int | None = 128
    # ... and of throughput work (priority > 0) in a step that decodes latency-critical work (priority 0):
    # what an app-aware server (Parrot's semantic calls) trades for a chat's inter-token latency while a
    # batch job's prompts fill. None (the default): prefill_tokens_beside_decodes. Plain calls are all
    # priority 0. Measured on a 2-core Xeon at 64 (docs/benchmarks.md): each such step still pays a prefill
    # pass of its own (~50 ms beside a 10 ms decode), so the chat gained little and map-reduce under load
    # lost 1.3x; a long chunk finishes the batch job's backlog first and the chat then decodes alone.
    prefill_tokens_beside_latency: int | None = None
    # padding buckets (the JAX global-JIT design): flat token counts, batch sizes, attended KV lengths
    # (from 4: a short fill or a grammar's forced tokens padded to 16 rows cost 4x a decode step on a CPU)
    token_buckets: list[int] = field(default_factory=lambda: _pow2(4, 512))
    bs_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # decode batches
    prefill_bs_buckets: list[int] = field(default_factory=lambda: [1, 4])  # fills batched in one prefill step
    kv_buckets: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    # the longest sequence (prompt + output) in tokens, any number up to the model's context (vLLM's
    # --max-model-len); None: the model's context, or the last kv bucket where shorter. Shapes are as wide as
    # the whole pages it takes
    max_model_len: int | None = None
    # shared-prefix (cascade) decode attention: forks of one context read the shared pages once
    shared_prefix_attention: bool = True
    cascade_suffix_buckets: list[int] = field(default_factory=lambda: [256])  # own-KV lengths of forks
    precompile: bool = True
    # decoder layers per compiled call: every call of a step runs the same compiled block, so a shape
    # compiles one block instead of the whole model (None: all layers in one call). Blocks are of equal size:
    # the largest divisor of the depth up to this (runner.block_size). 1 on a CPU; 4 on accelerators
    # (device.ACCELERATOR_DEFAULTS), where a call's dispatch costs the host more than a layer's device time
    layers_per_call: int | None = 1
    compilation_cache_dir: str | None = "~/.cache/parrot/jax"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on accelerators
    # "auto": block-quantized matrices (GGUF Q8_0 / Q4_0 / Q4_1) stay quantized where the native CPU
    # kernels run, else they are dequantized to the compute dtype; "f32" / "bf16": dequantized to that;
    # "q8_0" / "q4_1" / "q4_0": float matrices (a Hugging Face directory's, a GGUF's F16/F32 ones, dummy
    # weights) quantized to those GGUF blocks at load, for the native CPU kernels (needs them), quantized ones
    # kept as they are
    weights: str = "auto"
    # KV cache element type: "bf16" (half the bytes per token: twice the contexts in the same budget and
    # half the reads of decode attention), "f32", "fp8" (float8 e4m3fn, values clipped to +-448 and
    # rounded to nearest even, no scales, as vLLM's `--kv-cache-dtype fp8` without calibration: a quarter of
    # float32's bytes, approximate), or "auto": bf16 where the native CPU kernels decode (their greedy
    # outputs equal float32's on the reference prompts), else the activation dtype
    kv_dtype: str = "auto"
    # the values' element type alone (None: kv_dtype's), as llama.cpp's --cache-type-v: bf16 keys with fp8
    # values take 3/4 of bf16's bytes and keep more of the model than fp8 keys (whose rounding the softmax
    # amplifies); the native CPU kernels take both alike, or bfloat16 keys with float8 values
    v_dtype: str | None = None
    # a stable decode batch keeps one step in flight: the next is planned and launched before this one's
    # tokens reach the host (the engine's overlap; greedy and seeded results are the same either way)
    overlap: bool = True
    # multi-step decode: with overlap, a stable decode batch's ahead step runs up to this many decode steps
    # in one call, sampling (greedy or the plain sampler) and checking stop tokens on the device; its tokens
    # reach the host together. 1: off; None (auto): 4 where attention reads the KV pages in place (the native
    # CPU kernels: one shape per batch bucket, 1.1-1.3x the tokens per second of one step a call there) and
    # on accelerators (`device.ACCELERATOR_DEFAULTS`, for small batches), else 1. Each multi-step shape
    # compiles a loop of decode steps (precompiled last); results are the same as step by step
    multi_step: int | None = None
    # the largest decode batch a multi-step loop runs (loops are compiled for the batch buckets up to it);
    # None: every batch bucket, or on accelerators `device.ACCELERATOR_DEFAULTS`' (there one step a call is
    # host-bound only for small batches: on an H100, 1.7B shape, 4 steps a call gave 2.1x the tokens per
    # second of one stream and 1.4x at 4 streams, but at 16 the same step time and 1.8x the time to first token)
    multi_step_max_batch: int | None = None
    # a multi-step loop runs its decoder layers as a loop (one layer's code in each executable, the layers'
    # arrays picked by index: models/layer_loop.py) where the native CPU kernels run them; False: unrolled
    layer_loop: bool = True
    # decode bursts: while decodes and prompts both wait, steps alternate between prompt chunks alone (up to
    # this many tokens) and a decode-only burst of multi-step decode (one call, up to `multi_step` tokens
    # each), instead of a prompt chunk of `prefill_tokens_beside_decodes` beside every decode step. Where a
    # short chunk pays a step's fixed cost for few tokens and the decodes run multi-step, this gives both
    # kinds more per second (docs/benchmarks.md). 0: off; None (auto): where the engine runs multi-step
    # decode, 256 on a CPU (scheduler.AUTO_DECODE_BURSTS) and the chunk beside decodes on accelerators
    # (device.auto_decode_bursts), else off. Batches that cannot burst (no multi-step shape yet, a token
    # needing host work) keep the mixed steps. Results are the same either way
    decode_bursts: int | None = None
    # throughput hold: while latency-critical work (priority 0) decodes and throughput work (priority > 0:
    # semantic calls read as throughput-critical) has prompts to fill, the throughput work waits (its decodes
    # too) and the latency-critical decodes run back to back (as decode bursts where they can); at most this
    # many ms at a time, then one step runs as without the hold and the hold starts again. A chat's tokens then
    # never wait for a batch job's prompt steps; the batch job fills its prompts in whole chunks and decodes in
    # the large batches it would have had. Plain calls are all priority 0: only an app-aware server holds
    # anything. 0: off; None (auto): 1000 where the engine runs decode bursts, else off. Measured on a 2-core
    # EPYC Zen 4 (docs/benchmarks.md): chats beside a map-reduce ~3x faster at p99, the map-reduce level
    throughput_hold_ms: int | None = None
    # a prompt of more urgent work that took a full batch's slot (priority preemption) and has ended, with less
    # urgent work waiting, keeps its slot this many ms for the primitive that follows it on its context (or a
    # fork of it): a core reaching the engine over HTTP sends a call's generate only once its fill has
    # answered, and the preempted job, let in meanwhile, would be preempted again and recompute its KV twice.
    # A core in the same process hands both over at once, so nothing is kept. 0: off
    priority_handoff_ms: int = 50
    # a step with decodes and prompt chunks runs both in one pass over the weights (Orca's selective
    # batching) where every row then gets the bits its own kind of step gives it (the native CPU kernels:
    # ModelRunner.mixed); otherwise, and when False, as two passes
    mixed_steps: bool = True
    # once every serving shape is compiled, collect the garbage and freeze the heap's objects into the garbage
    # collector's permanent generation (gc.freeze), so that its full collections no longer walk them: a warm
    # engine holds ~240,000 tracked objects, and a full collection of them took ~200 ms on a 2-core EPYC,
    # stalling every stream. `parrot serve` / `parrot engine` turn it on (--no-gc-freeze: off); off for a
    # library engine, whose process may build and drop engines (a frozen object caught in a cycle is never
    # collected)
    gc_freeze: bool = False
    # devices one engine's model is split over (Megatron-style tensor parallelism, engine/tensor_parallel.py)
    tensor_parallel_size: int = 1
    # how O and down split: "megatron" (by input rows, one all-reduce), "exact" (by output columns, their
    # input gathered: greedy outputs equal one device's), "auto" (exact on CPUs, megatron on accelerators)
    tensor_parallel_mode: str = "auto"
    # decode attention over a bfloat16 cache on GPUs: "kernel" (a Pallas kernel that reads the KV pages in
    # place, where it compiles), "xla" (XLA's lowering, which gathers the pages first), "fused" (XLA's lowering
    # as reductions over the KV rows read through the block table, no gathered copy; any cache dtype),
    # "auto" (the kernel for grouped-query models with 4+ query heads per KV head, where it measured as fast
    # or faster on an H100; XLA's gathered lowering otherwise). CPUs whose native kernels read the pages in
    # place always use them.
    decode_attention: str = "auto"
    # speculative decoding by prompt lookup (engine/speculative.py): a generate (no penalties, bias, constraint or
    # logprobs) whose last tokens occurred earlier in its context feeds the up to this many tokens that followed
    # them as a draft, verified in one step as decode rows (its outputs stay plain decoding's); 0: off. vLLM's
    # `--speculative-config '{"method": "ngram", ...}'`, llama.cpp's lookup decoding
    speculative_tokens: int = 0
    # the longest and shortest n-grams of a context's tail looked up for a draft
    speculative_ngram: int = 3
    speculative_min_ngram: int = 2
    # where the seeds of requests that give none are drawn from (vLLM's --seed): the same seed, the same draws for
    # the same requests in the same order; None: from the operating system's entropy
    seed: int | None = None
    # fields set on purpose: on accelerators `device.for_device` raises the batch and token limits that
    # equal these defaults, except those named here (the CLI names the options it was given)
    explicit: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("token_buckets", "bs_buckets", "prefill_bs_buckets", "kv_buckets", "cascade_suffix_buckets"):
            values = sorted(set(getattr(self, name)))
            if not values or values[0] <= 0:
                raise ValueError(f"{name} must be positive integers")
            setattr(self, name, values)
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError("memory_utilization must be in (0, 1]")
        if self.kv_memory_mb is not None and self.kv_memory_mb <= 0:
            raise ValueError("kv_memory_mb must be positive")
        if not self.kv_release_idle_s >= 0:
            raise ValueError("kv_release_idle_s must be 0 (never) or a number of seconds")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.seed is not None and self.seed < 0:
            raise ValueError("seed must be a non-negative integer")
        if self.speculative_tokens < 0:
            raise ValueError("speculative_tokens must be 0 (off) or positive")
        if not 1 <= self.speculative_min_ngram <= self.speculative_ngram:
            raise ValueError("speculative n-grams need 1 <= speculative_min_ngram <= speculative_ngram")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.tensor_parallel_mode not in ("auto", "megatron", "exact"):
            raise ValueError("tensor_parallel_mode must be 'auto', 'megatron' or 'exact'")
        unknown = set(self.explicit) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"explicit names fields EngineConfig does not have: {sorted(unknown)}")
        if self.decode_attention not in ("auto", "xla", "kernel", "fused"):
            raise ValueError("decode_attention must be 'auto', 'xla', 'kernel' or 'fused'")
        if self.kv_dtype not in ("auto", "f32", "bf16", "fp8"):
            raise ValueError("kv_dtype must be 'auto', 'f32', 'bf16' or 'fp8'")
        if self.v_dtype not in (None, "auto", "f32", "bf16", "fp8"):
            raise ValueError("v_dtype must be None, 'auto', 'f32', 'bf16' or 'fp8'")
        if self.weights not in ("auto", "f32", "bf16", *QUANTIZE_AT_LOAD):
            raise ValueError(f"weights must be 'auto', 'f32', 'bf16' or one of {', '.join(QUANTIZE_AT_LOAD)}")
        if self.throughput_hold_ms is not None and self.throughput_hold_ms < 0:
            raise ValueError("throughput_hold_ms must be 0 (off) or positive")
        if self.priority_handoff_ms < 0:
            raise ValueError("priority_handoff_ms must be 0 (off) or positive")
        if self.decode_bursts is not None and self.decode_bursts < 0:
            raise ValueError("decode_bursts must be 0 (off) or positive")
        if self.multi_step is not None and self.multi_step < 1:
            raise ValueError("multi_step must be at least 1")
        if self.multi_step_max_batch is not None and self.multi_step_max_batch < 1:
            raise ValueError("multi_step_max_batch must be at least 1")
        if self.layers_per_call is not None and self.layers_per_call <= 0:
            raise ValueError("layers_per_call must be positive")
        if self.max_batch_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be positive")
        if self.max_batch_size > self.bs_buckets[-1]:
            raise ValueError("max_batch_size must not exceed the largest batch-size bucket")
        if self.prefill_tokens_beside_decodes is not None and self.prefill_tokens_beside_decodes <= 0:
            raise ValueError("prefill_tokens_beside_decodes must be positive")
        if self.prefill_tokens_beside_latency is not None and self.prefill_tokens_beside_latency <= 0:
            raise ValueError("prefill_tokens_beside_latency must be positive")
        if self.max_num_batched_tokens > self.token_buckets[-1]:
            raise ValueError("max_num_batched_tokens must not exceed the largest token bucket")
        if any(b % self.page_size for b in self.kv_buckets + self.cascade_suffix_buckets):
            raise ValueError(f"kv_buckets must be multiples of page_size {self.page_size}")


@dataclass
class ServeConfig:
    """Every knob of the serve layer (`parrot serve`), with its default. Limits answer 429 with `Retry-After`."""

    model: str = "smollm2"
    # the names the OpenAI API serves the model under (vLLM's --served-model-name; the first is its id in
    # /v1/models and in answers); empty: `model` as given
    served_model_names: tuple[str, ...] = ()
    # sessions
    session_ttl_s: float = 3600.0  # a session idle this long is deleted
    max_sessions: int = 1024  # open sessions at once
    max_vars_per_session: int = 4096  # semantic variables a session may hold
    max_pending_calls_per_session: int = 256  # semantic / native calls not finished yet, per session
    # text all variables may hold (UTF-8; generated outputs count, a constant once), and one session's: text a
    # client gives beyond is refused with a 429 (variables.SemanticVariableManager)
    max_variable_memory_mb: int = 4096
    max_session_variable_memory_mb: int = 512
    max_generations_kept: int = 256  # per session: timings of the latest finished generations (inspection)
    max_requests_kept: int = 1024  # per session: summaries of the latest calls (inspection)
    max_queued_completions: int = 4096  # a plain (OpenAI API) completion is refused while this many tasks wait
    max_queued_completions_per_key: int | None = None  # ... or while this many of its API key's wait (None: no limit)
    fair_share: bool = True  # several API keys' tasks waiting: the keys take turns (GlobalScheduler._fair)
    retry_after_s: int = 1  # the Retry-After of a 429
    allowed_origins: tuple[str, ...] = ()  # web pages of these origins may call the API from a browser (CORS; "*": any)
    # required as `Authorization: Bearer <key>` on every route but /health, /metrics; several keys separated by commas
    # (llama-server's --api-key): each a client of its own, whose sessions only it opens (`api_keys`)
    api_key: str | None = None
    max_sessions_per_key: int | None = None  # open sessions one API key may hold at once (None: max_sessions alone)
    # required instead of the API key on the engines' routes (/v1/engine/register, /heartbeat): clients that hold the
    # API key cannot register an engine (and so be sent other clients' prompts). None: the API key serves for both
    engine_key: str | None = None
    # opens every session's view (/v1/session/{id}/graph) and the list of sessions (/v1/sessions), which hold every
    # client's prompts and outputs; the API key then opens a session's view only with its token. None: the API key
    admin_key: str | None = None
    # generation
    default_max_tokens: int = 128
    prefix_sharing: bool = True  # False: the baseline (every task prefills its whole prompt, freed after)
    app_aware: bool = True  # False: the baseline (first come first served, placement by load only)
    # scheduling and contexts
    latency_cap: int = 16  # latency-critical tasks per engine (and all tasks while latency work runs there)
    default_max_batch: int = 64  # an engine's capacity when it does not report its max_batch_size
    pin_hits: int = 2  # a global prefix context forked this often is kept longest
    max_global_contexts: int = 256  # global prefix contexts kept beyond those in use
    max_cached_contexts: int = 1024  # global prefix contexts at most: beyond, the least recently used go now
    # automatic prefix caching (prefix_sharing): every prompt is cached, matched block by block
    prefix_block_tokens: int = 16  # block of the prefix index (the engines' page size)
    # Extra contexts kept inside a prompt: one every this many tokens, and one at the last block boundary this
    # many tokens before its end (prompts of 4x that or more). 0: none (the default). Later prompts match
    # any block of any cached prompt anyway (the radix view, `ContextManager.holder`); each such cut costs
    # an engine step of its own on every prompt (chain 4.5 s with none vs 5.5 s at 256 / 64: docs/benchmarks).
    prefix_checkpoint_tokens: int = 0
    prefix_tail_checkpoint_tokens: int = 0
    # No context is kept inside a prompt less than this many tokens after its start or after the context it
    # continues (the whole prompt always is): a short global text or a short shared piece saves less prefill
    # than the engine step of its own fill costs (~15-30 ms on a 2-core CPU: the bench's reduce prompt was
    # filled as 7 + 12 + 405 tokens, its engineers' prompts as 6 + 6 + 68 + 8 + 13 after the team prompt).
    min_prefix_cut_tokens: int = 32
    global_idle_s: float = 30.0  # a global context used this recently is never dropped
    dispatch_tick_s: float = 0.2  # how often queued tasks are placed again (capacity, new engines)
    evict_every_s: float = 5.0  # how often cold global contexts are dropped
    # engines
    dead_after_s: float = 5.0  # an engine silent this long is dead; its tasks run elsewhere
    monitor_interval_s: float = 1.0  # how often engines are pinged / their heartbeats checked
    forget_dead_engine_s: float = 600.0  # a remote engine dead this long is forgotten (it registers again if back)
    overload_retries: int = 20  # a task refused for KV space (kv_cache_full) is retried this often ...
    overload_backoff_s: float = 0.5  # ... this long apart, on the least loaded engine
    free_context_retries: int = 120  # freeing a context still in use is retried this often ...
    free_context_retry_s: float = 0.5  # ... this long apart
    # the seeds of sampled calls that give none are drawn from this (`--seed`; None: the system's entropy): the
    # same requests in the same order sample the same outputs, and a call re-run elsewhere repeats its tokens
    seed: int | None = None
    stats_log_interval_s: float = 10.0  # a log line of throughput and load this often while there is work; 0: none
    # native functions
    transform_timeout_s: float = 1.0  # a regular expression running longer fails its call
    native_workers: int = 4  # threads running native functions (never the event loop)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_vars_per_session", "max_pending_calls_per_session", "max_variable_memory_mb",
                     "max_session_variable_memory_mb", "max_generations_kept",
                     "max_requests_kept", "max_queued_completions", "latency_cap", "default_max_batch",
                     "native_workers", "max_cached_contexts", "prefix_block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("session_ttl_s", "dispatch_tick_s", "evict_every_s", "dead_after_s", "monitor_interval_s",
                     "transform_timeout_s", "forget_dead_engine_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.prefix_checkpoint_tokens < 0 or self.prefix_checkpoint_tokens % self.prefix_block_tokens:
            raise ValueError("prefix_checkpoint_tokens must be a multiple of prefix_block_tokens (or 0)")
        if self.stats_log_interval_s < 0:
            raise ValueError("stats_log_interval_s must be 0 (off) or positive")
        if self.min_prefix_cut_tokens < 0:
            raise ValueError("min_prefix_cut_tokens must not be negative")
        if self.prefix_tail_checkpoint_tokens < 0:
            raise ValueError("prefix_tail_checkpoint_tokens must not be negative")
        self.served_model_names = tuple(dict.fromkeys(self.served_model_names))  # each name once
        self.allowed_origins = tuple(self.allowed_origins)
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError("served model names must not be empty")
        for name in ("api_key", "engine_key", "admin_key"):  # a blank key (an empty secret) is a mistake, not "no key"
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ValueError(f"{name} is blank: give a key, or none to serve without one")
        if self.api_key is not None and any(not key.strip() for key in self.api_key.split(",")):
            raise ValueError("api_key holds a blank key between its commas: give each key, or none")
        for name in ("max_sessions_per_key", "max_queued_completions_per_key"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (or None: no limit a key)")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The API keys (`api_key` split at its commas, each stripped); empty: the server takes no key."""
        return tuple(dict.fromkeys(key.strip() for key in self.api_key.split(","))) if self.api_key else ()
