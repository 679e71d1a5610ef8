"""Which wheels a GPU machine without network needs for Parrot's checks: every package the project and its
test extras need (their dependency closure, as installed here), less what the machine's image holds
(`image-packages.txt`), less what the GPU checks do without, plus image packages carried at this checkout's
versions. Prints one `name==version` a line (benchmarks/gpu/prepare.sh downloads them).

    python -m benchmarks.gpu.wheels
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "parrot-serve"
EXTRAS = ("test",)
# image packages carried at the versions this checkout pins or has (tokenizers 0.23.3 against the image's 0.23.2)
ALSO = ("tokenizers", "safetensors", "regex", "prometheus-client", "typing-extensions", "anyio", "click", "h11",
        "pytest-xdist", "execnet", "pyyaml")
# not carried, nor what only they need: a browser driver (its test needs chromium too), the linter, 22 MB of
# Kubernetes schemas and LangChain's 9 MB (one call carries at most 64 MiB, the working tree ~16 MB of it, and
# the default model's parts 30 MiB each); the tests that use them skip without them
LEAVE_OUT = ("playwright", "ruff", "kubernetes-validate", "langchain-openai", "langchain-core")


IMAGE_PACKAGES = Path(__file__).with_name("image-packages.txt")


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    return {canonicalize_name(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def closure(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS,
            leave_out: tuple[str, ...] = LEAVE_OUT) -> dict[str, str]:
    """Every installed distribution `project[extras]` needs (by its metadata's requirements and markers), by
    canonical name, with its installed version; `leave_out` and what is reached only through them excepted."""
    skip = {canonicalize_name(n) for n in leave_out}
    found: dict[str, str] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [(project, frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in skip or (key, wanted) in done:
            continue
        done.add((key, wanted))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as exc:
            raise SystemExit(f"{name} is not installed here: install the project first "
                             "(pip install -e '.[test]')") from exc
        found[key] = dist.version
        envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    found.pop(canonicalize_name(project), None)
    return found


def needed() -> list[str]:
    have = closure()
    image = image_packages()
    names = {n for n in have if n not in image} | {canonicalize_name(n) for n in ALSO}
    return [f"{n}=={have[n]}" if n in have else n for n in sorted(names)]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{spec}\n" for spec in needed()))
