"""Sampling defaults: the model's own recommendation (GGUF metadata, generation_config.json) or llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path

from parrot.serve.sampling_defaults import (
    LLAMA_CPP,
    from_generation_config,
    from_gguf_fields,
    model_sampling_defaults,
)


def test_gguf_keys_override_llama_cpp_defaults() -> None:
    d = from_gguf_fields({"general.sampling.temp": 0.6, "general.sampling.top_k": -1,
                          "general.sampling.penalty_repeat": 1.1, "general.name": "x"})
    assert d.values == {**LLAMA_CPP, "temperature": 0.6, "top_k": 0, "repetition_penalty": 1.1}
    assert "GGUF" in d.source and "llama.cpp" in d.source
    assert from_gguf_fields({}).values == LLAMA_CPP
    assert from_gguf_fields({"general.sampling.top_p": 7.0}).values == LLAMA_CPP  # out of range: ignored


def test_generation_config(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                                "bos_token_id": 1}))
    d = from_generation_config(path)
    assert d.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
    assert d.source == "the model's generation_config.json"
    path.write_text("{not json")
    assert from_generation_config(path).values == LLAMA_CPP
    assert model_sampling_defaults(tmp_path).to_json()["source"] == "llama.cpp defaults"  # unreadable: defaults


def test_unknown_model_and_default_model() -> None:
    assert model_sampling_defaults("no/such/model").values == LLAMA_CPP
    # the default SmolLM2 GGUF carries no general.sampling.* keys (when installed)
    d = model_sampling_defaults("smollm2")
    assert d.values == LLAMA_CPP and d.source == "llama.cpp defaults"
