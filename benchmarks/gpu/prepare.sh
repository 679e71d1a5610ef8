#!/usr/bin/env bash
# Pack what a GPU machine without network needs for Parrot's GPU checks. Run it here, where PyPI is
# reachable, from anywhere in the checkout; it writes the ignored folder .gpu/ at the project's root:
#   .gpu/whl/    wheels (CPython 3.12, manylinux x86-64, no dependencies resolved) of the packages the GPU
#                machine lacks (it has jax with CUDA, flax, numpy, torch, transformers, tokenizers, httpx,
#                jinja2, prometheus-client, pytest and hypothesis), at the versions this checkout pins
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

# the installed version of each package here (the checkout's pins), else the name alone
spec() {
  local v
  v=$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true)
  if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}
PKGS=(gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions
      regex llguidance tokenizers safetensors prometheus-client openai distro jiter anyio sniffio h11 click
      pytest-xdist execnet pyyaml opentelemetry-api httpx2 httpcore2 truststore)
specs=()
for p in "${PKGS[@]}"; do specs+=("$(spec "$p")"); done
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
