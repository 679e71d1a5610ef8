"""Proof of correctness against Hugging Face transformers on torch (an independent implementation):
the default SmolLM2 GGUF loaded by both, logits, greedy continuations, tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from parrot.config import EngineConfig
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import LoadedModel
from parrot.engine.runner import ModelRunner
from parrot.engine.sampling import SamplingParams
from parrot.protocol import FillRequest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

pytestmark = [pytest.mark.reference, pytest.mark.model]

LOGIT_TOLERANCE = 1e-3  # fp32 on both sides; measured ~5e-5
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
PLAIN = "In 1969, 3 astronauts flew 384,400 km to the Moon. Café crème, 東京タワー and 🦜 emoji: 12345."
CODE = "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib("

TRICKY = [
    "Hello, world!",
    "12345 and 3.14159 and 1,000,000",
    "naïve café — «ça va?» ẞ ǅ ﬁ",
    "日本語 中文 한국어 العربية עברית",
    "emoji 🦜🎉👩‍👩‍👧🇫🇷👍🏽",
    "def f(x):\n\treturn x ** 2  # squared\n",
    "   spaces   and\n\n\nnewlines\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token<|im_end|>",
    "<|im_start |> not quite special <im_end>",
    "",
]


@pytest.fixture(scope="module")
def hf_model(smollm: LoadedModel) -> Any:
    """transformers' own GGUF loader (dequantized to fp32); loaded once for the module."""
    path = Path(smollm.source)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos=True
    return model


@pytest.fixture(scope="module")
def hf_tokenizer(smollm: LoadedModel) -> Any:
    path = Path(smollm.source)
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _prompt(smollm: LoadedModel, name: str) -> list[int]:
    tok = smollm.tokenizer
    text = {"chat": lambda: tok.apply_chat_template(CAPITAL), "plain": lambda: PLAIN, "code": lambda: CODE}[name]()
    return tok.encode(text)


def _pages(runner: ModelRunner, n_tokens: int) -> list[int]:
    return list(range(1, 1 + (n_tokens + runner.page_size - 1) // runner.page_size))


def _logits(engine: LLMEngine, ids: list[int]) -> np.ndarray:
    return np.asarray(engine.runner.prefill_logits(ids, 0, _pages(engine.runner, len(ids))))[0]


def _hf_last_logits(hf_model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize("name", ["chat", "plain", "code"])
def test_last_token_logits_match_transformers(smollm: LoadedModel, smollm_engine: LLMEngine, hf_model: Any,
                                              name: str) -> None:
    ids = _prompt(smollm, name)
    ours = _logits(smollm_engine, ids)
    ref = _hf_last_logits(hf_model, ids)
    diff = float(np.abs(ours - ref).max())
    print(f"{name}: {len(ids)} tokens, max |logit diff| = {diff:.2e}")
    assert diff < LOGIT_TOLERANCE
    assert int(ours.argmax()) == int(ref.argmax())


def test_split_prefill_logits_match_transformers(smollm: LoadedModel, smollm_engine: LLMEngine,
                                                 hf_model: Any) -> None:
    """A prompt fed in two parts (the second attending to the first's paged KV) gives the same logits."""
    ids = _prompt(smollm, "plain")
    runner = smollm_engine.runner
    pages = _pages(runner, len(ids))
    split = 20  # not a page boundary
    runner.prefill_logits(ids[:split], 0, pages)
    ours = np.asarray(runner.prefill_logits(ids[split:], split, pages))[0]
    diff = float(np.abs(ours - _hf_last_logits(hf_model, ids)).max())
    print(f"split prefill: max |logit diff| = {diff:.2e}")
    assert diff < LOGIT_TOLERANCE


def test_prompt_logprobs_match_transformers(smollm: LoadedModel, smollm_engine: LLMEngine, hf_model: Any) -> None:
    """A Fill's prompt logprobs (the prompt in two fills, as loglikelihood requests send context and
    continuation) are transformers' log-softmax at each position before the token, top tokens included."""
    ids = _prompt(smollm, "plain")
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    split = 20
    lps = [lp for part in (ids[:split], ids[split:]) for lp in smollm_engine.fill_future(
        FillRequest(context_id="scored", token_ids=part, logprobs=5)).result(300).logprobs]
    smollm_engine.free_future("scored").result(60)
    assert [lp.token_id for lp in lps] == ids and lps[0].logprob is None
    diff = max(abs(lp.logprob - ref[i - 1, ids[i]]) for i, lp in enumerate(lps) if i)
    top_diff = max(abs(t.logprob - ref[i - 1, t.token_id]) for i, lp in enumerate(lps) if i for t in lp.top)
    print(f"prompt logprobs: {len(ids)} tokens, max |diff| = {diff:.2e}, top tokens {top_diff:.2e}")
    assert diff < LOGIT_TOLERANCE and top_diff < LOGIT_TOLERANCE
    assert all(lp.top[0].token_id == int(ref[i - 1].argmax()) for i, lp in enumerate(lps) if i)


@pytest.mark.parametrize("name", ["chat", "code"])
def test_greedy_continuation_matches_transformers(smollm: LoadedModel, smollm_engine: LLMEngine, hf_model: Any,
                                                  name: str) -> None:
    ids = _prompt(smollm, name)
    ours = smollm_engine.complete(ids, SamplingParams(max_tokens=32, ignore_eos=True)).response
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=32, do_sample=False)
    ref = out[0, len(ids):].tolist()
    assert len(ref) == 32
    assert ours.finish_reason == "length"
    assert ours.token_ids == ref


@pytest.mark.parametrize("name", ["chat", "code"])
def test_quantized_weights_match_transformers(smollm: LoadedModel, smollm_quantized_engine: LLMEngine,
                                              hf_model: Any, name: str) -> None:
    """Weights kept as the file's Q4_1 / Q8_0 blocks compute the same model: last-token logits within
    the float32 tolerance and the same greedy continuation (decode steps run the native kernels where
    the CPU has them)."""
    engine = smollm_quantized_engine
    if engine.runner.weights_mode != "quantized":
        pytest.skip("weights were dequantized here (no native CPU kernels)")
    ids = _prompt(smollm, name)
    diff = float(np.abs(_logits(engine, ids) - _hf_last_logits(hf_model, ids)).max())
    print(f"{name}, quantized weights: max |logit diff| = {diff:.2e}")
    assert diff < LOGIT_TOLERANCE
    ours = engine.complete(ids, SamplingParams(max_tokens=32, ignore_eos=True)).response
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=32, do_sample=False)
    assert ours.token_ids == out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def bf16_kv_engine(smollm: LoadedModel) -> Any:
    cfg = EngineConfig(compilation_cache_dir=None, kv_memory_mb=64, dtype="float32", weights="auto", kv_dtype="bf16")
    engine = LLMEngine(smollm, runner=ModelRunner(smollm.config, smollm.weights, cfg)).start(precompile=False)
    yield engine
    engine.shutdown()


def test_bf16_kv_cache_keeps_greedy_outputs(smollm: LoadedModel, smollm_quantized_engine: LLMEngine,
                                            bf16_kv_engine: LLMEngine) -> None:
    """The bfloat16 KV cache (the CPU default where the native kernels decode) gives the same greedy
    tokens as the float32 cache on the reference prompts."""
    assert bf16_kv_engine.runner.kv_dtype == np.dtype("bfloat16")
    for name in ("chat", "plain", "code"):
        ids = _prompt(smollm, name)
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        want = smollm_quantized_engine.complete(ids, params).response.token_ids
        assert bf16_kv_engine.complete(ids, params).response.token_ids == want, name


def test_tokenizer_ids_match_transformers(smollm: LoadedModel, hf_tokenizer: Any) -> None:
    tok = smollm.tokenizer
    for text in TRICKY:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids), text
    assert tok.encode("12345") == [tok.backend.token_to_id(d) for d in "12345"]  # digits split one by one
    assert tok.encode("<|im_start|>") == [hf_tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.eos_token_id == hf_tokenizer.eos_token_id
    assert tok.vocab_size == len(hf_tokenizer)


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt"),
    [
        (CAPITAL, True),
        (CAPITAL, False),
        ([{"role": "system", "content": "Answer briefly."}, *CAPITAL], True),
        ([*CAPITAL, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And 🇩🇪?"}], True),
    ],
)
def test_chat_template_matches_transformers(smollm: LoadedModel, hf_tokenizer: Any, messages: list[dict[str, str]],
                                            add_generation_prompt: bool) -> None:
    ours = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert smollm.tokenizer.encode(ours) == hf_tokenizer.encode(ref, add_special_tokens=False)


def test_capital_of_france_is_paris(smollm: LoadedModel, smollm_engine: LLMEngine) -> None:
    ids = _prompt(smollm, "chat")
    out = smollm_engine.complete(ids, SamplingParams(max_tokens=32)).response
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends with <|im_end|>, not by running out of tokens


MIXED_TOLERANCE = 1.0  # bf16 products and prefill attention in prefill steps; measured 0.13-0.31 (Xeon, AMX)


@pytest.mark.parametrize("name", ["chat", "plain"])
def test_default_precision_stays_close_to_transformers(smollm: LoadedModel, smollm_default_engine: LLMEngine,
                                                       hf_model: Any, name: str) -> None:
    """The serving default's mixed precision (if the CPU has bf16 matrix units) keeps the same top
    token and logits within a bf16-sized tolerance of the float32 reference."""
    ids = _prompt(smollm, name)
    ours = _logits(smollm_default_engine, ids)
    ref = _hf_last_logits(hf_model, ids)
    assert np.abs(ours - ref).max() < MIXED_TOLERANCE
    assert ours.argmax() == ref.argmax()


def test_default_precision_answers_paris(smollm: LoadedModel, smollm_default_engine: LLMEngine) -> None:
    ids = smollm.tokenizer.encode(smollm.tokenizer.apply_chat_template(CAPITAL))
    assert "Paris" in smollm_default_engine.complete(ids, SamplingParams(max_tokens=32)).response.text
