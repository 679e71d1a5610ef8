"""Layer boundaries: the serve layer and the frontend never import JAX; the engine never imports them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import parrot

ROOT = Path(parrot.__file__).parent


def _modules(package: str) -> list[str]:
    return [f"parrot.{package}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / package)])]


def test_serve_and_frontend_do_not_import_jax() -> None:
    mods = _modules("serve") + _modules("frontend")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_engine_does_not_import_serve_or_frontend() -> None:
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        assert "parrot.serve" not in text and "parrot.frontend" not in text, path
