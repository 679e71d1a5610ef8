"""Model loading: GGUF files (the `gguf` package, dequantized on the host) and Hugging Face directories
(`config.json` + `*.safetensors` + `tokenizer.json`). Produces a LlamaConfig, numpy weights in the
layout of `models/llama.py` (HF rotate-half order, projections `[in, out]`) and a Tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from parrot.engine.model_files import (  # noqa: F401  (DEFAULT_MODEL, default_model_path: re-exported)
    DEFAULT_MODEL,
    default_model_path,
    gguf_field,
    open_gguf,
    resolve_model_path,
)
from parrot.engine.models.llama import LlamaConfig, Weight, weight_names
from parrot.engine.quant import GGML_TYPES, QuantizedTensor
from parrot.engine.tokenizer import Tokenizer, gguf_tokenizer
from parrot.errors import ModelLoadError

# architectures whose GGUF Q/K rows llama.cpp permuted for its interleaved RoPE
_GGUF_PERMUTED = {"llama"}
_GGUF_ARCHS = {"llama", "qwen2"}
_HF_ARCHS = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": True, "MistralForCausalLM": False}


@dataclass
class LoadedModel:
    config: LlamaConfig
    weights: dict[str, Weight]  # matrices of GGUF block types Q8_0 / Q4_0 / Q4_1 stay quantized
    tokenizer: Tokenizer
    source: str


LOAD_FORMATS = ("auto", "dummy")


def load_model(model: str | Path | None = None, progress: bool = True, load_format: str = "auto",
               dtype: str | None = None) -> LoadedModel:
    """Load a model from a GGUF file, a Hugging Face directory, or the default ('smollm2' / None).
    `load_format="dummy"`: random weights of a preset's or a config.json's shape (engine/dummy_weights.py),
    drawn in `dtype` (default: the engine's weight dtype on this backend)."""
    if load_format == "dummy":
        return _load_dummy(model if model is not None else "smollm2-135m", dtype)
    if load_format != "auto":
        raise ModelLoadError(f"unknown load format {load_format!r} (choose from {', '.join(LOAD_FORMATS)})")
    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_dir(path, progress)
    return _load_gguf(path, progress)


# ---- GGUF -------------------------------------------------------------------------------------
def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation ([out, in], interleaved pairs -> rotate-half halves)."""
    out = w.shape[0]
    d = out // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, progress: bool) -> LoadedModel:
    import gguf  # deferred: only GGUF loading needs it

    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {sorted(_GGUF_ARCHS)})")

    def meta(key: str, default=None):  # noqa: ANN001, ANN202
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is not supported")
    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    cfg = LlamaConfig(
        vocab_size=int(gguf_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // n_heads)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
    )
    gguf_names = {
        "embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight",
        "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
        "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
        "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
        "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    }
    permuted = arch in _GGUF_PERMUTED
    expected = weight_names(cfg)

    def convert(name: str) -> Weight:
        if name.startswith("layers."):
            _, layer, short = name.split(".", 2)
            gname = f"blk.{layer}.{gguf_names[short]}"
        else:
            short, gname = name, gguf_names[name]
        t = tensors.get(gname)
        if t is None:
            raise ModelLoadError(f"{path}: tensor {gname} is missing")
        qtype = GGML_TYPES.get(t.tensor_type.name)
        if qtype is not None and t.data.ndim == 2:  # the file's blocks, as they are (rows: out / vocab)
            rows = t.data
            if permuted and short in ("wq", "wk"):
                rows = _unpermute(rows, n_heads if short == "wq" else n_kv)
            shape = expected[name]
            rows_are_matrix = short == "embed"
            logical = (rows.shape[0], shape[1]) if rows_are_matrix else (shape[0], rows.shape[0])
            if logical != shape:
                raise ModelLoadError(f"{path}: tensor {name} has shape {logical}, expected {shape}")
            return QuantizedTensor(qtype, np.ascontiguousarray(rows), shape, rows_are_matrix)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{path}: tensor {gname} has unsupported quantization type {t.tensor_type.name}"
            ) from exc
        w = np.array(w, dtype=np.float32)  # owned: a view would keep the whole file mapped (and resident)
        if permuted and short in ("wq", "wk", "bq", "bk"):
            w = _unpermute(w, n_heads if short in ("wq", "bq") else n_kv)
        return _to_model_layout(name, short, w, expected[name], path)

    # numpy's dequantizing kernels release the GIL: one thread per core
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = tqdm(pool.map(convert, expected), total=len(expected), desc=f"loading {path.name}", unit="tensor",
                    disable=None if progress else True)
        weights = dict(zip(expected, done, strict=True))
    tokenizer = gguf_tokenizer(reader, path)
    return LoadedModel(cfg, weights, tokenizer, str(path))


def _to_model_layout(name: str, short: str, w: np.ndarray, shape: tuple[int, ...], path: Path) -> np.ndarray:
    """[out, in] (torch / gguf) -> [in, out] (a transposed view); embeddings stay [vocab, hidden]."""
    if w.ndim == 2 and short != "embed":
        w = w.T
    if w.shape != shape:
        raise ModelLoadError(f"{path}: tensor {name} has shape {w.shape}, expected {shape}")
    # a view (of the memory-mapped file, for safetensors): the model copies each tensor once, straight into
    # its device buffer in its dtype; a contiguous host copy here held a second whole model in memory
    return w


# ---- Hugging Face directory ---------------------------------------------------------------------
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Minimal safetensors reader (header + raw little-endian buffers, memory-mapped, in the file's dtype;
    bf16 via ml_dtypes)."""
    import ml_dtypes  # ships with jax

    dtypes = dict(_ST_DTYPES, BF16=ml_dtypes.bfloat16)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in dtypes:
                raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            # the file's own dtype, memory-mapped: the model converts each tensor once, to its dtype
            out[name] = np.frombuffer(data[start:end], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
        return out
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc})") from exc


def _load_hf_dir(path: Path, progress: bool) -> LoadedModel:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} is a directory without config.json (expected a Hugging Face model)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from exc
    return _load_hf_weights(path, hf_config(hf, cfg_file), progress)


def hf_config(hf: dict, cfg_file: Path) -> LlamaConfig:
    """The model configuration of a Hugging Face config.json (`cfg_file`: where it came from, for errors)."""
    path = cfg_file.parent
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in _HF_ARCHS), None)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported architecture {archs} (supported: {sorted(_HF_ARCHS)})")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelLoadError(f"{path}: RoPE scaling {rope_type!r} (rope_scaling / rope_parameters) is not supported")
    try:
        return _hf_config(hf, arch, rope)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{cfg_file} lacks or has an invalid {exc} entry") from exc


def _load_dummy(model: str | Path, dtype: str | None) -> LoadedModel:
    from parrot.engine import dummy_weights
    from parrot.engine.runner import default_dtypes

    cfg = dummy_weights.dummy_config(model)
    tok = dummy_weights.dummy_tokenizer(cfg)
    weights = dummy_weights.dummy_weights(cfg, jnp.dtype(dtype) if dtype else default_dtypes()[1])
    return LoadedModel(cfg, weights, tok, f"dummy:{model}")


def _hf_config(hf: dict, arch: str, rope: dict) -> LlamaConfig:
    heads = int(hf["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=_HF_ARCHS[arch],
    )


def _load_hf_weights(path: Path, cfg: LlamaConfig, progress: bool) -> LoadedModel:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    raw: dict[str, np.ndarray] = {}
    for f in tqdm(files, desc=f"loading {path.name}", unit="file", disable=None if progress else True):
        raw |= read_safetensors(f)
    hf_names = {
        "embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight",
        "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
        "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
        "bv": "self_attn.v_proj.bias", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
    }
    weights = {}
    for name, shape in weight_names(cfg).items():
        if name.startswith("layers."):
            _, layer, short = name.split(".", 2)
            key = f"model.layers.{layer}.{hf_names[short]}"
        else:
            short, key = name, hf_names[name]
        if key not in raw:
            raise ModelLoadError(f"{path}: tensor {key} is missing")
        weights[name] = _to_model_layout(name, short, raw[key], shape, path)
    return LoadedModel(cfg, weights, Tokenizer.from_hf_dir(path), str(path))
