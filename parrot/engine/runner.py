"""ModelRunner: the model split once with `nnx.split`, a pure jitted forward over a paged KV pool,
the jitted samplers, precompilation of its bucket shapes (shapes.py) and the persistent compilation cache."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from parrot import procinfo
from parrot.config import QUANTIZE_AT_LOAD, EngineConfig
from parrot.engine import attention, gpu_attention, kernels, quant, tensor_parallel
from parrot.engine.batch import (
    ForwardBatch,
    SequenceSlice,
    build_batch,
    find_shared_prefix,
    pack,
    pick_bucket,
    unpack,
)
from parrot.engine.compile_cache import compile_with_fallback, enable_compilation_cache
from parrot.engine.compiler import ShapeCompiler, forget_traces
from parrot.engine.device import kv_budget_bytes
from parrot.engine.executable_cache import ExecutableCache
from parrot.engine.kv_cache import PageCopy
from parrot.engine.logprobs import SampledLogprob, token_logprobs
from parrot.engine.models.layer_loop import LayerLoop
from parrot.engine.models.llama import (
    TP_AXIS,
    Embedding,
    HeadWeights,
    KVCache,
    Llama,
    LlamaConfig,
    Weight,
    embed_tokens,
    lm_logits,
)
from parrot.engine.multihost import Mirror
from parrot.engine.quant import QuantizedTensor
from parrot.engine.sampling import (
    COMMON_DRAWS,
    GREEDY,
    SamplerExtras,
    SamplingBatch,
    SamplingParams,
    Stages,
    greedy_sample,
    host_stages,
    lazily_constrained,
    processed_sampler,
    sample,
)
from parrot.engine.scheduler import Slot, StepPlan
from parrot.engine.sequence import Job
from parrot.engine.shapes import Shape, ShapeBook
from parrot.engine.structured import check_greedy
from parrot.errors import ModelLoadError

log = logging.getLogger(__name__)


# decode steps per call where multi-step decode is on by default (EngineConfig.multi_step: attention in place)
AUTO_MULTI_STEP = 4

# forks sharing a prefix whose single (cascade) steps would each read this many fewer KV bytes than plain decode
# attention run step by step instead of in a multi-step loop (which reads every sequence's pages). Measured on
# a 2-core EPYC Zen 4 with SmolLM2 (docs/benchmarks.md, multi-step decode): multi-step is faster up to ~210 MB
# saved (16 forks of 600 tokens, 8 of 1,100), level at 240-380 MB, cascade faster at 520 MB (16 forks of
# 1,500); the shared pages that every sequence reads mostly come from the CPU's caches
CASCADE_OVER_MULTI_BYTES = 256 << 20

# stop tokens a multi-step decode loop checks per sequence on the device (a job with more runs step by step)
MULTI_STOP_IDS = 8

# greedy constrained rows in a batch from which their masks are computed on demand (structured.check_greedy);
# one row alone computes its mask before the step: a mask computed after a run of unchecked tokens costs
# llguidance up to twice as much (it catches up on them: 1.1-1.2 against 0.6 ms for one JSON state here)
LAZY_MIN_ROWS = 2


def _cpu_has_bf16_matmul() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def default_dtypes() -> tuple[jnp.dtype, jnp.dtype, jnp.dtype]:
    """(prefill weight dtype, decode weight dtype, activation dtype).

    Accelerators: bf16 throughout. CPUs with bf16 matrix units (AMX / AVX512-BF16): prefill steps
    multiply by bf16 weights (3x faster than float32 from 8 rows up, measured here), decode steps by
    float32 weights (one row per sequence: memory-bound, and float32 is faster at few rows);
    activations, norms, attention and the KV cache stay float32. Other CPUs: float32 throughout."""
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    if jax.default_backend() != "cpu":
        return bf16, bf16, bf16
    if _cpu_has_bf16_matmul():
        return bf16, f32, f32
    return f32, f32, f32


def _copy_pages(kv: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return jax.tree.map(lambda c: c.at[:, dst].set(c[:, src]), kv)


def _release_pages(kv: KVCache, mask: jax.Array) -> KVCache:
    ks, vs = kv
    out = kernels.release_pages(mask, [*ks, *vs])
    return tuple(out[: len(ks)]), tuple(out[len(ks) :])


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    """The model's arrays as the step functions take them: each decoder layer's state as a plain dict
    (one compiled layer function serves every layer), the embedding and the head."""

    embed: Embedding
    layers: list[dict]
    head: HeadWeights


@dataclass
class StepExecutables:
    """One shape's compiled step: embedding, a block of `n` layers for each block size, the head; a
    multi-step shape's: its decode loop alone."""

    embed: Callable | None
    blocks: dict[int, Callable]
    head: Callable | None
    loop: Callable | None = None


@dataclass
class Launched:
    """A plan dispatched to the device: per batch (decode, prefill) its sampled tokens (a device array,
    host values where sampling needed the host, or None) and slot count."""

    parts: list[tuple[jax.Array | np.ndarray | None, int]]
    samples: bool
    steps: int = 1  # > 1: a multi-step plan; its one part holds the tokens of every step ([steps, batch])
    last: jax.Array | None = None  # a multi-step plan's last step's tokens ([batch])

    @property
    def tokens(self) -> jax.Array | np.ndarray | None:
        """The first batch's sampled tokens (a multi-step plan's last ones): what the PENDING slots of an
        ahead step read."""
        if self.last is not None:
            return self.last
        return self.parts[0][0] if self.parts else None


def _splice_tokens(ids: jax.Array, src: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.where(src >= 0, tokens[jnp.maximum(src, 0)], ids)


def _pending_splice(slots: list[Slot], num_tokens: int,
                    prev: Launched | None) -> tuple[np.ndarray, jax.Array] | None:
    """(src, tokens) for a step whose PENDING slots feed the tokens `prev` sampled, still on the device:
    src[i] is the index in `prev.tokens` of flat row i's token (-1: the row's own id); None if no slot waits."""
    if not any(s.source >= 0 for s in slots):
        return None
    assert prev is not None and prev.tokens is not None
    src = np.full(num_tokens, -1, np.int32)
    off = 0
    for s in slots:
        if s.source >= 0:
            src[off] = s.source
        off += len(s.tokens)
    return src, prev.tokens


def _as_rows(slots: list[Slot]) -> list[Slot]:
    """`slots` with each rows slot (`Slot.rows`) as one decode row per token, at its position, over the same pages:
    each row then computes what a decode step at that position does. A verify slot's rows (speculative decoding:
    `Slot.draft`) each sample at their place's sampler step (its penalties and min_tokens counting the draft's
    tokens before it); another rows slot's last row samples where the slot does."""
    rows: list[Slot] = []
    for s in slots:
        if not s.rows:
            rows.append(s)
        elif s.draft is not None:
            rows += [Slot(s.job, [t], s.start + j, s.pages, sample=True, before=tuple(s.tokens[1 : j + 1]))
                     for j, t in enumerate(s.tokens)]
        else:
            last = len(s.tokens) - 1
            rows += [Slot(s.job, [t], s.start + j, s.pages, sample=s.sample and j == last)
                     for j, t in enumerate(s.tokens)]
    return rows


def _verified(slots: list[Slot], rows: list[Slot], tokens: np.ndarray) -> np.ndarray:
    """Each verify slot's sampled tokens (`Slot.verified`) from the tokens sampled for its rows (`_as_rows`),
    and their logprobs where the job asked for them (`Slot.verified_logprobs`); another rows slot's token and
    logprob are its last row's; the tokens of the other slots, one each."""
    out = np.zeros(len(slots), np.int32)
    r = 0
    for i, s in enumerate(slots):
        if not s.rows:
            out[i] = tokens[r]
            r += 1
        elif s.draft is None:
            r += len(s.tokens)
            out[i] = tokens[r - 1]
            s.logprob = rows[r - 1].logprob
        else:
            s.verified = tokens[r : r + len(s.tokens)].tolist()
            if s.job.sampling is not None and s.job.sampling.logprobs is not None:
                s.verified_logprobs = [row.logprob for row in rows[r : r + len(s.tokens)]]
            r += len(s.tokens)
    return out


def _sampler_steps(slots: list[Slot], prev: Launched | None) -> list[int]:
    """Each slot's sampler step counter (its random stream): the job's tokens, those the step in flight
    samples for a PENDING slot included (`prev.steps`: more than one from a multi-step plan), and a verify
    row's place after the last one (`Slot.before`)."""
    pending = prev.steps if prev is not None else 0
    return [len(s.job.output_ids) + len(s.before) + (pending if s.source >= 0 else 0) for s in slots]


def block_size(num_layers: int, layers_per_call: int | None) -> int:
    """Decoder layers per compiled call: the largest divisor of `num_layers` up to `layers_per_call` (None: all),
    so every call of a step runs one block function (30 layers at 4 a call: 3)."""
    most = min(layers_per_call or num_layers, num_layers)
    return max(n for n in range(1, most + 1) if num_layers % n == 0)


class ModelRunner:
    def __init__(self, cfg: LlamaConfig, weights: dict[str, Weight], ecfg: EngineConfig,
                 dtype: jnp.dtype | None = None) -> None:
        enable_compilation_cache(ecfg.compilation_cache_dir)
        procinfo.keep_large_blocks()  # before the KV pool and any step's temporaries are allocated
        self.cfg, self.ecfg = cfg, ecfg
        prefill_dtype, decode_dtype, self.act_dtype = default_dtypes()
        if ecfg.dtype or dtype:  # one dtype for every step (e.g. float32 for exact reference runs)
            prefill_dtype = decode_dtype = jnp.dtype(ecfg.dtype or dtype)
            if prefill_dtype == jnp.float32:
                self.act_dtype = prefill_dtype
        self.dtype = decode_dtype
        self.prefill_dtype = prefill_dtype
        self.page_size = ecfg.page_size
        asked = ecfg.max_model_len or (ecfg.kv_buckets[-1] if "kv_buckets" in ecfg.explicit else None)
        if asked is not None and asked > cfg.max_position:  # a max_model_len asked for
            raise ModelLoadError(f"max_model_len {asked} is longer than the model's context "
                                 f"({cfg.max_position} tokens)")
        # the longest sequence, and the shapes' attended width: the whole pages that takes
        self.seq_limit = min(cfg.max_position, ecfg.kv_buckets[-1], ecfg.max_model_len or cfg.max_position)
        self.max_len = -(-self.seq_limit // ecfg.page_size) * ecfg.page_size
        weights, self.weights_mode = resolve_weights(weights, ecfg.weights)
        if self.weights_mode == "float" and kernels.available():  # `auto` on float weights, or f32 / bf16
            log.info("float weights on a CPU run through XLA's float products, whose sums' order follows the "
                     "batch's size (a sequence alone and in a batch may pick apart nearly tied tokens); "
                     "--weights q8_0 quantizes them at load for the native kernels, which sum every row in one "
                     "order (SmolLM2-135M's shape: decode 4.7x faster, prefill 1.3x)")
        # tensor parallelism: the model with heads, FFN and vocabulary zero-padded to split in whole parts
        self.tp = ecfg.tensor_parallel_size
        self.mesh = tensor_parallel.make_mesh(self.tp) if self.tp > 1 else None
        mode = ecfg.tensor_parallel_mode
        self.tp_exact = mode == "exact" or (mode == "auto" and tensor_parallel.exact_default(jax.default_backend()))
        # XLA's CPU client deadlocks when many computations with collectives are queued on virtual
        # devices with few cores (one device's part waits in an all-reduce holding a pool thread, the
        # other's cannot start: seen with 2 devices on 2 cores): there, each call is waited for
        self._serial = self.mesh is not None and jax.default_backend() == "cpu"
        self._replicated = NamedSharding(self.mesh, P()) if self.mesh is not None else None
        self._masks_first = jax.default_backend() == "cpu"  # see _run_slots
        # greedy constrained rows sample unmasked and are checked after (structured.check_greedy) on a CPU,
        # where every mask costs the cores the step needs; an accelerator computes masks beside the step
        self.lazy_masks = self._masks_first
        self.model_cfg = cfg
        if self.mesh is not None:
            self.model_cfg = tensor_parallel.padded_config(cfg, self.tp, self.weights_mode == "quantized")
            weights = tensor_parallel.pad_weights(cfg, weights, self.model_cfg)
        mcfg = self.model_cfg
        # per device: the KV pool is split by KV head, the weights in tp parts
        bytes_per_page = mcfg.num_layers * self.page_size * mcfg.num_kv_heads // self.tp * mcfg.head_dim
        self.kv_dtype = kv_dtype(ecfg.kv_dtype, self.act_dtype)  # the keys' (and the values' unless v_dtype)
        self.v_dtype = kv_dtype(ecfg.v_dtype, self.act_dtype) if ecfg.v_dtype else self.kv_dtype
        if jnp.float8_e4m3fn in (self.kv_dtype, self.v_dtype):
            log.info("float8 KV cache (%s): rounded to 3 mantissa bits, an approximation (small models feel it: "
                     "docs/benchmarks.md, a float8 KV cache)", self.kv_dtype_name)
        bytes_per_page *= self.kv_dtype.itemsize + self.v_dtype.itemsize
        if ecfg.weights == "bf16":
            prefill_dtype = self.dtype = self.prefill_dtype = jnp.dtype(jnp.bfloat16)
        # page 0 is a scratch page: padding tokens write there, never handed to a context
        self.kv_bytes = (kv_budget_bytes(ecfg, _weight_bytes(weights, self.dtype) // self.tp,
                                         arrays=2 * mcfg.num_layers) if not ecfg.kv_pages else 0)
        self.num_pages = ecfg.kv_pages or max(2, self.kv_bytes // bytes_per_page)
        self.kv_page_bytes = bytes_per_page
        self.cascade_over_multi_bytes = CASCADE_OVER_MULTI_BYTES
        # GPUs: plain decode steps read a bfloat16 cache in place through a Pallas kernel, where it compiles
        # (the kernel pads each KV head's query group to 16 rows: "auto" takes it for groups of 4 or more)
        wanted = ecfg.decode_attention == "kernel" or (ecfg.decode_attention == "auto"
                                                       and cfg.num_heads // cfg.num_kv_heads >= 4)
        self.decode_kernel = (wanted and self.kv_dtype == self.v_dtype == jnp.bfloat16 and self.mesh is None
                              and gpu_attention.available())
        self.decode_fused = ecfg.decode_attention == "fused"  # XLA's lowering without a gathered copy
        # the dtype quantized products are asked in (quant.linear's `dtype`): the prefill dtype, but bfloat16 on a
        # CPU in the default mode without bf16 products as well: its native kernels then multiply generated rows
        # on 2 limbs, the integer sums every CPU's kernels give them bit for bit (the AVX2 code's from
        # vpmaddubsw, kernels/avx2_int8.h), and prompt rows without bf16 products (float32 with the AVX2 code,
        # on 2 limbs too with VNNI's)
        self.qdtype = prefill_dtype
        if not (ecfg.dtype or dtype) and prefill_dtype == jnp.float32 and kernels.available():  # (a CPU backend)
            self.qdtype = jnp.dtype(jnp.bfloat16)
        if self.mesh is None:
            model = Llama(cfg, weights, self.dtype, self.act_dtype, self.qdtype, decode_kernel=self.decode_kernel,
                          decode_fused=self.decode_fused)
        else:  # built on the host, then placed on the mesh shard by shard
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                model = Llama(mcfg, weights, self.dtype, self.act_dtype, self.qdtype, self.tp, self.tp_exact,
                              decode_fused=self.decode_fused)
        del weights
        # multi-step decode loops run the layers as a loop (one layer's code per executable) where they can
        self._layer_loop = (LayerLoop.of(model, self.kv_storage_dtype, self.v_storage_dtype)
                            if self.mesh is None and ecfg.layer_loop else None)
        self._layer_graphdef, layer_template = nnx.split(model.layers[0])
        self._layer_template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layer_template)
        self.weights = Weights(model.embedding(), [nnx.to_pure_dict(nnx.state(layer)) for layer in model.layers],
                               model.head_weights())
        del model
        self._specs: Weights | None = None
        if self.mesh is not None:
            self.weights, self._specs = self._shard(self.weights)
        # prefill steps use the same model with its float matrices (embedding, projections) in
        # prefill_dtype (quantized matrices are shared: XLA dequantizes them to prefill_dtype itself)
        self.prefill_weights = self.weights
        if prefill_dtype != self.dtype:
            self.prefill_weights = jax.tree.map(
                lambda a: a.astype(prefill_dtype) if a.ndim == 2 and jnp.issubdtype(a.dtype, jnp.floating) else a,
                self.weights)
        # mixed steps: a step with decodes and prompt chunks runs them in one pass over the weights (Orca's
        # selective batching), where that gives every row the bits its own kind of step gives it: attention
        # in place on a CPU (decode rows through the decode kernel, attention._prefill_in_place), the native
        # products (each row by its kind: quant.linear), and prefill weights that are the decode weights
        # (no float matrix converted to another dtype for prompts)
        same_weights = all(a is b for a, b in zip(jax.tree.leaves(self.weights), jax.tree.leaves(self.prefill_weights),
                                                  strict=True))
        self.mixed = bool(ecfg.mixed_steps and self.mesh is None and same_weights and self.prefill_in_place)
        self.mixed_steps = 0  # steps that ran decodes and prompt chunks in one pass
        # multi-step decode: a stable batch's ahead step runs this many decode steps in one call (the
        # tokens sampled and fed on the device); one process on one device only
        auto = AUTO_MULTI_STEP if self.prefill_in_place else 1
        self.multi_step = (ecfg.multi_step if ecfg.multi_step is not None else auto) if self.mesh is None else 1
        # batches a multi-step shape is compiled for: the buckets up to `multi_step_max_batch`, by default every
        # one on a CPU (each loop is an executable of its own, ~16-20 MB resident with its layers as a loop; at
        # 32 and 64 sequences ~1.13x and ~1.2x the tokens per second of one step a call on a 2-core EPYC,
        # medians of three and two runs: docs/benchmarks.md) and up to 4 on accelerators (device.py)
        self.multi_max_batch = min(ecfg.multi_step_max_batch or ecfg.bs_buckets[-1], ecfg.bs_buckets[-1])
        self.multi_step_launches = 0  # multi-step plans run
        # samplers and loops whose parts the host names (`sampling.Stages`) instead of branching on the device
        self.host_stages = host_stages()
        self.shapes = ShapeBook(ecfg, self.max_len, self.prefill_in_place, self.mixed, self.multi_step,
                                self.multi_max_batch, self.host_stages)
        self.kv: KVCache = self._alloc_kv()
        # layers run in blocks of `layers_per_call`: one compiled block function per shape serves every
        # block, so compiling costs one block's trace instead of the whole model's
        per_call = block_size(cfg.num_layers, ecfg.layers_per_call)
        self.blocks = [(i, i + per_call) for i in range(0, cfg.num_layers, per_call)]
        graphdef, template = self._layer_graphdef, self._layer_template
        act_dtype = self.act_dtype
        axis = TP_AXIS if self.mesh is not None else None

        def embed(w: Embedding, input_ids: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
            return embed_tokens(mcfg, w, input_ids, positions, act_dtype, axis)

        def head(w: HeadWeights, x: jax.Array, logits_index: jax.Array) -> jax.Array:
            return lm_logits(w, x, logits_index, axis, cfg.vocab_size)

        def scores(w: HeadWeights, x: jax.Array, rows: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
            return token_logprobs(lm_logits(w, x, rows, axis, cfg.vocab_size), targets)

        def block(layers: list[dict], x: jax.Array, cos: jax.Array, sin: jax.Array, batch: ForwardBatch,
                  ks: list[jax.Array], vs: list[jax.Array]) -> tuple[jax.Array, list, list]:
            ks, vs = list(ks), list(vs)
            for i, pure in enumerate(layers):
                state = jax.tree.map(lambda a: a, template)  # a fresh State to fill with this layer's arrays
                nnx.replace_by_pure_dict(state, pure)
                x, ks[i], vs[i] = nnx.merge(graphdef, state)(x, cos, sin, batch, ks[i], vs[i])
            return x, ks, vs

        page_size = self.page_size
        layer_loop = self._layer_loop

        def decode_loop(w: Weights, batch: ForwardBatch, ks: list[jax.Array], vs: list[jax.Array],
                        sampling: SamplingBatch, stops: jax.Array, limit: jax.Array,
                        steps: int, stages: Stages | None = None) -> tuple[jax.Array, jax.Array, list, list]:
            """Up to `steps` decode steps of `batch` (step 0's batch) in one call: each samples on the device
            and feeds its tokens to the next, until every row has taken `limit[b]` steps or sampled one of
            its `stops` ([B, S], -1: none). A row that is done writes its KV to the scratch slot and its
            tokens read -1. Returns the tokens ([steps, B]), the last step's tokens and the KV.
            With `stages` (the sampler's parts, named by the host) the loop runs all `steps` steps and its
            sampler has no branch: nothing in it reads a device value on the host (XLA's GPU loops with an
            unknown trip count and its conditionals copy their predicate to the host and wait)."""
            real = batch.logits_index >= 0
            rows = jnp.arange(batch.kv_lens.shape[0])
            width = batch.block_tables.shape[1]

            def active(j: jax.Array, stopped: jax.Array) -> jax.Array:
                return real & ~stopped & (j < limit)

            def body(carry: tuple) -> tuple:
                j, ids, stopped, ks, vs, out = carry
                live = active(j, stopped)
                at = jnp.minimum(j, jnp.maximum(limit - 1, 0))  # a done row stays at its last position
                pos = batch.positions + at
                page = jnp.clip((pos - batch.kv_offset) // page_size, 0, width - 1)
                b = dataclasses.replace(
                    batch, input_ids=ids, positions=pos,
                    slot_mapping=jnp.where(live, batch.block_tables[rows, page] * page_size + pos % page_size, 0),
                    kv_lens=jnp.where(real, batch.kv_lens + at, 0))
                x, cos, sin = embed(w.embed, ids, pos)
                x, ks, vs = (block if layer_loop is None else layer_loop)(w.layers, x, cos, sin, b, ks, vs)
                logits = head(w.head, x, batch.logits_index)
                # as a step's own sampler picks: the argmax alone unless some row samples (`_sample_slots`)
                sb = dataclasses.replace(sampling, steps=sampling.steps + j)
                if stages is None:
                    tok = jax.lax.cond(jnp.any(real & (sampling.temperature > 0)), lambda v: sample(v, sb),
                                       greedy_sample, logits)
                else:
                    tok = sample(logits, sb, stages) if stages.stochastic else greedy_sample(logits)
                out = out.at[j].set(jnp.where(live, tok, -1))
                stopped = stopped | (live & jnp.any(tok[:, None] == stops, axis=1))
                return j + 1, jnp.where(live, tok, ids), stopped, ks, vs, out

            def more(carry: tuple) -> jax.Array:
                j, _, stopped, *_ = carry
                return (j < steps) & jnp.any(active(j, stopped))

            n = batch.kv_lens.shape[0]
            init = (jnp.int32(0), batch.input_ids, jnp.zeros(n, bool), list(ks), list(vs),
                    jnp.full((steps, n), -1, jnp.int32))
            if stages is None:  # ends once every row is done
                _, last, _, ks, vs, out = jax.lax.while_loop(more, body, init)
            else:  # a known trip count: done rows idle to the end
                _, last, _, ks, vs, out = jax.lax.fori_loop(0, steps, lambda _, c: body(c), init)
            return out, last, ks, vs

        self._decode_loop = jax.jit(decode_loop, static_argnames=("steps", "stages"), donate_argnums=(2, 3))
        self._embed = jax.jit(self._spmd(embed, lambda s: (s.embed, P(), P()), (P(), P(), P())))
        self._block_fn = block
        self._blocks: dict[int, Callable] = {}  # layers per call -> the jitted block function
        self._head = jax.jit(self._spmd(head, lambda s: (s.head, P(), P()), P()))
        # prompt logprobs of a fill's tokens: compiled on first use, once per bucket of rows
        self._scores = jax.jit(self._spmd(scores, lambda s: (s.head, P(), P(), P()), (P(), P(), P())))
        self._copy = jax.jit(_copy_pages, donate_argnums=(0,))
        self._release = jax.jit(_release_pages, donate_argnums=(0,))  # CPU pools only (`release_pages`)
        self._release_compiled: concurrent.futures.Future[Callable] | None = None  # `_precompile_release`
        self._copy_width = 16
        self._greedy = jax.jit(greedy_sample)
        self._splice = jax.jit(_splice_tokens)
        # time the engine thread spends in JAX calls: dispatching steps (on a CPU that includes waiting
        # while the client's queue of computations is full) and waiting for sampled tokens (`collect`)
        self.dispatch_s = 0.0
        self.wait_s = 0.0
        self._neutrals: dict[int, tuple[SamplerExtras, jax.Array]] = {}  # batch -> (extras, counts)
        self._parts: dict[tuple, concurrent.futures.Future] = {}  # embed / head executables, shared by shapes
        self._parts_lock = threading.Lock()
        self.compiler: ShapeCompiler[Shape, StepExecutables] = ShapeCompiler(self._compile, on_drained=forget_traces)
        self.cascade_steps = 0  # decode steps that read a shared prefix once for all its forks
        # multi-process engines (multihost.py): the leader's `mirror` sends each device operation to the
        # other processes; every process numbers its operations and keeps the latest results, which
        # later operations name (the logits a sampler reads, the tokens an ahead step splices in)
        self.mirror: Mirror | None = None
        self.following = False  # a follower's runner (multihost.follow): replays the leader's operations
        self._op = 0
        self._results: collections.OrderedDict[int, object] = collections.OrderedDict()
        self.shape_misses = 0  # shapes compiled while serving, after precompile(): each one is a bug
        self.precompiled = False
        self.compile_seconds: dict[Shape, float] = {}
        # executables kept on disk by what they are built from (beside JAX's cache, on and off with it): a warm
        # start loads them without tracing and lowering each function again
        self.executables = ExecutableCache(repr((
            self.model_cfg, self.ecfg, str(self._layer_graphdef), self.dtype, self.prefill_dtype, self.act_dtype,
            self.qdtype, self.kv_dtype, self.v_dtype, self.tp, self.tp_exact, str(self.mesh), self.blocks,
            self.page_size, self.max_len, self.decode_kernel, self.decode_fused, self.prefill_in_place, self.mixed,
            self.multi_step, self.multi_max_batch, self.host_stages, self._layer_loop is not None)),
            trace_state=kernels.trace_state)

    def _shard(self, w: Weights) -> tuple[Weights, Weights]:
        """The weights placed on the mesh (column-parallel matrices in device-major order), and their specs."""
        mcfg, tp, mesh = self.model_cfg, self.tp, self.mesh
        arranged = [tensor_parallel.layer_specs(layer, mcfg, tp, self.tp_exact) for layer in w.layers]
        specs = Weights(Embedding(tensor_parallel.vocab_rows_spec(), w.embed.qtype),
                        [s for _, s in arranged],
                        dataclasses.replace(w.head, norm=P(), proj=tensor_parallel.head_proj_spec(
                            w.head.tied, w.head.qtype is not None)))
        layers = [tensor_parallel.place(a, s, mesh) for a, s in arranged]
        embed = dataclasses.replace(w.embed, table=tensor_parallel.place(w.embed.table, specs.embed.table, mesh))
        head = dataclasses.replace(w.head, norm=tensor_parallel.place(w.head.norm, P(), mesh),
                                   proj=embed.table if w.head.tied else tensor_parallel.place(
                                       w.head.proj, specs.head.proj, mesh))
        return Weights(embed, layers, head), specs

    def _spmd(self, fn: Callable, in_specs: Callable[[Weights], tuple], out_specs: object) -> Callable:
        """`fn` itself on one device; with tensor parallelism, `fn` run by every device on its shards
        (`shard_map` over the mesh; `in_specs(weight specs)` gives the arguments' specs)."""
        if self.mesh is None:
            return fn
        assert self._specs is not None
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs(self._specs), out_specs=out_specs,
                             check_vma=False)

    def _block(self, n: int) -> Callable:
        """The jitted function running `n` decoder layers (KV arrays donated)."""
        if n not in self._blocks:
            kv = tensor_parallel.kv_spec()
            fn = self._spmd(self._block_fn, lambda s: (s.layers[:n], P(), P(), P(), P(), [kv] * n, [kv] * n),
                            (P(), [kv] * n, [kv] * n))
            self._blocks[n] = jax.jit(fn, donate_argnums=(5, 6))
        return self._blocks[n]

    @property
    def kv_storage_dtype(self) -> jnp.dtype:
        """The key cache arrays' dtype (`storage_dtype`)."""
        return storage_dtype(self.kv_dtype)

    @property
    def v_storage_dtype(self) -> jnp.dtype:
        """The value cache arrays' dtype (`storage_dtype`)."""
        return storage_dtype(self.v_dtype)

    @property
    def kv_dtype_name(self) -> str:
        """The cache's element types as /health shows them: one, or the keys' and the values'."""
        if self.kv_dtype == self.v_dtype:
            return str(self.kv_dtype)
        return f"{self.kv_dtype} keys, {self.v_dtype} values"

    @functools.cached_property
    def prefill_in_place(self) -> bool:
        """Whether prefill attention reads the KV pages in place (its cost then grows with the positions a
        chunk attends to, not with its padded attention length)."""
        return attention.in_place(self.kv_storage_dtype, self.model_cfg.head_dim, self.v_storage_dtype)

    @property
    def decode_attention(self) -> str:
        """How decode steps attend: "in place" (the native CPU kernels), "kernel" (the GPU kernel), "fused" (XLA's
        lowering without a gathered copy) or "gathered" (XLA's lowering)."""
        if self.prefill_in_place:
            return "in place"
        return "kernel" if self.decode_kernel else "fused" if self.decode_fused else "gathered"

    @property
    def bf16_fills(self) -> str | None:
        """How prompt rows are multiplied in bfloat16 (`kernels.bf16_fills`), None where this engine fills
        prompts exactly (float32 mode, or no bf16 code on this CPU)."""
        return kernels.bf16_fills() if self.prefill_dtype == jnp.bfloat16 else None

    @property
    def generated_row_limbs(self) -> int | None:
        """The activations' limbs of generated rows' quantized products on the native kernels: 2 (15 bits below
        each block's largest: the default mode), 3 (23 bits: the float32 mode), None where XLA multiplies."""
        if not kernels.available():  # (they run on a CPU backend only)
            return None
        return 2 if self.qdtype == jnp.bfloat16 else 3

    @property
    def decode_attention_bf16(self) -> bool:
        """Whether decode attention multiplies in bfloat16 pairs: the bfloat16 mode over a bfloat16 cache on a
        CPU (read in place by the kernels), head sizes the kernel takes, AVX512-BF16 (kernels/decode_bf16.h).
        (A float8 cache's pages are widened to float32: as fast here, and exact.)"""
        d = self.model_cfg.head_dim
        return (self.prefill_dtype == jnp.bfloat16 and self.kv_storage_dtype == self.v_storage_dtype == jnp.uint16
                and d % 64 == 0 and d <= 256 and kernels.decode_bf16())

    def _alloc_kv(self) -> KVCache:
        mcfg = self.model_cfg
        shape = (mcfg.num_kv_heads, self.num_pages, self.page_size, mcfg.head_dim)
        n, kd, vd = mcfg.num_layers, self.kv_storage_dtype, self.v_storage_dtype
        # placed on the device explicitly (committed), as every step's output pool is: a pool that is not
        # would make the page copy that precompile() compiled compile again on the first real copy
        one = jax.sharding.SingleDeviceSharding(next(iter(jax.tree.leaves(self.weights)[0].devices())))
        self._lazy = self.mesh is None and kernels.available()
        if self._lazy:  # the CPU: pages resident once the engine writes them
            kv = jax.jit(lambda: kernels.lazy_zeros([jax.ShapeDtypeStruct(shape, kd)] * n
                                                    + [jax.ShapeDtypeStruct(shape, vd)] * n), out_shardings=one)()
            return tuple(kv[:n]), tuple(kv[n:])
        out = one if self.mesh is None else NamedSharding(self.mesh, tensor_parallel.kv_spec())
        # one compiled call fills every layer's pages (60 separate fills cost a dispatch and a compile each)
        return jax.jit(lambda: (tuple(jnp.zeros(shape, kd) for _ in range(n)),
                                tuple(jnp.zeros(shape, vd) for _ in range(n))), out_shardings=out)()

    # ---- which shape a plan runs on (the buckets themselves: self.shapes) -------------------------
    def multi_fits(self, jobs: list[Job], pages: list[list[int]], kv_len: int, steps: int) -> bool:
        """Whether a multi-step plan of these jobs (holding these KV `pages`) can run now: its shape exists and
        is compiled (or nothing was precompiled; a loop of sampler parts precompile left out is queued, to
        compile once the engine idles), no job has more stop tokens than the loop checks, one
        process drives the device alone (no tensor parallelism, no followers to mirror the call to), and the
        jobs share no long prefix that cascade attention would read once for all of them in single steps."""
        shape = self.shapes.multi_shape(len(jobs), kv_len, self.loop_stages([job.sampling for job in jobs]))
        if shape is None or steps > shape.steps or self.mirror is not None or self.following:
            return False
        if any(len(job.stop_ids) > MULTI_STOP_IDS for job in jobs):
            return False
        if self.ecfg.shared_prefix_attention and len(jobs) > 1:
            members, shared = find_shared_prefix(pages)
            own = max(len(pages[i]) - shared for i in members) * self.page_size if members else 0
            saved = (len(members) - 1) * shared * self.kv_page_bytes  # KV bytes a cascade step does not read
            if (saved >= self.cascade_over_multi_bytes
                    and self.shapes.cascade_shape(len(jobs), own, shared * self.page_size) is not None):
                return False
        if self.precompiled and not self.compiler.ready(shape):
            self.compiler.submit([shape])  # a loop of other sampler parts: compiled once the engine idles
            return False
        return True

    def loop_stages(self, params: list[SamplingParams]) -> Stages:
        """The sampler parts of a multi-step loop of jobs with these sampling parameters (what its shape names
        where the host names them: `ShapeBook.multi_shape`; elsewhere unused)."""
        if not self.host_stages:
            return GREEDY
        n = len(params)
        return Stages.of(SamplingBatch.build(params, [0] * n, n, [0] * n), self.cfg.vocab_size)

    # ---- running ----------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> np.ndarray | None:
        """Run a scheduler plan and wait for it: `collect(launch(plan))`."""
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan, prev: Launched | None = None) -> Launched:
        """Dispatch a plan: its page copies, then the decode batch and the prefill batch, without waiting
        for the device (except where a job's sampling needs the host: constraints, logprobs, penalties).
        `prev`: the step in flight whose sampled tokens this plan's PENDING slots feed."""
        if plan.copies:
            self.copy_pages(plan.copies)
        if plan.steps > 1:
            return self._run_steps(plan, prev)
        parts: list[tuple[jax.Array | np.ndarray | None, int]] = []
        mixed = self._mixed(plan)
        if mixed is not None:  # one pass for the decodes and the prompt chunks
            self.mixed_steps += 1
            parts.append((self._run_slots(plan.decode + plan.prefill, False, prev, mixed), len(plan.slots)))
            return Launched(parts, any(s.sample for s in plan.slots))
        for slots, decode in ((plan.decode, True), (plan.prefill, False)):
            if slots:
                parts.append((self._run_slots(slots, decode, prev), len(slots)))
        return Launched(parts, any(s.sample for s in plan.slots))

    def _mixed(self, plan: StepPlan) -> Shape | None:
        """The shape to run a plan's decodes and prompt chunks in one pass, or None: two passes (mixing is off
        here, the decodes read a shared prefix (cascade attention reads it once for all), or the shape is
        missing or still compiling)."""
        if not (self.mixed and plan.decode and plan.prefill):
            return None
        if self.ecfg.shared_prefix_attention and len(plan.decode) > 1 and find_shared_prefix(
                [s.pages for s in plan.decode])[1]:
            return None
        slots = plan.slots
        rows = sum(len(s.tokens) if s.rows else 1 for s in slots)  # a rows slot: a row a token
        shape = self.shapes.mixed_shape(rows, sum(len(s.tokens) for s in slots),
                                        max(s.start + len(s.tokens) for s in slots))
        if shape is None or (self.precompiled and not self.compiler.ready(shape)):
            return None
        return shape

    def collect(self, launched: Launched) -> np.ndarray | None:
        """Wait for a launched plan's sampled tokens: one per slot (meaningful where `slot.sample`), or
        None if no slot samples. The time spent waiting adds to `wait_s`."""
        if not launched.samples:
            return None
        t0 = time.perf_counter()
        parts = [np.asarray(t)[..., :n] if t is not None else np.zeros(n, np.int32) for t, n in launched.parts]
        self.wait_s += time.perf_counter() - t0
        return np.concatenate(parts, axis=-1)

    def _run_steps(self, plan: StepPlan, prev: Launched | None) -> Launched:
        """Dispatch a multi-step plan (`StepPlan.steps` > 1): its decode batch runs the shape's decode loop
        once; every slot's KV pages are in its block table from the start."""
        slots = plan.decode
        params = [s.job.sampling for s in slots]
        shape = self.shapes.multi_shape(len(slots), max(s.start + s.steps for s in slots), self.loop_stages(params))
        assert shape is not None and plan.steps <= shape.steps and not plan.prefill
        batch = build_batch([SequenceSlice(s.tokens, s.start, s.pages) for s in slots], self.page_size,
                            shape.tokens, shape.batch, shape.q_len, shape.pages)
        stops = np.full((shape.batch, MULTI_STOP_IDS), -1, np.int32)
        limit = np.zeros(shape.batch, np.int32)
        for b, s in enumerate(slots):
            own = s.pages[: -(-(s.start + s.steps) // self.page_size)]
            batch.block_tables[b, : len(own)] = own
            ids = sorted(s.job.stop_ids)
            stops[b, : len(ids)] = ids
            limit[b] = s.steps
        sampling = SamplingBatch.build(params, _sampler_steps(slots, prev), shape.batch, [p.seed or 0 for p in params])
        out, last = self.run_loop(shape, batch, sampling, stops, limit, _pending_splice(slots, shape.tokens, prev))
        return Launched([(out, len(slots))], True, steps=plan.steps, last=last)

    def run_loop(self, shape: Shape, batch: ForwardBatch, sampling: SamplingBatch, stops: np.ndarray,
                 limit: np.ndarray, splice: tuple[np.ndarray, jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
        """Dispatch a multi-step shape's decode loop (`shape.steps` > 1) on a host batch of its shape: each row
        takes up to `limit[b]` steps, stopping at its `stops`. Returns the tokens ([steps, B], -1 past a
        row's end) and the last step's, without waiting for them."""
        exe, compiled_now = self.compiler.get(shape)
        if compiled_now and self.precompiled:
            self.shape_misses += 1
            log.warning("compiled shape %s at serve time (not precompiled)", shape)
        assert exe.loop is not None
        t0 = time.perf_counter()
        batch = self._spliced(self._to_device(batch, shape), shape, splice)
        out, last, ks, vs = exe.loop(self.weights, batch, list(self.kv[0]), list(self.kv[1]), sampling, stops, limit)
        self.kv = (tuple(ks), tuple(vs))
        self.dispatch_s += time.perf_counter() - t0
        self.multi_step_launches += 1
        return out, last

    def _run_slots(self, slots: list[Slot], decode: bool, prev: Launched | None = None,
                   shape: Shape | None = None) -> jax.Array | np.ndarray | None:
        given = slots
        verifying = any(s.rows for s in slots)
        if verifying:  # each token of a rows slot (a verify slot, forced or recomputed tokens) is a decode row
            slots = _as_rows(slots)
        seqs = [SequenceSlice(s.tokens, s.start, s.pages, fill=s.prompt) for s in slots]
        if shape is None and decode and self.ecfg.shared_prefix_attention and len(slots) > 1 and not verifying:
            shape = self._cascade(seqs)
        if shape is None:
            kv_len = max(s.start + len(s.tokens) for s in slots)
            shape = (self.shapes.decode_shape(len(slots), kv_len) if decode
                     else self.shapes.prefill_shape(len(slots), max(len(s.tokens) for s in slots), kv_len,
                                             sum(len(s.tokens) for s in slots)))
        batch = build_batch(seqs, self.page_size, shape.tokens, shape.batch, shape.q_len, shape.pages,
                            shape.prefix_pages)
        splice = _pending_splice(slots, shape.tokens, prev)
        sampling = [s.job.sampling for s in slots if s.sample]
        unmasked = [i for i, s in enumerate(slots) if self.lazy_masks and s.sample and lazily_constrained(s.job)]
        lazy = len(unmasked) >= LAZY_MIN_ROWS  # greedy constrained rows checked after sampling, masks on demand
        # each row's grammar state: a verify row's is its job's after the draft's tokens before it
        checks = [(slots[i].job.constraint.after(slots[i].before), i) for i in unmasked] if lazy else []

        def extras_of() -> tuple[SamplerExtras, np.ndarray | None] | None:
            """Constraint masks, penalty counts (None: no job needs them)."""
            before = [s.before for s in slots] if verifying else None
            return SamplerExtras.build([s.job if s.sample else None for s in slots], shape.batch, self.cfg.vocab_size,
                                       lazy=lazy, before=before)

        # on a CPU the masks are computed before the step (computed while it runs, llguidance and XLA only
        # take turns on the same cores); on an accelerator while the device runs it
        extras = extras_of() if sampling and self._masks_first else None
        rows, owners = self._score_rows(slots)
        logits, scored = self.forward_scored(batch, splice, rows)
        if scored is not None:  # prompt logprobs of fills: read now (a fill's step is never run ahead)
            chosen, top_ids, top_lp = (np.asarray(a) for a in scored)
            for r, (slot, i) in enumerate(owners):
                assert slot.scores is not None
                slot.scores[i] = SampledLogprob(float(chosen[r]), top_ids[r], top_lp[r])
        if not sampling:
            return None
        if not self._masks_first:
            extras = extras_of()
        tokens = self._sample_slots(slots, logits, extras, shape.batch, prev)
        if checks:  # greedy constrained rows sampled unmasked: their grammars check the tokens now
            tokens = np.array(np.asarray(tokens)[: len(slots)])
            check_greedy(checks, tokens, lambda: np.asarray(logits), self.cfg.vocab_size)
        return _verified(given, slots, np.asarray(tokens)) if verifying else tokens

    def _sample_slots(self, slots: list[Slot], logits: jax.Array, extras: tuple | None,
                      batch: int, prev: Launched | None = None) -> jax.Array | np.ndarray:
        """The sampled tokens of a batch: greedy argmax, the plain sampler, or the processed one (`extras`).
        `prev`: the step in flight that samples the PENDING slots' tokens."""
        sampling = [s.job.sampling for s in slots if s.sample]
        if extras is None and all(p is None or p.greedy for p in sampling):
            return self.sample(logits, None)
        params = [s.job.sampling if s.sample else sampling[0] for s in slots]
        sb = SamplingBatch.build(params, _sampler_steps(slots, prev), batch, [p.seed or 0 for p in params])
        if extras is None:
            return self.sample(logits, sb)
        tokens, chosen, top_ids, top_lp = self.sample_processed(logits, sb, *extras)
        for i, s in enumerate(slots):
            if s.sample and s.job.sampling.logprobs is not None:
                s.logprob = SampledLogprob(float(chosen[i]), top_ids[i], top_lp[i])
        return tokens[: len(slots)]

    def _score_rows(self, slots: list[Slot]) -> tuple[tuple[np.ndarray, np.ndarray] | None, list[tuple[Slot, int]]]:
        """The flat batch rows whose logprobs fills asked for (`Slot.targets`) and the tokens they predict,
        padded to a token bucket, and each row's (slot, token index); (None, []) when no slot asks."""
        index: list[int] = []
        targets: list[int] = []
        owners: list[tuple[Slot, int]] = []
        off = 0
        for s in slots:
            if s.targets is not None:
                s.scores = [None] * len(s.tokens)
                for i, t in enumerate(s.targets):
                    if t >= 0:
                        index.append(off + i)
                        targets.append(t)
                        owners.append((s, i))
            off += len(s.tokens)
        if not index:
            return None, []
        n = pick_bucket(len(index), self.ecfg.token_buckets)
        rows = np.zeros((2, n), np.int32)
        rows[0, : len(index)] = index
        rows[1, : len(targets)] = targets
        return (rows[0], rows[1]), owners

    def _cascade(self, seqs: list[SequenceSlice]) -> Shape | None:
        """Mark the largest group of decode sequences sharing prefix pages (forks of one context) and
        return the cascade shape for the batch, or None (no group, or no cascade bucket fits)."""
        members, shared = find_shared_prefix([s.pages for s in seqs])
        if not shared:
            return None
        for i in members:
            seqs[i].shared_pages = shared
        own = max(s.start + len(s.tokens) - s.shared_pages * self.page_size for s in seqs)
        shape = self.shapes.cascade_shape(len(seqs), own, shared * self.page_size)
        if shape is not None and self.precompiled and not self.compiler.ready(shape):
            shape = None  # still compiling (cascade shapes come last): the plain decode shape is ready sooner
        if shape is None:
            for i in members:
                seqs[i].shared_pages = 0
        else:
            self.cascade_steps += 1
        return shape

    def prefill_logits(self, tokens: list[int], start: int, pages: list[int]) -> jax.Array:
        """Feed `tokens` at positions `start..` into the KV `pages` (chunks of at most
        max_num_batched_tokens) and return the last token's logits ([1, vocab]). A direct model call
        for logits checks: the pages must belong to no live context."""
        chunk = self.ecfg.max_num_batched_tokens
        logits = None
        for off in range(0, len(tokens), chunk):
            part = tokens[off : off + chunk]
            pos = start + off
            shape = self.shapes.prefill_shape(1, len(part), pos + len(part))
            seq = SequenceSlice(part, pos, pages, fill=True)
            logits = self.forward(build_batch([seq], self.page_size, shape.tokens, shape.batch, shape.q_len,
                                              shape.pages))
        if logits is None:
            raise ValueError("no tokens to feed")
        return logits

    def forward(self, batch: ForwardBatch, splice: tuple[np.ndarray, jax.Array] | None = None) -> jax.Array:
        """Run one step; returns the logits of each sequence's last token ([B, vocab]). `splice`: (src,
        tokens) replaces input_ids[i] with tokens[src[i]] where src[i] >= 0, on the device."""
        return self.forward_scored(batch, splice)[0]

    def forward_scored(self, batch: ForwardBatch, splice: tuple[np.ndarray, jax.Array] | None = None,
                       rows: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[jax.Array, tuple | None]:
        """`forward`, and with `rows` = (flat token indices, target token ids) the targets' logprobs and the
        top tokens at those rows (`logprobs.token_logprobs`, on the device)."""
        if self.mirror is not None:
            self.mirror.send("forward", (batch, None if splice is None else (splice[0], self._name(splice[1])), rows))
        logits, scored = self._forward(batch, splice, rows)
        return self._keep(logits), scored

    def _forward(self, batch: ForwardBatch, splice: tuple[np.ndarray, jax.Array] | None,
                 rows: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[jax.Array, tuple | None]:
        shape = Shape(batch.num_tokens, batch.batch_size, int(batch.q_index.shape[1]),
                      int(batch.block_tables.shape[1]), int(batch.prefix_pages.shape[0]))
        exe, compiled_now = self.compiler.get(shape)
        if compiled_now and self.precompiled:
            self.shape_misses += 1
            log.warning("compiled shape %s at serve time (not precompiled)", shape)
        w = self.prefill_weights if shape.q_len > 1 else self.weights
        t0 = time.perf_counter()
        batch = self._spliced(self._to_device(batch, shape), shape, splice)
        x, cos, sin = self._done(exe.embed(w.embed, batch.input_ids, batch.positions))
        ks, vs = list(self.kv[0]), list(self.kv[1])
        for a, b in self.blocks:
            x, ks[a:b], vs[a:b] = self._done(exe.blocks[b - a](w.layers[a:b], x, cos, sin, batch, ks[a:b], vs[a:b]))
        self.kv = (tuple(ks), tuple(vs))
        logits = self._done(exe.head(w.head, x, batch.logits_index))
        scored = None if rows is None else self._done(self._scores(w.head, x, *self._put(rows)))
        self.dispatch_s += time.perf_counter() - t0
        return logits, scored

    def _spliced(self, batch: ForwardBatch, shape: Shape, splice: tuple[np.ndarray, jax.Array] | None) -> ForwardBatch:
        """The device batch with its PENDING input ids replaced by the tokens the step in flight sampled
        (`splice`: (src, tokens), see `_pending_splice`), by the shape's compiled splice where it is ready."""
        if splice is None:
            return batch
        fut = self._parts.get(("splice", shape.tokens))
        fn = fut.result() if fut is not None and fut.done() and len(splice[1]) == shape.tokens else self._splice
        return dataclasses.replace(batch, input_ids=fn(batch.input_ids, self._put(splice[0]), splice[1]))

    def _to_device(self, batch: ForwardBatch, shape: Shape) -> ForwardBatch:
        """The step's batch on the device: on one device its host arrays go as one packed transfer, unpacked
        by the compiled `unpack` of its arrays' shapes; otherwise (tensor parallelism, arrays already on a
        device, or that executable not compiled yet) array by array. The unpacking is compiled on a shape's
        first step, in the background (`_compile_unpack`), not by `precompile`: it is a quarter of the
        compile time of all shapes, and most shapes are never used."""
        if self.mesh is None and not isinstance(batch.input_ids, jax.Array):
            key = ("unpack", shape.tokens, shape.batch, shape.q_len, shape.pages, shape.prefix_pages)
            fut = self._parts.get(key)
            if fut is None:
                self._compile_unpack(key, batch)
            elif fut.done() and fut.exception() is None:
                return fut.result()(jax.device_put(pack(batch)))
        return jax.device_put(batch, self._replicated) if jax.process_count() == 1 else self._put(batch)

    def _compile_unpack(self, key: tuple, batch: ForwardBatch) -> None:
        """Compile `unpack` for `batch`'s array shapes on a thread of its own, once (`_parts[key]`; a failure
        is logged and kept, so the steps go on array by array)."""
        with self._parts_lock:
            if key in self._parts:
                return
            fut = self._parts[key] = concurrent.futures.Future()
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), batch)
        packed = jax.ShapeDtypeStruct((sum(int(np.prod(a.shape)) for a in jax.tree.leaves(like)),), jnp.int32)
        unpacker = jax.jit(functools.partial(unpack, like=like))

        def run() -> None:
            try:  # as a shape's compile: a cache entry that does not load gets a second try without the cache
                fut.set_result(compile_with_fallback(lambda: unpacker.lower(packed).compile(), key))
            except Exception as exc:
                log.warning("compiling the batch unpacking of %s failed; its steps send their arrays one by one",
                            key[1:], exc_info=True)
                fut.set_exception(exc)

        # not a daemon: a process that ends (a script's last step) waits for it instead of aborting in XLA's compiler
        threading.Thread(target=run, name="parrot-unpack-compile").start()

    def _done(self, out: object) -> object:
        """`out`, waited for where calls must not queue up (tensor parallelism on a CPU, see __init__)."""
        return jax.block_until_ready(out) if self._serial else out

    @property
    def compiled(self) -> set[Shape]:
        return set(self.compile_seconds)

    def _compile(self, shape: Shape) -> StepExecutables:
        """Ahead-of-time compile one shape's step (from abstract values only, so several shapes can
        compile in parallel threads while the engine runs): the block function for each block size,
        plus the embedding, head and samplers of its token and batch counts if no shape had them."""
        return compile_with_fallback(lambda: self._compile_shape(shape), shape)

    def _compile_shape(self, shape: Shape) -> StepExecutables:
        t0 = time.perf_counter()
        w = self._abstract(self.prefill_weights if shape.q_len > 1 else self.weights)
        tokens = self._abstract(jax.ShapeDtypeStruct((shape.tokens,), jnp.int32))
        embed = self._part(("embed", shape.tokens, w.embed.table.dtype),
                           lambda: self._aot("embed", self._embed, w.embed, tokens, tokens))
        x, cos, sin = self._abstract(jax.eval_shape(self._embed, w.embed, tokens, tokens))
        batch = self._abstract(self.dummy_batch(shape))
        if shape.steps > 1:
            return self._compile_loop(shape, w, batch, tokens, t0)
        kv = self._abstract(self.kv)
        blocks = {n: self._aot(f"block{n}", self._block(n), w.layers[:n], x, cos, sin, batch, list(kv[0][:n]),
                               list(kv[1][:n]))
                  for n in sorted({b - a for a, b in self.blocks})}
        rows = self._abstract(jax.ShapeDtypeStruct((shape.batch,), jnp.int32))
        head = self._part(("head", shape.tokens, shape.batch, w.head.proj.dtype),
                          lambda: self._aot("head", self._head, w.head, x, rows))
        logits = self._abstract(jax.ShapeDtypeStruct((shape.batch, self.cfg.vocab_size), jnp.float32))
        self._part(("greedy", shape.batch), lambda: self._aot("greedy", self._greedy, logits))
        params = self._abstract(SamplingBatch.build([], [], shape.batch, []))
        extras = self._abstract(SamplerExtras.neutral(shape.batch, self.cfg.vocab_size))
        counts = self._abstract(jax.ShapeDtypeStruct((shape.batch, self.cfg.vocab_size), jnp.int32))
        for stages in COMMON_DRAWS if self.host_stages else (None,):  # None: one sampler, branching on the device
            self._part(("sampler", shape.batch, stages),
                       lambda st=stages: self._aot("sampler", processed_sampler, logits, params, extras, counts,
                                                   stages=st))
        if shape.q_len == 1:  # decode: an ahead step takes its PENDING tokens from the previous one (overlap)
            self._part(("splice", shape.tokens), lambda: self._aot("splice", self._splice, tokens, tokens, rows))
        self.compile_seconds[shape] = time.perf_counter() - t0
        return StepExecutables(embed, blocks, head)

    def _compile_loop(self, shape: Shape, w: Weights, batch: ForwardBatch, tokens: jax.ShapeDtypeStruct,
                      t0: float) -> StepExecutables:
        """A multi-step shape's decode loop and its token splice."""
        kv = self._abstract(self.kv)
        b = shape.batch
        stops = jax.ShapeDtypeStruct((b, MULTI_STOP_IDS), jnp.int32)
        limit = jax.ShapeDtypeStruct((b,), jnp.int32)
        params = self._abstract(SamplingBatch.build([], [], b, []))
        loop = self._aot("decode_loop", self._decode_loop, w, batch, list(kv[0]), list(kv[1]), params, stops, limit,
                         steps=shape.steps, stages=shape.sampler)
        self._part(("splice", shape.tokens), lambda: self._aot("splice", self._splice, tokens, tokens, limit))
        self.compile_seconds[shape] = time.perf_counter() - t0
        return StepExecutables(None, {}, None, loop)

    def _abstract(self, tree: object) -> object:
        """Shapes and dtypes of `tree`'s arrays for ahead-of-time lowering, with their shardings (host
        arrays: replicated over the mesh)."""
        def leaf(a: object) -> jax.ShapeDtypeStruct:
            sharding = getattr(a, "sharding", None)  # a device array's or an abstract value's; numpy: none
            return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding or self._replicated)

        return jax.tree.map(leaf, tree)

    def _aot(self, name: str, fn: Callable, *args: object, **kwargs: object) -> Callable:
        """`fn` compiled ahead of time for these abstract arguments, or its executable kept on disk."""
        return self.executables.compile(name, fn, *args, **kwargs)

    def _part(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        """An executable shared by several shapes, built once (other threads wait for it). If the thread
        building it fails, a waiting thread builds it itself (e.g. with the cache bypassed)."""
        while True:
            with self._parts_lock:
                fut = self._parts.get(key)
                mine = fut is None
                if mine:
                    fut = self._parts[key] = concurrent.futures.Future()
            if not mine:
                try:
                    return fut.result()
                except Exception:
                    continue  # its builder failed and dropped it: try building it here
            try:
                fut.set_result(build())
            except BaseException as exc:
                with self._parts_lock:
                    del self._parts[key]
                fut.set_exception(exc)
                raise
            return fut.result()

    def sample(self, logits: jax.Array, sampling: SamplingBatch | None) -> jax.Array:
        """Token ids [B], left on the device. None samples greedily (the compiled argmax-only path)."""
        if self.mirror is not None:
            self.mirror.send("sample", (self._name(logits), sampling))
        return self._keep(self._sample_tokens(logits, sampling))

    def _sample_tokens(self, logits: jax.Array, sampling: SamplingBatch | None) -> jax.Array:
        t0 = time.perf_counter()
        if sampling is None:
            fut = self._parts.get(("greedy", int(logits.shape[0])))
            tokens = (fut.result() if fut is not None and fut.done() else self._greedy)(logits)
        else:  # the batch size's sampler, with neutral extras and no penalties
            batch = int(logits.shape[0])
            tokens = self._sampler(batch, self._named(sampling))(logits, self._put(sampling), *self._neutral(batch))[0]
        self.dispatch_s += time.perf_counter() - t0
        return tokens

    def _named(self, sampling: SamplingBatch, extras: SamplerExtras | None = None,
               counts: np.ndarray | None = None) -> Stages | None:
        """The sampler parts a host batch needs where the host names them (`host_stages`); None elsewhere (the
        compiled sampler branches on the device)."""
        return Stages.of(sampling, self.cfg.vocab_size, extras, counts) if self.host_stages else None

    def _sampler(self, batch: int, stages: Stages | None) -> Callable:
        """The compiled sampler of a batch size and sampler parts (`sampling.sample_processed`, with counts;
        `stages` None: one for every batch, branching on the device), or the jitted function where no shape
        has compiled it (other parts than precompile's: compiled on first use, once)."""
        fut = self._parts.get(("sampler", batch, stages))
        if fut is not None and fut.done():
            return fut.result()
        return functools.partial(processed_sampler, stages=stages)

    def _neutral(self, batch: int) -> tuple[SamplerExtras, jax.Array]:
        """Extras that change nothing and zero token counts for a batch size, kept on the device. The counts
        ([B, V] int32) are only read where a row has a penalty; where the native kernels run they take no
        memory until written (`kernels.lazy_zeros`), and nothing writes them."""
        got = self._neutrals.get(batch)
        if got is None:
            shape = jax.ShapeDtypeStruct((batch, self.cfg.vocab_size), jnp.int32)
            if self.mesh is not None:
                counts = self._put(np.zeros(shape.shape, np.int32))
            elif kernels.available():
                counts = kernels.lazy_zeros([shape])[0]
            else:  # on the device, not sent with every step
                counts = jnp.zeros(shape.shape, jnp.int32)
            extras = SamplerExtras.neutral(batch, self.cfg.vocab_size)
            got = (jax.device_put(extras) if self.mesh is None else self._put(extras), counts)
            self._neutrals[batch] = got
        return got

    def sample_processed(self, logits: jax.Array, sampling: SamplingBatch, extras: SamplerExtras,
                         counts: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """Penalties, bias, masks, min-p and logprobs (`sampling.sample_processed`): (tokens, their raw
        logprobs, top token ids, top logprobs)."""
        if self.mirror is not None:
            self.mirror.send("processed", (self._name(logits), sampling, extras, counts))
        self._keep(None)
        batch = int(logits.shape[0])
        # the counts the sampler reads are zeros where no job has a penalty (`_neutral`): no part of it
        stages = self._named(sampling, extras, counts)
        sampling, extras, counts = self._put((sampling, extras, counts))
        out = self._sampler(batch, stages)(logits, sampling, extras,
                                           self._neutral(batch)[1] if counts is None else counts)
        return tuple(np.asarray(a) for a in out)

    @property
    def lazy_pool(self) -> bool:
        """Whether the KV pool takes memory only where pages are written, and can give free pages back
        (`release_pages`): one process on a CPU with the native kernels (`kernels.lazy_zeros`)."""
        return self._lazy and self.mirror is None and not self.following

    def release_pages(self, pages: np.ndarray) -> None:
        """Give the free pages of the bool mask `pages` [num_pages] back to the OS in every layer's K and V
        (`kernels.release_pages`, in place): the pool's memory follows the pages in use again after a peak. Their
        contents are lost, which nothing reads: a page's keys and values are written before they are read."""
        assert self.lazy_pool
        release = self._release if self._release_compiled is None else self._release_compiled.result()
        before = [a.unsafe_buffer_pointer() for a in self.kv[0]]
        self.kv = release(self.kv, np.asarray(pages, np.uint8))
        jax.block_until_ready(self.kv)
        if [a.unsafe_buffer_pointer() for a in self.kv[0]] != before:  # correct, but the old pool was copied
            log.warning("the KV pool was copied to give its free pages back (a buffer of it is referenced elsewhere)")

    def _precompile_release(self) -> None:
        """Compile `release_pages`'s call on a thread of its own (precompile): its first use, after the engine's
        first idle period, does not compile on the loop (83 ms on a 2-core EPYC Zen 3, 0.2 s beside warm-up's
        compiles). Where that compile fails, the call is compiled on first use instead."""
        kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.kv)
        mask = jax.ShapeDtypeStruct((self.num_pages,), jnp.uint8)
        done: concurrent.futures.Future[Callable] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(self._release.lower(kv, mask).compile())
            except Exception:
                log.warning("precompiling the KV page release failed; it compiles on first use", exc_info=True)
                done.set_result(self._release)

        self._release_compiled = done
        threading.Thread(target=run, name="parrot-release-compile", daemon=True).start()

    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Copy whole pages src -> dst in every layer's K and V (fork / copy-on-write of a partial page)."""
        if self.mirror is not None:
            self.mirror.send("copy", (copies,))
        self._keep(None)
        n = self._copy_width
        for i in range(0, len(copies), n):
            part = copies[i : i + n]
            src = np.zeros(n, np.int32)
            dst = np.zeros(n, np.int32)  # padding copies scratch page 0 onto itself
            src[: len(part)] = [c.src for c in part]
            dst[: len(part)] = [c.dst for c in part]
            self.kv = self._copy(self.kv, *self._put((src, dst)))

    # ---- several processes (multihost.py) ------------------------------------------------------
    def _put(self, tree: object) -> object:
        """Host arrays (sampler inputs, page numbers) as a step takes them: as they are on one device
        (the compiled call transfers them), replicated over the mesh with tensor parallelism (built from
        each process's own copy where the mesh spans processes)."""
        if self.mesh is None:
            return tree
        if jax.process_count() == 1:
            return jax.device_put(tree, self._replicated)
        sharding = self._replicated

        def put(a: object) -> object:
            if a is None or isinstance(a, jax.Array):
                return a
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

        return jax.tree.map(put, tree)

    def _keep(self, result: object) -> object:
        """Number this operation and keep its result for later operations to name (only in a process of
        a multi-process engine: elsewhere nothing names them, and a batch's logits are not held on)."""
        if self.mirror is None and not self.following:
            return result
        self._op += 1
        self._results[self._op] = result
        while len(self._results) > 16:
            self._results.popitem(last=False)
        return result

    def _name(self, array: object) -> int:
        """The number of the operation that made `array`."""
        for op, result in reversed(self._results.items()):
            if result is array:
                return op
        raise ValueError("a device array that no recent operation of this runner made")

    def replay(self, op: str, args: tuple) -> None:
        """Run an operation the leader sent (a follower's loop, multihost.follow)."""
        if op == "forward":
            batch, splice, rows = args
            self._keep(self._forward(batch, None if splice is None else (splice[0], self._results[splice[1]]),
                                     rows)[0])
        elif op == "sample":
            self._keep(self._sample_tokens(self._results[args[0]], args[1]))
        elif op == "processed":
            self.sample_processed(self._results[args[0]], *args[1:])
        elif op == "copy":
            self.copy_pages(*args)
        else:
            raise ValueError(f"unknown operation {op!r}")

    def close(self, timeout: float = 60.0) -> None:
        """Wait for the compiles under way on threads of their own (a process ending inside XLA's compiler
        aborts), and let the followers of a multi-process engine go (the leader is done)."""
        with self._parts_lock:
            pending = [f for k, f in self._parts.items() if k[0] == "unpack" and not f.done()]
        if self._release_compiled is not None:
            pending.append(self._release_compiled)
        if concurrent.futures.wait(pending, timeout=timeout).not_done:
            log.warning("a batch unpacking or the page release was still compiling %.0f s after the engine stopped",
                        timeout)
        if self.mirror is not None:
            self.mirror.stop()
            self.mirror = None

    def dummy_batch(self, shape: Shape) -> ForwardBatch:
        """A batch of the given shape writing only to the scratch page."""
        return build_batch([], self.page_size, shape.tokens, shape.batch, shape.q_len, shape.pages,
                           shape.prefix_pages)

    def precompile(self, shapes: Iterable[Shape] | None = None, progress: bool = True, wait: bool = True) -> None:
        """Compile every serving shape (default: `all_shapes()`, smallest first), so serving never
        compiles. With `wait=False` compiling goes on in the background: a step whose shape is not ready
        yet waits for it (moved to the front of the queue); `compile_status()` tells the progress."""
        todo = list(dict.fromkeys(self.shapes.all_shapes() if shapes is None else shapes))
        todo.sort(key=lambda s: (s.steps > 1, s.prefix_pages > 0, s.pages, s.batch, s.tokens))  # needed first
        self.copy_pages([PageCopy(0, 0, 0)])  # compiles the page copy (scratch page 0 onto itself)
        if self.lazy_pool:
            self._precompile_release()
        self.compiler.submit(todo)
        self.precompiled = True
        if wait:
            with tqdm(total=len(todo), desc="precompiling", unit="shape", disable=None if progress else True) as bar:
                self.compiler.wait(todo, on_done=lambda: bar.update(1))

    def compile_status(self) -> tuple[int, int]:
        """(shapes compiled, shapes to compile)."""
        return self.compiler.status()


def storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """A cache array's dtype for elements of `dtype`: on a CPU bfloat16 is held as uint16 bit patterns, and
    float8 as uint8 ones everywhere (attention.write_kv)."""
    if dtype == jnp.float8_e4m3fn:
        return jnp.dtype(jnp.uint8)
    return jnp.dtype(jnp.uint16 if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else dtype)


def kv_dtype(setting: str, act_dtype: jnp.dtype) -> jnp.dtype:
    """The KV cache's element type for the `kv_dtype` setting (see EngineConfig)."""
    if setting == "fp8":
        return jnp.dtype(jnp.float8_e4m3fn)
    if setting == "bf16" or (setting == "auto" and jax.default_backend() == "cpu" and kernels.available()):
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32) if setting == "f32" else act_dtype


def resolve_weights(weights: dict[str, Weight], mode: str) -> tuple[dict[str, Weight], str]:
    """Apply the `weights` setting: quantized matrices stay quantized ("auto" where the native CPU
    kernels run), or are dequantized exactly to float32 (cast to the compute dtype by the model); "q8_0",
    "q4_1", "q4_0": float matrices are quantized to those blocks (`quant.quantize_matrices`). Returns the
    weights and what they are: "quantized" (some matrices kept in blocks) or "float"."""
    if mode in QUANTIZE_AT_LOAD:
        if not kernels.available():
            raise ValueError(f"--weights {mode} needs the native CPU kernels: {kernels.unavailable_reason()}")
        return quant.quantize_matrices(weights, mode), "quantized"
    keep = mode == "auto" and any(isinstance(w, QuantizedTensor) for w in weights.values()) and kernels.available()
    if keep:
        return weights, "quantized"
    return {k: w.dequantize() if isinstance(w, QuantizedTensor) else w for k, w in weights.items()}, "float"


def _weight_bytes(weights: dict[str, Weight], dtype: jnp.dtype) -> int:
    """What the weights take on the device: quantized blocks as they are, float matrices in `dtype`."""
    return sum(w.data.nbytes if isinstance(w, QuantizedTensor) else np.size(w) * jnp.dtype(dtype).itemsize
               for w in weights.values())
