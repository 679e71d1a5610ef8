"""Greedy tokens of a few concurrent prompts on the default model, run with tensor parallelism over N
virtual CPU devices (a separate process: the device count is fixed when JAX starts).

    python tests/engine/tp_worker.py N [MODE [KV_DTYPE]]
    -> prints {"tokens": one token list per prompt, "logits": the first prompt's next-token logits,
               "prompt_logprobs": the first prompt's token logprobs from a Fill (the first token's null),
               "prefill_dtype": the weight dtype of prefill products (bfloat16 on CPUs with bf16 matrix units)}
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys

import numpy as np

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain gravity to a child in one sentence."]


def main() -> None:
    tp = int(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "auto"
    kv_dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}"
    from parrot.config import EngineConfig
    from parrot.engine.engine import LLMEngine
    from parrot.engine.loader import load_model
    from parrot.engine.sampling import SamplingParams
    from parrot.protocol import FillRequest

    model = load_model(progress=False)
    tok = model.tokenizer
    cfg = EngineConfig(tensor_parallel_size=tp, tensor_parallel_mode=mode, kv_memory_mb=64, compilation_cache_dir=None,
                       token_buckets=[16, 32, 64], bs_buckets=[1, 2, 4], max_batch_size=4, max_num_batched_tokens=64,
                       kv_buckets=[128, 256], kv_dtype=kv_dtype)
    engine = LLMEngine(model, cfg).start(precompile=False)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # decoded in one batch
            outs = list(pool.map(lambda ids: engine.complete(ids, params), prompts))
        scored = engine.fill_future(FillRequest(context_id="scored", token_ids=prompts[0], logprobs=2)).result(600)
    finally:
        engine.shutdown()
    pages = list(range(1, 1 + -(-len(prompts[0]) // cfg.page_size)))  # the engine is stopped: any pages do
    logits = engine.runner.prefill_logits(prompts[0], 0, pages)[0]
    print(json.dumps({"tokens": [o.response.token_ids for o in outs], "logits": np.asarray(logits, np.float32).tolist(),
                      "prompt_logprobs": [lp.logprob for lp in scored.logprobs],
                      "prefill_dtype": str(engine.runner.prefill_dtype)}))


if __name__ == "__main__":
    main()
