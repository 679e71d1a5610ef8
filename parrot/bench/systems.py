"""The systems compared, each a server process started by the benchmark and stopped after its workloads:

- `parrot`: `parrot serve` (semantic variables; prefix sharing and app-aware scheduling on);
- `baseline-apc`: the same `parrot serve` with `--no-app-awareness`, used only through its
  OpenAI-compatible API with the app's control flow in the client: automatic prefix caching on (every
  prompt reuses the longest cached prefix), first come, first served, no DAG, no task groups, no
  priorities; what a vLLM or SGLang user has (prefix caching is on by default there);
- `baseline`: the same `parrot serve` with `--no-prefix-sharing --no-app-awareness`, used only through
  its OpenAI-compatible API (every request prefills its whole prompt; first come, first served);
- `llamacpp`: llama.cpp's Python server (llama-cpp-python; one request at a time, reuses the previous
  request's prompt prefix), from parrot/bench/peers/install_llamacpp.sh;
- `llama-server`: llama.cpp's C++ server (continuous batching over --parallel slots, per-slot prompt
  cache), from parrot/bench/peers/install_llama_server.sh.

Every system serves the same GGUF file. The Parrot engine dequantizes it to float32 (bf16 weight copies
for prefill on AMX CPUs); llama.cpp computes on the Q4_1 blocks directly."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from parrot.engine.model_files import default_model_path

MAX_MODEL_LEN = 2048  # the longest prompt + output of any workload (shared prompt: ~1,650 tokens)
PEERS_DIR = Path(os.environ.get("PARROT_PEERS_DIR", Path.home() / ".cache" / "parrot" / "peers"))
LLAMA_SERVER_SLOTS = 16
PEER_SCRIPTS = Path(__file__).resolve().parent / "peers"  # shipped with the package
NAMES = ["parrot", "baseline-apc", "baseline", "llamacpp", "llama-server"]


@dataclass
class System:
    name: str
    description: str
    command: list[str]
    health_path: str
    model: str  # the model name its OpenAI API expects
    extra_body: dict = field(default_factory=dict)  # what makes it generate exactly max_tokens
    missing: str | None = None  # why it cannot run here (not installed), None if it can
    port: int = 0
    startup_s: float | None = None
    stream: bool = True  # False: it cannot stream concurrent requests (measured without TTFT / TPOT)
    _proc: subprocess.Popen | None = None
    _log: IO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_path: Path, timeout: float = 1200.0) -> None:
        """Start the server and wait until it answers its health check (a clear error if it exits or
        does not come up in `timeout` seconds; its output is in `log_path`)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        t0 = time.perf_counter()
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self._proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {self._proc.returncode} while starting; "
                                   f"see {log_path}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy within {timeout:.0f} s; see {log_path}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def describe(self) -> dict:
        return {"description": self.description, "command": self.command, "startup_s": self.startup_s,
                "missing": self.missing}


def _parrot(name: str, port: int, flags: list[str], description: str, quick: bool) -> System:
    cmd = [sys.executable, "-m", "parrot.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), *flags]
    if quick:  # at most 16 requests at once in the quick workloads: fewer batch shapes to compile at startup
        cmd += ["--precompile-bs-paddings", "1", "2", "4", "8", "16"]
    return System(name, description, cmd, "/health", "smollm2", {"ignore_eos": True}, port=port)


def _llama_server_binary() -> Path | None:
    found = PEERS_DIR / "llama-server"
    if found.is_file() and os.access(found, os.X_OK):
        return found
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def build(names: list[str], base_port: int, quick: bool = False, parrot_args: list[str] | None = None,
          engine_args: list[str] | None = None) -> list[System]:
    """The named systems, each on its own loopback port; `missing` set for those not installed. `parrot_args`:
    more `parrot serve` options for the `parrot` system only (e.g. a scheduling setting under test; the
    baselines keep the defaults); `engine_args`: for every system `parrot serve` runs (parrot and both
    baselines: an engine setting under test, the same for all)."""
    gguf = str(default_model_path())
    out: list[System] = []
    same = list(engine_args or [])
    for i, name in enumerate(names):
        port = base_port + i
        if name == "parrot":
            out.append(_parrot(name, port, [*same, *(parrot_args or [])], "Parrot: the app as semantic variables "
                                                                         "(SDK); prefix sharing, app-aware scheduling",
                               quick))
        elif name == "baseline-apc":
            out.append(_parrot(name, port, [*same, "--no-app-awareness"],
                               "the same server behind the OpenAI API only, automatic prefix caching on, app "
                               "awareness off (FCFS, no DAG or task groups); app control flow in the client, "
                               "as a vLLM / SGLang user has it", quick))
        elif name == "baseline":
            out.append(_parrot(name, port, [*same, "--no-prefix-sharing", "--no-app-awareness"],
                               "the same engine behind the OpenAI API only; no prefix sharing, FCFS; app "
                               "control flow in the client", quick))
        elif name == "llamacpp":
            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                   "--port", str(port), "--n_ctx", str(MAX_MODEL_LEN), "--n_threads", "2",
                   "--n_batch", "512"]
            missing = (None if importlib.util.find_spec("llama_cpp") is not None
                       else f"not installed: run sh {PEER_SCRIPTS / 'install_llamacpp.sh'}")
            # llama-cpp-python ignores ignore_eos; a -100 bias on the end-of-generation tokens does the same
            # (<|endoftext|> id 0 and <|im_end|> id 2: llama.cpp stops on either)
            # its streaming breaks under concurrent requests (one-token answers, "ASGI callable returned
            # without completing response"), so it is used without streaming: job times only, no TTFT / TPOT
            out.append(System(name, "llama.cpp's Python server (llama-cpp-python 0.3.36): one request at a "
                                    "time, reuses the previous prompt's prefix; not streamed", cmd, "/v1/models",
                              "smollm2",
                              {"logit_bias": {"0": -100, "2": -100}}, missing, port, stream=False))
        elif name == "llama-server":
            binary = _llama_server_binary()
            cmd = [str(binary or "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                   "-t", "2", "--parallel", str(LLAMA_SERVER_SLOTS), "-c", str(MAX_MODEL_LEN * LLAMA_SERVER_SLOTS),
                   "--cont-batching"]
            out.append(System(name, f"llama.cpp's C++ server: continuous batching over {LLAMA_SERVER_SLOTS} "
                                    "slots, per-slot prompt cache", cmd, "/health", "smollm2",
                              {"ignore_eos": True}, None if binary else
                              f"not installed: run sh {PEER_SCRIPTS / 'install_llama_server.sh'}", port))
        else:
            raise ValueError(f"unknown system {name!r}: choose from {', '.join(NAMES)}")
    return out
