#!/usr/bin/env bash
# Pack what a GPU machine without network needs for Parrot's GPU checks. Run it here, where PyPI is
# reachable, from anywhere in the checkout; it writes the ignored folder .gpu/ at the project's root:
#   .gpu/whl/    wheels (CPython 3.12, manylinux x86-64, no dependencies resolved) of the packages the GPU
#                machine lacks (it has jax with CUDA, flax, numpy, torch, transformers, tokenizers, httpx,
#                jinja2, pytest and hypothesis: image-packages.txt), at the versions installed here (the
#                checkout's pins: install the project first); which ones, benchmarks/gpu/wheels.py says
#   .gpu/model/  the default model's GGUF in parts of at most 30 MiB plus its sha256, because one call to
#                the machine carries at most 64 MiB with the working tree (skip with GPU_NO_MODEL=1; the
#                speed runs use random weights of real shapes, only the tests that read the default model
#                need it)
# benchmarks/gpu/run.sh (on the GPU machine) installs and uses them; its header says which call carries what.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
rm -rf .gpu/whl .gpu/model
mkdir -p .gpu/whl .gpu/model

# the packages the project and its test extras need beyond the GPU image's (benchmarks/gpu/wheels.py: their
# dependency closure as installed here, less benchmarks/gpu/image-packages.txt), at the versions installed here
mapfile -t specs < <(python -m benchmarks.gpu.wheels)
[ "${#specs[@]}" -gt 0 ] || { echo "benchmarks/gpu/wheels.py named no package" >&2; exit 1; }
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  -d .gpu/whl "${specs[@]}"

if [ "${GPU_NO_MODEL:-0}" != 1 ]; then
  gguf=$(python -c "from parrot.engine.model_files import default_model_path; print(default_model_path())")
  split -b 30M -d "$gguf" .gpu/model/part-
  (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .gpu/model/SHA256SUMS
fi
du -sh .gpu/whl .gpu/model
ls .gpu/model
