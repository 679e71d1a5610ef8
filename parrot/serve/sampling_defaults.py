"""The sampling settings an OpenAI request gets for the parameters it leaves out.

A model's own recommendation wins where its files carry one: the GGUF metadata keys
`general.sampling.temp / top_k / top_p / min_p / penalty_repeat` (what llama.cpp's converters write), or a
Hugging Face directory's `generation_config.json` (`temperature`, `top_k`, `top_p`, `min_p`,
`repetition_penalty`, as vLLM reads it). Settings the files do not give come from llama.cpp's server
defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05. A request's own values always win, field by
field (so `temperature: 0` is still greedy).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parrot.engine.model_files import open_gguf, resolve_model_path
from parrot.errors import ModelLoadError

log = logging.getLogger(__name__)

LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
_GGUF_KEYS = {"temperature": ("general.sampling.temp", "general.sampling.temperature"),
              "top_k": ("general.sampling.top_k",), "top_p": ("general.sampling.top_p",),
              "min_p": ("general.sampling.min_p",),
              "repetition_penalty": ("general.sampling.penalty_repeat",)}
_HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True)
class SamplingDefaults:
    values: dict[str, float | int] = field(default_factory=lambda: dict(LLAMA_CPP))
    source: str = "llama.cpp defaults"

    def to_json(self) -> dict[str, Any]:
        return {**self.values, "source": self.source}


def _clean(name: str, value: Any) -> float | int | None:
    """A usable value of one setting, or None (wrong type, out of range)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    if name == "top_k":
        return max(0, int(value))  # -1 / 0: off
    if name == "temperature":
        return float(value) if 0.0 <= value <= 2.0 else None
    if name in ("top_p",):
        return float(value) if 0.0 < value <= 1.0 else None
    if name == "min_p":
        return float(value) if 0.0 <= value <= 1.0 else None
    if name == "repetition_penalty":
        return float(value) if value > 0.0 else None
    return None


def recommended(values: dict[str, Any], source: str) -> SamplingDefaults:
    """llama.cpp's defaults overridden by the model's own values (those that are usable)."""
    own = {k: v for k, v in ((k, _clean(k, v)) for k, v in values.items()) if v is not None}
    if not own:
        return SamplingDefaults()
    return SamplingDefaults({**LLAMA_CPP, **own}, f"{source} (the rest: llama.cpp defaults)"
                            if set(LLAMA_CPP) - set(own) else source)


def from_gguf_fields(fields: dict[str, Any]) -> SamplingDefaults:
    values = {}
    for name, keys in _GGUF_KEYS.items():
        for key in keys:
            if key in fields:
                values[name] = fields[key]
                break
    return recommended(values, "the model's GGUF general.sampling.* metadata")


def from_generation_config(path: Path) -> SamplingDefaults:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s): llama.cpp sampling defaults", path, exc)
        return SamplingDefaults()
    if not isinstance(cfg, dict):
        return SamplingDefaults()
    return recommended({k: cfg[v] for k, v in _HF_KEYS.items() if v in cfg}, "the model's generation_config.json")


def model_sampling_defaults(model: str | Path | None) -> SamplingDefaults:
    """The defaults for a served model name: its files' recommendation when the name resolves to a model
    file or directory ('smollm2' is the default model), llama.cpp's defaults otherwise."""
    try:
        path = resolve_model_path(model)
    except ModelLoadError:
        return SamplingDefaults()
    try:
        if path.is_dir():
            gen = path / "generation_config.json"
            return from_generation_config(gen) if gen.is_file() else SamplingDefaults()
        return from_gguf_fields(open_gguf(path).fields)
    except ModelLoadError as exc:
        log.warning("cannot read the sampling settings of %s (%s): llama.cpp sampling defaults", path, exc)
        return SamplingDefaults()
