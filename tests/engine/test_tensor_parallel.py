"""Tensor parallelism: exact zero-padding of heads, FFN and vocabulary; device-major fused columns;
greedy outputs of the real model on 1, 2 and 4 virtual CPU devices and on two processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from parrot.config import EngineConfig
from parrot.engine import quant
from parrot.engine.batch import SequenceSlice, build_batch
from parrot.engine.models.llama import Llama, LlamaConfig, random_weights
from parrot.engine.tensor_parallel import (
    TensorParallelError,
    device_major,
    make_mesh,
    pad_weights,
    padded_config,
)

ODD = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=3,
                  head_dim=32, max_position=256)
WORKER = Path(__file__).with_name("tp_worker.py")


def _logits(cfg: LlamaConfig, weights: dict) -> np.ndarray:
    model = Llama(cfg, weights)
    tokens = [5, 17, 3, 99, 42, 7, 64, 1]
    batch = build_batch([SequenceSlice(tokens, 0, [1])], 16, 16, 1, 16, 1)
    shape = (cfg.num_kv_heads, 4, 16, cfg.head_dim)
    kv = (tuple(jax.numpy.zeros(shape) for _ in range(cfg.num_layers)),) * 2
    logits, _ = model(jax.device_put(batch), kv)
    return np.asarray(logits)[:, : ODD.vocab_size]


def test_padded_config_splits_in_whole_heads_and_blocks() -> None:
    p = padded_config(ODD, 2)
    assert (p.num_heads, p.num_kv_heads, p.intermediate_size, p.vocab_size) == (8, 4, 96, 102)
    p4 = padded_config(ODD, 4, quantized=True)
    assert (p4.num_heads, p4.num_kv_heads, p4.intermediate_size, p4.vocab_size) == (8, 4, 128, 104)
    p3 = padded_config(ODD, 3)  # 3 divides the heads and the FFN: only the vocabulary grows
    assert (p3.num_heads, p3.num_kv_heads, p3.intermediate_size, p3.vocab_size) == (6, 3, 96, 102)


@pytest.mark.parametrize("tp", [2, 4])
def test_zero_padding_computes_the_same_model(tp: int) -> None:
    weights = random_weights(ODD, seed=1)
    padded = padded_config(ODD, tp)
    want = _logits(ODD, weights)
    got = _logits(padded, pad_weights(ODD, weights, padded))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_padding_a_quantized_matrix_adds_zero_blocks() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    q = quant.quantize(w, "q8_0")
    cfg = LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32)
    padded = padded_config(cfg, 2, quantized=True)  # FFN 96 -> 128: down gains a zero block per row
    out = pad_weights(cfg, {"layers.0.w_up": q, "layers.0.w_down": quant.quantize(w.T.copy(), "q8_0")}, padded)
    up, down = out["layers.0.w_up"].dequantize(), out["layers.0.w_down"].dequantize()
    np.testing.assert_array_equal(up[:, :96], q.dequantize())
    assert up.shape == (64, 128) and not up[:, 96:].any()
    assert down.shape == (128, 64) and not down[96:].any()


def test_device_major_puts_each_devices_sections_together() -> None:
    a = np.arange(12)  # sections q = [0..5], k = [6..8], v = [9..11] (heads of 1 column)
    got = device_major(a, [6, 3, 3], 3, axis=0)
    np.testing.assert_array_equal(got, [0, 1, 6, 9, 2, 3, 7, 10, 4, 5, 8, 11])


def test_more_devices_than_available_is_a_clear_error() -> None:
    with pytest.raises(TensorParallelError, match="xla_force_host_platform_device_count=8"):
        make_mesh(8, jax.devices("cpu")[:1])
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(tensor_parallel_size=0)


def _run(cmd: list[str], devices: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _worker(tp: int, mode: str = "auto", kv_dtype: str = "auto") -> dict:
    done = _run([sys.executable, str(WORKER), str(tp), mode, kv_dtype], devices=tp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single_device(smollm) -> dict:  # noqa: ANN001 - the session fixture skips without the model
    return _worker(1)


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_outputs_equal_on_virtual_devices(single_device: dict, tp: int) -> None:
    got = _worker(tp)  # the exact mode (the default on a CPU)
    assert got["tokens"] == single_device["tokens"]
    assert all(len(t) > 3 for t in got["tokens"])
    assert got["logits"] == single_device["logits"]  # bit for bit
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(single_device["prompt_logprobs"])
    np.testing.assert_allclose(got["prompt_logprobs"][1:], single_device["prompt_logprobs"][1:], rtol=0, atol=1e-5)


def test_megatron_mode_matches_to_rounding(single_device: dict) -> None:
    # O and down by input rows: partial sums added in another order. A KV cache of bfloat16 rounds each key and
    # value to 8 bits, so a changed sum can move a rounding and the logits by ~0.5% (seen: 0.129 of 25.4 on an
    # AVX2-only CPU with float32 products). Where products are float32 (AVX2-only CPUs) both sides run with a
    # float32 cache: sums in another order then move logits by ~1e-5 of their range (seen: 3.9e-4 of 25.4).
    # bfloat16 products and prefill attention (CPUs with bf16 units) round each layer's input, its queries and
    # its attention weights to 8 bits as well: ~1% (seen: 0.059 of 25.3 on a Xeon with bf16 products alone,
    # 0.308 of 25.4 with bf16 attention too)
    if single_device["prefill_dtype"] == "float32":
        want, got, tol = _worker(1, "auto", "f32"), _worker(2, "megatron", "f32"), 2e-3
    else:
        want, got, tol = single_device, _worker(2, "megatron"), 2e-2
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=0, atol=tol * np.abs(want["logits"]).max())
    assert got["tokens"][0] == want["tokens"][0]


GENERATE = [sys.executable, "-m", "parrot.cli", "generate", "What is the capital of France?", "--max-tokens", "16",
            "--compilation-cache-dir", ""]


@pytest.fixture(scope="module")
def generated_alone(smollm) -> str:  # noqa: ANN001
    done = _run(GENERATE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
    return done.stdout


def test_generate_with_tensor_parallel_size_2(generated_alone: str) -> None:
    done = _run([*GENERATE, "--tensor-parallel-size", "2"], devices=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == generated_alone


def test_generate_over_two_processes(generated_alone: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = ["--tp", "2", "--dist-init-addr", f"127.0.0.1:{port}", "--nnodes", "2"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    follower = subprocess.Popen([*GENERATE, *cluster, "--node-rank", "1"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    try:
        leader = _run([*GENERATE, *cluster, "--node-rank", "0"])
        out, err = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, err[-3000:]
    def text(out: str) -> str:  # without gloo's own "[Gloo] Rank 0 is connected ..." lines
        return "".join(line for line in out.splitlines(keepends=True) if not line.startswith("[Gloo]"))

    assert text(leader.stdout) == generated_alone
    assert text(out) == ""  # the follower only computes


def test_too_many_devices_is_refused_by_the_cli(smollm) -> None:  # noqa: ANN001
    done = _run([*GENERATE, "--tp", "4"], devices=1)
    assert done.returncode == 2
    assert "tensor_parallel_size 4 exceeds the 1 cpu device(s)" in done.stderr
