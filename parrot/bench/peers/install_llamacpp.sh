#!/usr/bin/env bash
# Installs llama.cpp's Python server (llama-cpp-python 0.3.36) as a speed peer for the benchmarks.
# Builds from source (~4-5 min on 2 cores). The default build crashes on CPUs with AMX in the AMX
# matmul (ggml_backend_amx_mul_mat), so AMX is switched off and AVX-512 kernels are used instead.
set -euo pipefail
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
pip install --no-deps --no-cache-dir llama-cpp-python==0.3.36
pip install 'llama-cpp-python[server]==0.3.36'
python -c "import llama_cpp, llama_cpp.server; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
