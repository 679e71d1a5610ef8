"""Shared fixtures: the default model (loaded once per test session), tiny random models, and one persistent
compilation cache for the session (`PARROT_TEST_COMPILE_CACHE=0` turns it off)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import jax
import pytest

from parrot import procinfo
from parrot.config import EngineConfig
from parrot.engine.compile_cache import enable_compilation_cache, set_cache_dir
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.models.llama import LlamaConfig, random_weights
from parrot.engine.runner import ModelRunner
from parrot.engine.tokenizer import BYTE_LEVEL_CHAT_TEMPLATE, Tokenizer
from parrot.errors import ModelLoadError
from parrot.protocol import TokenLogprob

TINY = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=512)


TINY_CHAT_TEMPLATE = BYTE_LEVEL_CHAT_TEMPLATE  # ChatML


def tiny_tokenizer() -> Tokenizer:
    """Byte-level tokenizer without merges: 256 byte tokens + 4 control tokens (ids 256..259)."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|im_start|>", "<|im_end|>", "<pad>", "<unk>"]
    return Tokenizer.from_gguf_metadata(tokens, [], [1] * 256 + [3] * 4, None, bos_token_id=256, eos_token_id=257,
                                        chat_template=TINY_CHAT_TEMPLATE)


def tiny_model(seed: int = 0) -> LoadedModel:
    return LoadedModel(TINY, random_weights(TINY, seed=seed), tiny_tokenizer(), "tiny-random")


def tiny_engine_config(**kw) -> EngineConfig:
    """Small buckets and pool; float32 on every backend (the engine tests compare batched, forked and
    preempted runs token for token: that is exact in float32 with HIGHEST-precision products, not in
    an accelerator's default bfloat16); one decode step a call unless a test asks for multi-step decode."""
    base = dict(compilation_cache_dir=None, kv_memory_mb=4, dtype="float32", token_buckets=[16, 32, 64, 128],
                multi_step=1,  # each multi-step shape compiles the whole model's loop: the tests that run it ask
                bs_buckets=[1, 2, 4, 8, 16], max_batch_size=16, prefill_bs_buckets=[1, 4],  # as on a CPU (explicit)
                cascade_suffix_buckets=[64, 128], kv_buckets=[64, 128, 256, 512], max_num_batched_tokens=128)
    base.update(kw)
    # kept on accelerators too, where `device.for_device` would raise a value equal to EngineConfig's default
    base["explicit"] = ("prefill_bs_buckets", *kw.get("explicit", ()))
    return EngineConfig(**base)


def same_logprobs(got: list[TokenLogprob] | None, want: list[TokenLogprob] | None, tol: float = 1e-5,
                  float_weights: bool = False) -> bool:
    """Two generates' logprobs (lists of TokenLogprob, or None) agree: the same tokens and alternatives, and the
    same values bit for bit where the native CPU kernels compute the step (a row's bits do not depend on the
    batch), within `tol` elsewhere (float32 rounding; more with a bfloat16 KV cache): XLA's products order a
    row's sums by the batch's shape. `float_weights`: a model whose float weights (the tiny random model's) go
    through XLA's products on every backend, so its rows' bits follow the batch's shape there too."""
    from parrot.engine import kernels

    if got is None or want is None or len(got) != len(want):
        return got == want
    exact = kernels.available() and not float_weights

    def close(a: float | None, b: float | None) -> bool:
        return a == b if exact or a is None or b is None else abs(a - b) <= tol

    def same(g: TokenLogprob, w: TokenLogprob) -> bool:
        return (g.token_id == w.token_id and close(g.logprob, w.logprob) and len(g.top) == len(w.top)
                and all(x.token_id == y.token_id and close(x.logprob, y.logprob)
                        for x, y in zip(g.top, w.top, strict=True)))

    return all(same(g, w) for g, w in zip(got, want, strict=True))


def batch_invariant_mode() -> dict:
    """EngineConfig settings in which batching and forking never change greedy results on this backend:
    the default mode on a CPU (its kernels sum each row in one order up to batch 16); float32 with
    HIGHEST-precision products on accelerators, whose bfloat16 products sum in an order that depends on
    the batch (docs/benchmarks.md, accelerators), and one step a call there: accelerators run multi-step
    loops for small batches only, and a loop is another XLA program than a single step (its sums may be
    ordered otherwise), so a sequence alone and the same sequence among many would run different code."""
    return {} if jax.default_backend() == "cpu" else {"dtype": "float32", "kv_dtype": "f32", "multi_step": 1}


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One persistent compilation cache for the whole session (a fresh directory: nothing from another run):
    engines of the same configuration compile the same programs, loaded from it after the first time."""
    if os.environ.get("PARROT_TEST_COMPILE_CACHE", "1") != "0":
        enable_compilation_cache(str(tmp_path_factory.mktemp("jax-cache")))


@pytest.fixture
def without_compilation_cache() -> Iterator[None]:
    """The session's persistent cache off while the test runs: its programs compile for real (a test of what
    happens while they compile)."""
    current = jax.config.jax_compilation_cache_dir
    set_cache_dir(None)
    try:
        yield
    finally:
        set_cache_dir(current)


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    try:
        return load_model(progress=False)
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")


def _engine(model: LoadedModel, cfg: EngineConfig) -> Iterator[LLMEngine]:
    engine = LLMEngine(model, runner=ModelRunner(model.config, model.weights, cfg)).start(precompile=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def smollm_engine(smollm: LoadedModel) -> Iterator[LLMEngine]:
    """float32 throughout, weights dequantized at load: the exact mode the reference comparison holds to 1e-3."""
    yield from _engine(smollm, EngineConfig(compilation_cache_dir=None, kv_memory_mb=256, dtype="float32",
                                            weights="f32", kv_dtype="f32"))


@pytest.fixture(scope="session")
def smollm_quantized_engine(smollm: LoadedModel) -> Iterator[LLMEngine]:
    """float32 activations and KV with the file's quantized blocks kept (dequantized inside each product)."""
    yield from _engine(smollm, EngineConfig(compilation_cache_dir=None, kv_memory_mb=128, dtype="float32",
                                            weights="auto", kv_dtype="f32"))


@pytest.fixture(scope="session")
def smollm_default_engine(smollm: LoadedModel) -> Iterator[LLMEngine]:
    """The serving default (on CPUs with bf16 matrix units: bf16 weights in prefill steps)."""
    yield from _engine(smollm, EngineConfig(compilation_cache_dir=None, kv_memory_mb=256))


WORKER_MEMORY_GIB = 6  # a worker's peak: two took 8.6 GB of memory at most in a whole run (2-core Zen 3)
MAX_WORKERS = 2  # measured: on 2 cores two workers take the suite from 1,143 s to 867 s


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many pytest-xdist workers `-n auto` (pyproject's addopts) starts: one a core, at most MAX_WORKERS,
    as many as the available memory holds; none (the tests run in this process) on a machine with an NVIDIA
    GPU, where each process would take most of its memory (benchmarks/gpu/run.sh sets its own count).
    PARROT_TEST_WORKERS=N sets it."""
    if os.environ.get("PARROT_TEST_WORKERS"):
        return int(os.environ["PARROT_TEST_WORKERS"])
    if os.path.exists("/dev/nvidia0"):
        return 0
    available = procinfo.available_memory_bytes() or 0  # unknown: one process
    workers = min(MAX_WORKERS, procinfo.usable_cores(), available // (WORKER_MEMORY_GIB << 30))
    return workers if workers > 1 else 0  # one worker would only add a process


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # "no tests ran" (exit 5, e.g. a -k filter matching nothing) is not a failure of the code under test
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK


def grammar_rejects(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """Make every constraint's matcher be fed, as its `at`-th token, a token its grammar rejects ("z" in the
    tiny vocabulary; the grammars these tests use never allow it) instead of the sampled one: what a
    matcher whose mask allowed a token it then refuses would do mid-generation. The matcher is llguidance's
    own and raises its own error; only the token it is fed changes."""
    from parrot.engine.structured import Constraint

    real = Constraint.consume
    rejected = tiny_tokenizer().encode("z")[0]

    def consume(self: Constraint, token: int) -> None:
        real(self, rejected if len(self.consumed) == at else token)

    monkeypatch.setattr(Constraint, "consume", consume)
