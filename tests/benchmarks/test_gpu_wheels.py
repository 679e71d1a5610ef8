"""The GPU kit's wheel list (benchmarks/gpu/wheels.py): what the project and its tests need beyond the GPU
image, found from the installed packages' metadata, so a new transitive dependency is carried without an edit."""

from __future__ import annotations

import importlib.metadata

import pytest

from benchmarks.gpu import wheels

try:
    importlib.metadata.distribution(wheels.PROJECT)
except importlib.metadata.PackageNotFoundError:  # the checkout on a path, not installed (the GPU machine)
    pytest.skip("the project is not installed here (pip install -e '.[test]')", allow_module_level=True)


def test_carries_what_the_image_lacks_and_not_what_it_has() -> None:
    specs = wheels.needed()
    names = {s.split("==")[0] for s in specs}
    # the project's own and its dependencies' dependencies, at the versions installed here
    assert {"fastapi", "starlette", "llguidance", "gguf", "openai", "pydantic-core"} <= names
    assert any(s.startswith("fastapi==") for s in specs)
    # in the image: not carried, unless listed to be carried at this checkout's version
    assert not names & {"jax", "flax", "numpy", "torch", "transformers", "jinja2"}
    assert "tokenizers" in names and "tokenizers" in wheels.image_packages()
    # left out, with what only they need
    assert not names & {"playwright", "greenlet", "ruff", "kubernetes-validate", "rpds-py", "langchain-core",
                        "langsmith", "zstandard", "parrot-serve"}


def test_closure_follows_extras_and_markers() -> None:
    plain = wheels.closure(extras=())
    full = wheels.closure()
    assert "fastapi" in plain and "openai" not in plain  # openai comes with the test extras
    assert "openai" in full and set(plain) <= set(full)
