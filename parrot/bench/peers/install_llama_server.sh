#!/usr/bin/env bash
# Builds llama.cpp's C++ `llama-server` (continuous batching, --parallel N) as a speed peer for the
# benchmarks, from the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist on PyPI (the same
# llama.cpp as the Python peer from install_llamacpp.sh). Only PyPI is needed, no git clone.
# Static llama/ggml libs (~5-6 min on 2 cores; the binary needs only libc/libstdc++/libgomp), copied to
# ${PARROT_PEERS_DIR:-~/.cache/parrot/peers}/llama-server.
# A native build (-march=native) everywhere except on CPUs with AMX, where llama.cpp's AMX matmul
# crashes: there AMX is switched off and AVX-512 kernels are named instead. No curl/OpenSSL (local GGUF files only)
# and no web UI (its prebuilt assets would be downloaded from Hugging Face at build time).
set -euo pipefail

LCPP_VERSION="${LCPP_VERSION:-0.3.36}"
PEERS_DIR="${PARROT_PEERS_DIR:-$HOME/.cache/parrot/peers}"
WORK_DIR="${LLAMA_SERVER_BUILD_DIR:-${TMPDIR:-/tmp}/parrot-llama-server-build}"
JOBS="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || PYTHON=python

# Build tools: cmake (>= 3.18 for the UI-asset step) and ninja from PyPI when missing or too old.
cmake_ok() {
    command -v cmake >/dev/null || return 1
    local v
    v="$(cmake --version | head -n1 | awk '{print $3}')"
    [ "$(printf '%s\n3.18\n' "$v" | sort -V | head -n1)" = "3.18" ]
}
if ! cmake_ok || ! command -v ninja >/dev/null; then
    "$PYTHON" -m pip install cmake ninja
    hash -r
fi
if ! command -v c++ >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update && apt-get install -y --no-install-recommends g++ make
    else
        echo "error: no C++ compiler (install g++)" >&2
        exit 1
    fi
fi

# Sources: the sdist of llama-cpp-python, which vendors llama.cpp under vendor/llama.cpp.
mkdir -p "$WORK_DIR" "$PEERS_DIR"
SDIST="$WORK_DIR/llama_cpp_python-${LCPP_VERSION}.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==${LCPP_VERSION}" -d "$WORK_DIR"
fi
SRC="$WORK_DIR/llama_cpp_python-${LCPP_VERSION}/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tar -xzf "$SDIST" -C "$WORK_DIR"
fi

# CPU flags: on Xeons with AMX, llama.cpp's AMX path crashes (ggml_backend_amx_mul_mat), so the AVX-512
# set is named with AMX off; every other CPU (e.g. AVX2-only EPYCs, where forced AVX-512 dies with
# SIGILL) builds for exactly its own instruction set.
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
else
    CPU_FLAGS="-DGGML_NATIVE=ON"
fi

# Configure and build only the llama-server target.
BUILD="$WORK_DIR/build"
# shellcheck disable=SC2086  # CPU_FLAGS is a list of options
cmake -S "$SRC" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF $CPU_FLAGS \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_COMMIT="llama-cpp-python-${LCPP_VERSION}"
cmake --build "$BUILD" --target llama-server -j "$JOBS"

install -m 0755 "$BUILD/bin/llama-server" "$PEERS_DIR/llama-server"
echo "installed $PEERS_DIR/llama-server"
"$PEERS_DIR/llama-server" --version
