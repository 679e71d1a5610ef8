"""Writing benchmark results: one JSON file per benchmark under benchmarks/results/."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(result: dict, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out
