"""`--load-format dummy`: random weights for a model's shape, so any benchmark can run big shapes on a
machine without their files (vLLM's `--load-format dummy`).

The shape comes from a named preset (`PRESETS`: published configurations) or from a Hugging Face
directory's `config.json` alone (no weight files read). Every tensor is drawn on the device, directly in
the engine's weight dtype (bfloat16 on accelerators, float32 on a CPU unless `--weights bf16`), one
tensor at a time: no float32 copy of the whole model on the host. Draws are deterministic (a seed per
tensor name), scaled so that activations stay in range (normal * 0.02, norms 1).

Text needs a tokenizer: a dummy model uses the default model's (SmolLM2, 49,152 tokens), or where that is
not installed (a machine that received only the code) one of bytes (`Tokenizer.byte_level`, 259 tokens).
Every preset's vocabulary is at least that large, so prompt tokens are always valid ids; sampled ids past
the tokenizer's vocabulary decode to nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp

from parrot.engine.models.llama import LlamaConfig, weight_names
from parrot.engine.tokenizer import Tokenizer, load_tokenizer
from parrot.errors import ModelLoadError

log = logging.getLogger(__name__)

# published configurations (config.json of each model); "tiny-llama" is for tests
PRESETS: dict[str, LlamaConfig] = {
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_eps=1e-5,
                              max_position=8192, tie_word_embeddings=False),
    "qwen2-7b": LlamaConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                            num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_eps=1e-6,
                            max_position=32768, tie_word_embeddings=False, qkv_bias=True),
    "smollm2-1.7b": LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_layers=24,
                                num_heads=32, num_kv_heads=32, head_dim=64, rope_theta=130000.0, rms_eps=1e-5,
                                max_position=8192, tie_word_embeddings=True),
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5,
                                max_position=8192, tie_word_embeddings=True),
    "tiny-llama": LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_eps=1e-5,
                              max_position=1024, tie_word_embeddings=True),
}
SCALE = 0.02


def dummy_config(model: str | Path) -> LlamaConfig:
    """A preset's configuration, or a Hugging Face directory's (or config.json file's)."""
    if str(model) in PRESETS:
        return PRESETS[str(model)]
    path = Path(model).expanduser()
    cfg_file = path / "config.json" if path.is_dir() else path
    if cfg_file.name != "config.json" or not cfg_file.is_file():
        raise ModelLoadError(f"--load-format dummy needs a preset ({', '.join(sorted(PRESETS))}) or a model "
                             f"directory with a config.json; got {str(model)!r}")
    from parrot.engine.loader import hf_config  # the loader's own reading of config.json

    try:
        return hf_config(json.loads(cfg_file.read_text()), cfg_file)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from exc


def dummy_weights(cfg: LlamaConfig, dtype: jnp.dtype, seed: int = 0) -> dict[str, jax.Array]:
    """Every weight the model expects, drawn on the default device in `dtype`."""
    out = {}
    for name, shape in weight_names(cfg).items():
        short = name.split(".")[-1]
        if short.endswith("norm") or short in ("bq", "bk", "bv"):  # norms 1, biases 0
            out[name] = (jnp.ones if short.endswith("norm") else jnp.zeros)(shape, dtype)
            continue
        key = jax.random.PRNGKey((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31)
        out[name] = _draw(key, shape, jnp.dtype(dtype), SCALE)
    return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype, scale: float) -> jax.Array:
    """One tensor (compiled once per shape and dtype: the layers share them)."""
    return jax.random.normal(key, shape, dtype) * jnp.asarray(scale, dtype)


def dummy_tokenizer(cfg: LlamaConfig) -> Tokenizer:
    try:
        tok = load_tokenizer(None)
    except ModelLoadError:  # the default model is not installed
        log.info("dummy model: the default model is not installed; using a byte-level tokenizer")
        tok = Tokenizer.byte_level()
    if cfg.vocab_size < tok.vocab_size:
        raise ModelLoadError(f"a dummy model needs a vocabulary of at least {tok.vocab_size} tokens (its "
                             f"tokenizer's); this one has {cfg.vocab_size}")
    return tok
