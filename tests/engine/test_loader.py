"""Model loading: Hugging Face directories and GGUF files written here from tiny random weights, and the
errors bad input gives. Fast; the comparisons with transformers run only where torch is installed."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from parrot.engine import kernels
from parrot.engine.loader import LoadedModel, _unpermute, load_model
from parrot.engine.models.llama import LlamaConfig, Weight, random_weights
from parrot.engine.quant import GGML_TYPES, QuantizedTensor
from parrot.engine.runner import ModelRunner
from parrot.errors import ModelLoadError
from tests.conftest import TINY, tiny_engine_config

# ---- a tiny byte-level BPE vocabulary -------------------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in character of each byte 0..255, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


TOKENS = _byte_chars() + [m.replace(" ", "") for m in MERGES] + SPECIALS
BOS, EOS = TOKENS.index("<|im_start|>"), TOKENS.index("<|endoftext|>")
# TINY's architecture with a vocabulary that fits the tokenizer and non-default rope/eps (so dropping
# them in the loader shows up in the logits)
CFG = dataclasses.replace(TINY, vocab_size=len(TOKENS), rope_theta=500.0, rms_eps=1e-6)
PROMPT = "the theater: 42 €, 日本 🦜"


def _hf_tokenizer() -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


# ---- writers ------------------------------------------------------------------------------------
_HF_NAMES = {
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_GGUF_NAMES = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight", "wq": "attn_q.weight",
    "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias",
    "bk": "attn_k.bias", "bv": "attn_v.bias", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}


def _external(w: dict[str, np.ndarray], top: dict[str, str], layer_fmt: str, names: dict[str, str]):
    """Our weights ([in, out]) -> a checkpoint's names and [out, in] layout."""
    out = {}
    for name, arr in w.items():
        arr = arr if arr.ndim == 1 or name == "embed" else arr.T
        if name.startswith("layers."):
            _, layer, short = name.split(".", 2)
            key = layer_fmt.format(layer) + names[short]
        else:
            key = top[name]
        out[key] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


def hf_tensors(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    top = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    return _external(w, top, "model.layers.{}.", _HF_NAMES)


def write_hf_dir(path: Path, cfg: LlamaConfig, w: dict[str, np.ndarray], arch: str = "LlamaForCausalLM",
                 rope_parameters: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    hf = {
        "architectures": [arch],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(arch, "llama"),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": "float32",
    }
    if rope_parameters:  # the transformers >= 5 spelling
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        hf["rope_theta"] = cfg.rope_theta
    (path / "config.json").write_text(json.dumps(hf))
    save_file(hf_tensors(w), str(path / "model.safetensors"), metadata={"format": "pt"})
    _hf_tokenizer().save(str(path / "tokenizer.json"))
    tok_cfg = {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
               "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return path


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs ([out, in])."""
    out = w.shape[0]
    d = out // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, cfg: LlamaConfig, w: dict[str, np.ndarray], arch: str = "llama",
               tokenizer_model: str | None = "gpt2", skip: tuple[str, ...] = (),
               quant: dict[str, gguf.GGMLQuantizationType] | None = None, f16: bool = False,
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A GGUF file the way llama.cpp's converter writes one (F32 tensors, llama Q/K rows permuted)."""
    tensors = _external(w, {"embed": "token_embd.weight", "norm": "output_norm.weight",
                            "lm_head": "output.weight"}, "blk.{}.", _GGUF_NAMES)
    if arch == "llama":
        for name in list(tensors):
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
                tensors[name] = np.ascontiguousarray(permute_like_llama_cpp(tensors[name], heads))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer_model is not None:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_merges(MERGES)
        types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in TOKENS]
        writer.add_token_types(types)
        writer.add_bos_token_id(BOS)
        writer.add_eos_token_id(EOS)
        writer.add_chat_template(CHAT_TEMPLATE)
    if extra is not None:
        extra(writer)
    for name, arr in tensors.items():
        if name in skip:
            continue
        qtype = (quant or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, arr.astype(np.float16) if f16 and arr.ndim == 2 else arr)
        elif qtype.name in GGML_TYPES:  # the weights quantized to that block type
            writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:  # raw blocks of the given type (contents irrelevant: the loader must refuse them)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((arr.shape[0], arr.shape[1] // block * size), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- helpers ------------------------------------------------------------------------------------
def _ids(n: int = 12) -> list[int]:
    return [int(i) for i in np.random.default_rng(1).integers(0, 256, n)]


def prefix_logits(cfg: LlamaConfig, weights: dict[str, Weight], ids: list[int], mode: str = "f32") -> np.ndarray:
    """[len(ids), vocab]: row i is the last-token logits of ids[: i + 1] (one compiled shape); `mode`: the
    engine's `weights` setting."""
    runner = ModelRunner(cfg, weights, tiny_engine_config(dtype="float32", weights=mode, kv_dtype="f32"))
    pages = list(range(1, 1 + (len(ids) + runner.page_size - 1) // runner.page_size))
    return np.stack([np.asarray(runner.prefill_logits(ids[: i + 1], 0, pages))[0] for i in range(len(ids))])


def assert_same_weights(loaded: LoadedModel, w: dict[str, np.ndarray], dtype: np.dtype = np.float32) -> None:
    """Same values; `dtype`: the file's own dtype, which loading keeps (the model converts once)."""
    assert set(loaded.weights) == set(w)
    for name, arr in w.items():
        assert loaded.weights[name].dtype == dtype, name
        np.testing.assert_array_equal(loaded.weights[name].astype(np.float32), arr, err_msg=name)


def assert_gguf_config(got: LlamaConfig, want: LlamaConfig) -> None:
    """GGUF stores float metadata as float32."""
    assert got.rms_eps == pytest.approx(want.rms_eps, rel=1e-6)
    assert dataclasses.replace(got, rms_eps=want.rms_eps) == want


def variant(arch: str, tied: bool) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied, qkv_bias=arch.startswith("Qwen2"))
    return cfg, random_weights(cfg, seed=3)


def transformers_logits(path: Path, ids: list[int]) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


# ---- Hugging Face directories -------------------------------------------------------------------
HF_VARIANTS = [("LlamaForCausalLM", True, False), ("LlamaForCausalLM", False, True),
               ("Qwen2ForCausalLM", False, False), ("Qwen2ForCausalLM", True, True)]


@pytest.mark.parametrize(("arch", "tied", "rope_parameters"), HF_VARIANTS)
def test_hf_dir_round_trip(tmp_path: Path, arch: str, tied: bool, rope_parameters: bool) -> None:
    cfg, w = variant(arch, tied)
    loaded = load_model(write_hf_dir(tmp_path / "m", cfg, w, arch, rope_parameters), progress=False)
    assert loaded.config == cfg
    assert ("lm_head" in loaded.weights) == (not tied)
    assert ("layers.0.bq" in loaded.weights) == cfg.qkv_bias
    assert_same_weights(loaded, w)
    assert loaded.source == str(tmp_path / "m")


def test_hf_dir_tokenizer(tmp_path: Path) -> None:
    cfg, w = variant("LlamaForCausalLM", True)
    tok = load_model(write_hf_dir(tmp_path / "m", cfg, w), progress=False).tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (BOS, EOS, False)
    assert tok.stop_token_ids == {EOS}
    assert tok.vocab_size == len(TOKENS)
    ids = tok.encode(PROMPT)
    assert ids[:3] == [ord("t"), TOKENS.index("he"), TOKENS.index("Ġthe")]  # merges apply
    assert tok.decode(ids) == PROMPT
    assert tok.encode("<|im_start|>hi<|im_end|>") == [BOS, ord("h"), ord("i"), TOKENS.index("<|im_end|>")]
    assert tok.encode("x", add_bos=True) == [BOS, ord("x")]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_dir_bf16_and_sharded(tmp_path: Path) -> None:
    """bf16 tensors and a checkpoint split over two files load (bf16 is exact for bf16 values)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cfg, w = variant("LlamaForCausalLM", False)
    w = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in w.items()}
    path = write_hf_dir(tmp_path / "m", cfg, w)
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(w).items()}
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    assert_same_weights(load_model(path, progress=False), w, ml_dtypes.bfloat16)


@pytest.mark.reference
@pytest.mark.parametrize(("arch", "tied", "rope_parameters"), HF_VARIANTS)
def test_hf_dir_logits_match_transformers(tmp_path: Path, arch: str, tied: bool, rope_parameters: bool) -> None:
    cfg, w = variant(arch, tied)
    path = write_hf_dir(tmp_path / "m", cfg, w, arch, rope_parameters)
    ids = _ids()
    ref = transformers_logits(path, ids)
    loaded = load_model(path, progress=False)
    ours = prefix_logits(loaded.config, loaded.weights, ids)
    assert np.abs(ref).max() > 0.1  # the comparison is not between two near-zero arrays
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)


# ---- GGUF ---------------------------------------------------------------------------------------
def test_llama_cpp_permutation_inverse() -> None:
    rng = np.random.default_rng(0)
    for n_head, out, cols in [(4, 64, 8), (2, 32, 5), (9, 576, 3)]:
        w = rng.standard_normal((out, cols)).astype(np.float32)
        p = permute_like_llama_cpp(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(_unpermute(p, n_head), w)
        b = rng.standard_normal(out).astype(np.float32)  # 1-D (bias) rows permute the same way
        np.testing.assert_array_equal(_unpermute(permute_like_llama_cpp(b, n_head), n_head), b)


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_llama_unpermutes_q_and_k(tmp_path: Path, tied: bool) -> None:
    cfg, w = variant("LlamaForCausalLM", tied)
    path = write_gguf(tmp_path / "tiny.gguf", cfg, w)
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    # the file really holds permuted rows (otherwise this test proves nothing)
    assert not np.array_equal(stored["blk.0.attn_q.weight"], w["layers.0.wq"].T)
    assert not np.array_equal(stored["blk.1.attn_k.weight"], w["layers.1.wk"].T)
    loaded = load_model(path, progress=False)
    assert_gguf_config(loaded.config, cfg)
    assert_same_weights(loaded, w)
    ids = _ids()
    np.testing.assert_allclose(prefix_logits(cfg, loaded.weights, ids), prefix_logits(cfg, w, ids),
                               rtol=0, atol=1e-6)


def test_gguf_qwen2_is_not_permuted(tmp_path: Path) -> None:
    cfg, w = variant("Qwen2ForCausalLM", False)
    loaded = load_model(write_gguf(tmp_path / "tiny.gguf", cfg, w, arch="qwen2"), progress=False)
    assert_gguf_config(loaded.config, cfg)
    assert_same_weights(loaded, w)


def test_gguf_logits_match_hf_dir(tmp_path: Path) -> None:
    """The same weights as GGUF (permuted) and as a HF directory give the same model."""
    cfg, w = variant("LlamaForCausalLM", True)
    a = load_model(write_gguf(tmp_path / "tiny.gguf", cfg, w), progress=False)
    b = load_model(write_hf_dir(tmp_path / "hf", cfg, w), progress=False)
    assert_gguf_config(a.config, b.config)
    ids = _ids(8)
    np.testing.assert_array_equal(prefix_logits(cfg, a.weights, ids), prefix_logits(cfg, b.weights, ids))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quantized_tensors_stay_quantized(tmp_path: Path, qtype: str) -> None:
    """Block-quantized matrices load as the file's blocks (Q/K rows unpermuted as whole rows); their
    exact dequantization is what the float path computes with, so both give the same logits."""
    cfg, w = variant("LlamaForCausalLM", True)
    t = gguf.GGMLQuantizationType[qtype]
    names = ["token_embd.weight"] + [f"blk.{i}.{n}.weight" for i in range(cfg.num_layers)
                                     for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                               "ffn_down")]
    loaded = load_model(write_gguf(tmp_path / "q.gguf", cfg, w, quant=dict.fromkeys(names, t)), progress=False)
    q = loaded.weights["layers.1.wq"]
    assert isinstance(q, QuantizedTensor) and q.qtype == qtype.lower() and q.shape == (cfg.hidden_size, 64)
    assert isinstance(loaded.weights["embed"], QuantizedTensor) and loaded.weights["embed"].rows_are_matrix
    step = 0.02 if qtype == "Q8_0" else 0.3  # quantization error of the random weights (scale 0.05)
    for name in ("layers.1.wq", "layers.0.wk", "layers.1.w_down", "embed"):
        np.testing.assert_allclose(loaded.weights[name].dequantize(), w[name], atol=step, err_msg=name)
    dequantized = {k: v.dequantize() if isinstance(v, QuantizedTensor) else v for k, v in loaded.weights.items()}
    ids = _ids()
    np.testing.assert_allclose(prefix_logits(cfg, loaded.weights, ids, mode="auto"),
                               prefix_logits(cfg, dequantized, ids), atol=1e-4)


@pytest.mark.parametrize("mode", ["auto", "f32"])
def test_a_built_model_keeps_no_view_of_the_gguf_file(tmp_path: Path, mode: str) -> None:
    """The model's buffers are its own: once the loaded tensors are dropped, nothing keeps the file mapped
    (on a CPU, JAX can adopt an aligned host array as a buffer; a view of the mapping, even a norm's few
    bytes, kept the whole file mapped and resident beside the model's copy)."""
    import gc

    cfg, w = variant("LlamaForCausalLM", True)
    names = [f"blk.{i}.{n}.weight" for i in range(cfg.num_layers) for n in ("attn_q", "ffn_down")]
    path = write_gguf(tmp_path / "q.gguf", cfg, w, quant=dict.fromkeys(names, gguf.GGMLQuantizationType.Q8_0),
                      extra=lambda writer: writer.add_custom_alignment(64))  # every tensor adoptable
    loaded = load_model(path, progress=False)
    runner = ModelRunner(cfg, loaded.weights, tiny_engine_config(dtype="float32", weights=mode, kv_dtype="f32"))
    del loaded
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object reaches deprecated aliases (torch's reduce_op)
        warnings.simplefilter("ignore", FutureWarning)
        mapped = [o for o in gc.get_objects()
                  if isinstance(o, np.memmap) and o.filename is not None and Path(o.filename) == path.resolve()]
    assert not mapped
    assert np.isfinite(np.asarray(runner.prefill_logits(_ids(4), 0, [1]))).all()


def test_gguf_f16_tensors(tmp_path: Path) -> None:
    cfg, w = variant("LlamaForCausalLM", True)
    w16 = {k: v.astype(np.float16).astype(np.float32) for k, v in w.items()}
    path = write_gguf(tmp_path / "tiny.gguf", cfg, w16, f16=True)
    types = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert gguf.GGMLQuantizationType.F16 in types
    assert_same_weights(load_model(path, progress=False), w16)


def test_gguf_tokenizer(tmp_path: Path) -> None:
    cfg, w = variant("LlamaForCausalLM", True)
    tok = load_model(write_gguf(tmp_path / "tiny.gguf", cfg, w), progress=False).tokenizer
    ref = _hf_tokenizer()
    for text in [PROMPT, "  two  spaces\n\nthe end", "<|im_start|>user\nthe<|im_end|>", "ÿ\x00\x7f"]:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS, EOS)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.decode(tok.encode("<|im_end|>x")) == "x"  # control tokens are special


@pytest.mark.model
def test_default_model_loads(smollm: LoadedModel) -> None:
    cfg = smollm.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        49152, 576, 30, 9, 3)
    assert cfg.tie_word_embeddings and not cfg.qkv_bias
    assert cfg.rope_theta == 100000.0
    # Q4_1 projections and a Q8_0 embedding stay as the file's blocks; norms are float32
    kinds = {name: w.qtype if isinstance(w, QuantizedTensor) else str(w.dtype) for name, w in smollm.weights.items()}
    assert kinds["embed"] == "q8_0" and kinds["layers.0.wq"] == "q4_1" and kinds["norm"] == "float32"
    assert all(np.isfinite(w.dequantize() if isinstance(w, QuantizedTensor) else w).all()
               for w in smollm.weights.values())
    assert smollm.tokenizer.eos_token_id == smollm.tokenizer.backend.token_to_id("<|im_end|>")


# ---- bad input ----------------------------------------------------------------------------------
def _tiny_gguf(tmp_path: Path, **kw) -> Path:
    cfg, w = variant("LlamaForCausalLM", True)
    return write_gguf(tmp_path / "tiny.gguf", cfg, w, **kw)


def _tiny_hf(tmp_path: Path, **kw) -> Path:
    cfg, w = variant("LlamaForCausalLM", True)
    return write_hf_dir(tmp_path / "m", cfg, w, **kw)


def _load_error(path: Path | str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, progress=False)
    return str(info.value)


def test_missing_path(tmp_path: Path) -> None:
    msg = _load_error(tmp_path / "nope.gguf")
    assert "nope.gguf" in msg and "does not exist" in msg


def test_corrupt_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    msg = _load_error(path)
    assert "x.gguf" in msg and "not a readable GGUF file" in msg


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert "not a readable GGUF file" in _load_error(path)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    path = _tiny_gguf(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    msg = _load_error(path)
    assert "tiny.gguf" in msg and "not a readable GGUF file" in msg


def test_truncated_gguf_header(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path)
    path.write_bytes(path.read_bytes()[:200])  # inside the metadata
    assert "not a readable GGUF file" in _load_error(path)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    msg = _load_error(_tiny_gguf(tmp_path, arch="mamba"))
    assert "unsupported architecture 'mamba'" in msg and "llama" in msg


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    msg = _load_error(_tiny_gguf(tmp_path, skip=("blk.1.ffn_up.weight",)))
    assert "blk.1.ffn_up.weight" in msg and "missing" in msg


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    assert "no tokenizer" in _load_error(_tiny_gguf(tmp_path, tokenizer_model=None))


def test_gguf_unsupported_tokenizer_model(tmp_path: Path) -> None:
    msg = _load_error(_tiny_gguf(tmp_path, tokenizer_model="llama"))
    assert "unsupported tokenizer model 'llama'" in msg


def test_gguf_unsupported_quantization(tmp_path: Path) -> None:
    # Q8_1 is an intermediate llama.cpp type the gguf package cannot dequantize
    msg = _load_error(_tiny_gguf(tmp_path, quant={"blk.0.ffn_gate.weight": gguf.GGMLQuantizationType.Q8_1}))
    assert "blk.0.ffn_gate.weight" in msg and "unsupported quantization type Q8_1" in msg


def test_gguf_rope_scaling_refused(tmp_path: Path) -> None:
    def scaled(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    assert "rope" in _load_error(_tiny_gguf(tmp_path, extra=scaled))


def test_gguf_wrong_shape(tmp_path: Path) -> None:
    cfg, w = variant("LlamaForCausalLM", True)
    w = dict(w, **{"layers.0.w_up": w["layers.0.w_up"][:, :64]})
    msg = _load_error(write_gguf(tmp_path / "tiny.gguf", cfg, w))
    assert "layers.0.w_up" in msg and "shape" in msg


def test_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    msg = _load_error(tmp_path / "empty")
    assert "without config.json" in msg


def test_hf_unsupported_architecture(tmp_path: Path) -> None:
    msg = _load_error(_tiny_hf(tmp_path, arch="MambaForCausalLM"))
    assert "unsupported architecture" in msg and "MambaForCausalLM" in msg and "LlamaForCausalLM" in msg


def test_hf_invalid_config_json(tmp_path: Path) -> None:
    path = _tiny_hf(tmp_path)
    (path / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in _load_error(path)


def _edit_config(path: Path, **changes) -> Path:
    hf = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del hf[key]
        else:
            hf[key] = value
    (path / "config.json").write_text(json.dumps(hf))
    return path


def test_hf_config_missing_key(tmp_path: Path) -> None:
    assert "hidden_size" in _load_error(_edit_config(_tiny_hf(tmp_path), hidden_size=None))


def test_hf_rope_scaling_refused(tmp_path: Path) -> None:
    path = _edit_config(_tiny_hf(tmp_path), rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert "rope_scaling" in _load_error(path)


def test_hf_legacy_rope_scaling_refused(tmp_path: Path) -> None:
    path = _edit_config(_tiny_hf(tmp_path), rope_scaling={"type": "linear", "factor": 2.0})
    assert "rope" in _load_error(path)


def test_hf_rope_parameters_scaling_refused(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope" in _load_error(_edit_config(_tiny_hf(tmp_path), rope_parameters=rope))


def test_hf_without_safetensors(tmp_path: Path) -> None:
    path = _tiny_hf(tmp_path)
    (path / "model.safetensors").unlink()
    assert "no *.safetensors files" in _load_error(path)


def test_hf_missing_tensor(tmp_path: Path) -> None:
    cfg, w = variant("LlamaForCausalLM", True)
    path = write_hf_dir(tmp_path / "m", cfg, w)
    tensors = hf_tensors(w)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    msg = _load_error(path)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "missing" in msg


def test_hf_truncated_safetensors(tmp_path: Path) -> None:
    path = _tiny_hf(tmp_path)
    st = path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    msg = _load_error(path)
    assert "model.safetensors" in msg and "not a readable safetensors file" in msg


def test_hf_unsupported_dtype(tmp_path: Path) -> None:
    cfg, w = variant("LlamaForCausalLM", True)
    path = write_hf_dir(tmp_path / "m", cfg, w)
    tensors = hf_tensors(w)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, str(path / "model.safetensors"))
    msg = _load_error(path)
    assert "model.norm.weight" in msg and "unsupported dtype I32" in msg


def test_hf_without_tokenizer(tmp_path: Path) -> None:
    path = _tiny_hf(tmp_path)
    (path / "tokenizer.json").unlink()
    assert "no tokenizer.json" in _load_error(path)


def test_hf_corrupt_tokenizer(tmp_path: Path) -> None:
    path = _tiny_hf(tmp_path)
    (path / "tokenizer.json").write_text("{\"version\": 1")
    assert "cannot read" in _load_error(path)


@pytest.mark.skipif(not kernels.available(), reason="--weights q8_0 runs on the native CPU kernels")
@pytest.mark.parametrize(("qtype", "bound"), [("q8_0", 0.03), ("q4_1", 0.4)])
def test_hf_directory_quantized_at_load(tmp_path: Path, qtype: str, bound: float) -> None:
    """`--weights q8_0` (q4_1) on a Hugging Face directory: its float matrices become such blocks at load, run
    by the native kernels, and compute the model within their rounding of the float weights' logits (the
    bound: a share of the logits' range; measured 1.5% for Q8_0)."""
    cfg, w = variant("LlamaForCausalLM", False)
    loaded = load_model(write_hf_dir(tmp_path / "hf", cfg, w), progress=False)
    runner = ModelRunner(cfg, loaded.weights, tiny_engine_config(dtype="float32", weights=qtype, kv_dtype="f32"))
    assert runner.weights_mode == "quantized"
    ids = _ids()
    got, want = prefix_logits(cfg, loaded.weights, ids, mode=qtype), prefix_logits(cfg, loaded.weights, ids)
    err = float(np.abs(got - want).max())
    print(f"{qtype} against float weights: max |dlogit| {err:.2e} of logits up to {np.abs(want).max():.2f}")
    assert err < bound * np.abs(want).max()


def test_q8_0_weights_need_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, w = variant("LlamaForCausalLM", True)
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(ValueError, match="q8_0 needs the native CPU kernels"):
        ModelRunner(cfg, w, tiny_engine_config(dtype="float32", weights="q8_0", kv_dtype="f32"))
