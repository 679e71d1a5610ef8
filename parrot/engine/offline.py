"""One-shot generation for a single prompt, straight on the ModelRunner (no scheduler).

Used by `parrot generate`, the model-correctness tests and the engine micro-benchmark."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from parrot.engine.batch import SequenceSlice, build_batch
from parrot.engine.runner import ModelRunner
from parrot.engine.sampling import SamplingBatch, SamplingParams, check_sampling
from parrot.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from parrot.errors import InvalidRequestError


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    timings: dict[str, float] = field(default_factory=dict)


def check_prompt(runner: ModelRunner, prompt_ids: list[int], max_tokens: int) -> None:
    vocab = runner.cfg.vocab_size
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
    if len(prompt_ids) + max_tokens > runner.max_len:
        raise InvalidRequestError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
            f"length {runner.max_len}"
        )
    if (len(prompt_ids) + max_tokens + runner.page_size - 1) // runner.page_size >= runner.num_pages:
        raise InvalidRequestError("the KV cache is too small for this prompt; raise kv_memory_mb")


def prefill(runner: ModelRunner, tokens: list[int], start: int, pages: list[int]) -> np.ndarray:
    """Run `tokens` through the model in chunks of at most max_num_batched_tokens; last logits."""
    chunk = runner.ecfg.max_num_batched_tokens
    logits = None
    for off in range(0, len(tokens), chunk):
        part = tokens[off : off + chunk]
        pos = start + off
        shape = runner.prefill_shape(1, len(part), pos + len(part))
        batch = build_batch([SequenceSlice(part, pos, pages)], runner.page_size, shape.tokens, shape.batch,
                            shape.q_len, shape.pages)
        logits = runner.forward(batch)
    assert logits is not None
    return logits


def generate(
    runner: ModelRunner, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SamplingParams,
) -> Generation:
    check_sampling(params, runner.cfg.vocab_size)
    check_prompt(runner, prompt_ids, params.max_tokens)
    n_pages = (len(prompt_ids) + params.max_tokens + runner.page_size - 1) // runner.page_size
    pages = list(range(1, 1 + n_pages))
    stops = set(params.stop_token_ids)
    if not params.ignore_eos and tokenizer is not None:
        stops |= tokenizer.stop_token_ids
    detok = IncrementalDetokenizer(tokenizer, params.stop) if tokenizer is not None else None
    default_seed = int(np.random.default_rng().integers(2**31))

    def pick(logits: np.ndarray, step: int) -> int:
        sb = None if params.greedy else SamplingBatch.build([params], [step], 1, [default_seed])
        return int(runner.sample(logits, sb)[0])

    t0 = time.perf_counter()
    logits = prefill(runner, prompt_ids, 0, pages)
    out: list[int] = []
    token = pick(logits, 0)
    t_first = time.perf_counter()
    finish = "length"
    pos = len(prompt_ids)
    while True:
        if token in stops:
            finish = "stop"
            break
        out.append(token)
        if detok is not None and detok.add(token)[1]:
            finish = "stop"
            break
        if len(out) >= params.max_tokens:
            break
        shape = runner.decode_shape(1, pos + 1)
        batch = build_batch([SequenceSlice([token], pos, pages)], runner.page_size, shape.tokens, shape.batch,
                            shape.q_len, shape.pages)
        logits = runner.forward(batch)
        token = pick(logits, len(out))
        pos += 1
    t_end = time.perf_counter()
    text = detok.text if detok is not None else ""
    timings = {"ttft_s": t_first - t0, "decode_s": t_end - t_first, "total_s": t_end - t0}
    return Generation(out, text, finish, len(prompt_ids), timings)
