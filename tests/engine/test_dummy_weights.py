"""`--load-format dummy`: random weights of a preset's or a config.json's shape, drawn in the target dtype."""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import pytest

from parrot.config import EngineConfig
from parrot.engine.dummy_weights import PRESETS
from parrot.engine.engine import LLMEngine
from parrot.engine.loader import load_model
from parrot.engine.runner import default_dtypes
from parrot.errors import ModelLoadError
from parrot.protocol import SamplingParams


def test_presets_have_the_published_sizes() -> None:
    sizes = {name: round(cfg.num_params / 1e9, 2) for name, cfg in PRESETS.items()}
    assert sizes["llama-3-8b"] == 8.03 and sizes["qwen2-7b"] == 7.62 and sizes["smollm2-1.7b"] == 1.71
    assert sizes["smollm2-135m"] == 0.13 and PRESETS["qwen2-7b"].qkv_bias


def test_a_dummy_model_generates() -> None:
    m = load_model("tiny-llama", load_format="dummy", progress=False)
    # drawn in the engine's weight dtype on this backend (float32 on a CPU, bfloat16 on accelerators)
    assert m.source == "dummy:tiny-llama" and m.weights["embed"].dtype == default_dtypes()[1]
    eng = LLMEngine(m, EngineConfig(kv_memory_mb=8, precompile=False, compilation_cache_dir=None)).start()
    try:
        out = eng.complete(m.tokenizer.encode("Hello there"), SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.response.token_ids) == 6
    finally:
        eng.shutdown()
    again = load_model("tiny-llama", load_format="dummy", progress=False)  # deterministic draws
    assert bool(jnp.all(again.weights["layers.1.wq"] == m.weights["layers.1.wq"]))
    bf16 = load_model("tiny-llama", load_format="dummy", progress=False, dtype="bfloat16")
    assert bf16.weights["layers.0.w_up"].dtype == jnp.bfloat16


def test_shape_from_a_config_json(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False}))
    m = load_model(tmp_path, load_format="dummy", progress=False)  # no weight files needed
    assert m.config.qkv_bias and m.config.num_layers == 1 and "lm_head" in m.weights


def test_bad_names_fail_clearly(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ModelLoadError, match="needs a preset .*llama-3-8b"):
        load_model("llama-9000", load_format="dummy", progress=False)
    with pytest.raises(ModelLoadError, match="unknown load format"):
        load_model("smollm2", load_format="pt", progress=False)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 200, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4}))
    # fewer tokens than any tokenizer a dummy model takes (the default model's 49,152, or 259 bytes and
    # specials where it is not installed)
    with pytest.raises(ModelLoadError, match="vocabulary of at least"):
        load_model(tmp_path, load_format="dummy", progress=False)


def test_cli_generate_with_dummy_weights() -> None:
    r = subprocess.run([sys.executable, "-m", "parrot.cli", "generate", "Hello", "--load-format", "dummy",
                        "--model", "tiny-llama", "--max-tokens", "4", "--ignore-eos", "--compilation-cache-dir", ""],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "[dummy:tiny-llama]" in out and "finish: length" in out


def test_a_dummy_model_needs_no_installed_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that received only the code (no default model) still runs random-weight models: their text
    goes through a byte-level tokenizer."""
    from parrot.engine import model_files

    def missing() -> None:
        raise ModelLoadError("the default model is not installed")

    monkeypatch.setattr(model_files, "default_model_path", missing)
    m = load_model("tiny-llama", load_format="dummy", progress=False)
    assert m.tokenizer.vocab_size == 259 and m.tokenizer.decode(m.tokenizer.encode("naïve, ok")) == "naïve, ok"
    eng = LLMEngine(m, EngineConfig(kv_memory_mb=8, precompile=False, compilation_cache_dir=None)).start()
    try:
        prompt = m.tokenizer.encode(m.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
        out = eng.complete(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(out.response.token_ids) == 5 and isinstance(out.response.text, str)
    finally:
        eng.shutdown()
