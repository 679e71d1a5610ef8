"""Pydantic schemas shared across layers: engine primitives and runtime info.

This module is the only vocabulary the serve layer and the engine share; it imports neither."""

from __future__ import annotations

import codecs
import urllib.parse
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
MAX_LOGIT_BIAS = 300  # logit_bias entries per request
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 4096  # characters per stop string
TOP_K_ALL = 2**31 - 1  # a top_k beyond any vocabulary keeps all of it; larger ones are taken as this (int32)


class SamplingParams(BaseModel):
    """How a Generate decodes. Ranges are checked here; vocabulary bounds and constraint syntax by the engine.

    Constraints (at most one): `json_schema`, `regex`, `choice`, `grammar` (Lark, llguidance syntax). The
    output then matches it; it ends with finish_reason "stop" when the grammar is complete, "length" (the
    partial text) when max_tokens comes first."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(128, ge=1, description="stop after this many generated tokens")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0, or any k from the vocabulary's size up: the whole vocabulary")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top token's probability")
    seed: int | None = Field(None, ge=0, lt=2**64, description="per-request seed, 64 bits; None = random")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in the output)")
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = Field(False, description="the stop string (or the text of the stop_token_ids "
                                             "token) that ended the output is kept at its end, as in vLLM")
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids are suppressed until this many tokens")
    # penalties: presence / frequency over the generated tokens (OpenAI), repetition over prompt + generated
    # tokens (vLLM / Hugging Face: positive logits divided by it, negative ones multiplied)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="1 = off")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> bias added to its logit")
    # log probabilities of the model's raw distribution (log_softmax of the logits, before temperature,
    # penalties, bias and constraint masks)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="None: none; n: each token's logprob plus the n most likely")
    # constraints
    json_schema: dict[str, Any] | None = Field(None, description="a JSON schema the output must match")
    regex: str | None = Field(None, min_length=1, description="a regular expression the output must match")
    choice: list[str] | None = Field(None, min_length=1, description="the output is exactly one of these")
    grammar: str | None = Field(None, min_length=1, description="a Lark grammar (llguidance syntax)")

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, bias: dict[int, float]) -> dict[int, float]:
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
        bad = [t for t, b in bias.items() if t < 0 or not -100.0 <= b <= 100.0]
        if bad:
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100] (bad: {bad[:5]})")
        return bias

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: list[str]) -> list[str]:
        if len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings; got {len(stop)}")
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        if longest := max((len(s) for s in stop if len(s) > MAX_STOP_CHARS), default=0):
            raise ValueError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS}")
        return stop

    @field_validator("top_k")
    @classmethod
    def _clamp_top_k(cls, k: int) -> int:
        return min(k, TOP_K_ALL)  # the sampler's top_k is an int32; any k past the vocabulary means all of it

    @field_validator("choice")
    @classmethod
    def _check_choice(cls, choice: list[str] | None) -> list[str] | None:
        if choice is not None and any(not c for c in choice):
            raise ValueError("choice strings must not be empty")
        return choice

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        given = [n for n in CONSTRAINTS if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one constraint per generate; got {', '.join(given)}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constraint(self) -> str | None:
        """The name of the constraint field set, or None."""
        return next((n for n in CONSTRAINTS if getattr(self, n) is not None), None)

    @property
    def penalized(self) -> bool:
        """Presence, frequency or repetition penalty in use (the sampler then needs token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position."""

    token_id: int
    token: str  # its text; a token that is not whole UTF-8 reads "bytes:\\xNN..." (as OpenAI writes it)
    bytes: list[int]  # its UTF-8 bytes
    logprob: float


class TokenLogprob(BaseModel):
    """A chosen token's log probability and, when asked, the `logprobs` most likely tokens at its position
    (from the model's raw distribution: before temperature, penalties, bias and constraint masks). A
    context's first token has none (`logprob` None, no `top`): no token before it predicts it."""

    token_id: int
    token: str
    bytes: list[int]
    logprob: float | None
    top: list[TopLogprob] = Field(default_factory=list)


def token_offsets(items: Sequence[TokenLogprob], offset: int = 0) -> list[int]:
    """Where each token of `items` starts in the text they decode to, in characters from `offset` (a token
    holding part of a character starts where that character does)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    starts = []
    for t in items:
        starts.append(offset)
        offset += len(decoder.decode(bytes(t.bytes)))
    return starts


def logprobs_within(items: Sequence[TokenLogprob], chars: int) -> list[TokenLogprob]:
    """The tokens of `items` that start within the first `chars` characters of their text: where a stop string
    cut a generation's text, the tokens after the cut are not part of the answer, as OpenAI reports them."""
    return [t for t, start in zip(items, token_offsets(items), strict=True) if start < chars]


WAITED = ("seconds this work already waited upstream (e.g. the task it belongs to, in the serve core): the "
          "engine queues it as if it had arrived that long ago, so a task's later primitives keep its place")

CLIENT = ("whose work this is (e.g. the API key it came with; the serve core names its keys' indices): with "
          "several clients' work running or waiting, waiting work is admitted in turns between them, and in a full "
          "batch a client running fewer jobs than its share (the batch size over the clients) takes the place of the "
          "newest job, no more urgent than its own, of the client furthest above its share, which is preempted "
          "(recomputed later: the same output). None: no client")

PRIORITY = ("0 (default) runs before 1, 1 before 2...: waiting work is admitted and prefilled by (priority, "
            "arrival); the serve core sends 0 for latency-critical tasks and 1 for throughput tasks. The engine's "
            "throughput hold makes work of higher numbers that has prompts to fill wait, its decodes too, while "
            "work of priority 0 decodes")


class FillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context_id: str = Field(min_length=1, max_length=256)
    parent_context_id: str | None = Field(None, description="fork this context first if context_id is new")
    parent_num_tokens: int | None = Field(
        None, ge=0, description="fork only the first N tokens of the parent (its KV pages up to N shared): any "
                                "prefix of a cached context can seed a new one; default: all of them")
    token_ids: list[int] = Field(min_length=1)
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="None: none; n: each filled token's logprob given the context before it, plus the n most "
                    "likely tokens at its position (prompt logprobs). The fill computes them itself: on a context "
                    "with tokens it feeds the last one again, so only a context's first token has none")
    waited_s: float = Field(0.0, ge=0.0, le=86400.0, description=WAITED)
    priority: int = Field(0, ge=0, le=9, description=PRIORITY)
    client: str | None = Field(None, min_length=1, max_length=256, description=CLIENT)


class FillResponse(BaseModel):
    context_id: str
    num_tokens: int  # tokens in the context after the fill
    logprobs: list[TokenLogprob] | None = None  # with FillRequest.logprobs: one per filled token


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context_id: str = Field(min_length=1, max_length=256)
    parent_context_id: str | None = None
    parent_num_tokens: int | None = Field(
        None, ge=0, description="fork only the first N tokens of the parent (its KV pages up to N shared): any "
                                "prefix of a cached context can seed a new one; default: all of them")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    waited_s: float = Field(0.0, ge=0.0, le=86400.0, description=WAITED)
    priority: int = Field(0, ge=0, le=9, description=PRIORITY)
    client: str | None = Field(None, min_length=1, max_length=256, description=CLIENT)


class GenerateResponse(BaseModel):
    context_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    # what stopped it (vLLM's): the stop string or the `stop_token_ids` id; None for EOS, a grammar's end, length
    stop_reason: int | str | None = None
    num_tokens: int  # tokens in the context after the generation
    logprobs: list[TokenLogprob] | None = None  # with sampling.logprobs: one per token of token_ids
    # a constrained generate's (None otherwise): `text` is a whole output of its grammar. A stop (string, or a
    # stop_token_ids id) may end it there with include_stop_str_in_output, else it cuts the output short
    constraint_complete: bool | None = None


class StreamChunk(BaseModel):
    """One event of /generate_stream: new text (possibly empty) and the token that produced it."""

    token_id: int | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the last chunk's: as GenerateResponse.stop_reason
    logprob: TokenLogprob | None = None  # with sampling.logprobs: token_id's
    # the last chunk's, with sampling.logprobs: how many of the generation's token logprobs are the answer's
    # (fewer than its tokens where a stop string cut its text: `logprobs_within`); None: all
    logprobs_kept: int | None = None
    constraint_complete: bool | None = None  # the last chunk's: as GenerateResponse.constraint_complete


class FreeContextRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context_id: str = Field(min_length=1, max_length=256)


class FreeContextResponse(BaseModel):
    context_id: str
    freed_pages: int


class AbortRequest(BaseModel):
    """Abort the queued or running primitive on a context (its client went away)."""

    model_config = ConfigDict(extra="forbid")

    context_id: str = Field(min_length=1, max_length=256)


class AbortResponse(BaseModel):
    context_id: str
    aborted: bool  # False: nothing was queued or running on that context


class RuntimeInfo(BaseModel):
    """What Ping returns: the engine's load and cache state."""

    model: str
    max_context_len: int
    page_size: int
    total_pages: int
    free_pages: int
    written_pages: int = 0  # pages handed out and not given back since: where a CPU's lazily zeroed pool is resident
    released_pages: int = 0  # free pages given back to the OS after the engine idled (EngineConfig.kv_release_idle_s)
    num_contexts: int
    num_cached_tokens: int
    running: int
    waiting: int
    recent_step_ms: float
    steps: int
    prompt_tokens: int = 0  # prompt tokens computed in prompt chunks (recomputed ones too), since the start
    generated_tokens: int = 0  # tokens generated, since the start
    recent_host_ms: float = 0.0  # median host time per step: scheduling, batch building, applying tokens
    ahead_steps: int = 0  # steps launched while the previous one ran (overlap)
    overlap: bool | None = None  # the engine plans a stable decode batch's next step while one runs
    # what the engine chose for its device: platform, weights, KV dtype and bytes, buckets (engine/device.py)
    settings: dict[str, Any] | None = None
    shape_misses: int
    preemptions: int
    priority_preemptions: int = 0  # of those, to make room in a full batch for more urgent work (priority)
    fair_preemptions: int = 0  # of those, to give a client its share of a full batch (client)
    # slots an urgent prompt kept for the primitive that followed it, and which it took (priority_handoff_ms)
    kept_slots: int = 0
    evictions: int
    cascade_steps: int
    mixed_steps: int = 0  # steps that ran decodes and prompt chunks in one pass over the weights
    multi_step_launches: int = 0  # multi-step decode plans run (several decode steps in one call)
    decode_bursts: int = 0  # decode-only bursts run between prompt steps (EngineConfig.decode_bursts)
    held_steps: int = 0  # steps planned while throughput prompts waited for latency-critical decodes
    max_batch_size: int | None = None  # sequences per step; None when the engine does not say
    aborts: int = 0  # primitives aborted before they finished
    compiled_shapes: int = 0  # step shapes compiled so far (warm-up progress)
    total_shapes: int = 0  # step shapes to compile; warm-up is over when all are compiled
    warmup_s: float | None = None  # engine start to every shape compiled (None while warming up)
    process_uptime_s: float | None = None  # at warm-up end: process start to every shape compiled
    rss_bytes: int | None = None  # the engine process's resident memory
    constrained_steps: int = 0  # steps whose sampling had constraint work (masks, or checks of greedy tokens)
    unmasked_tokens: int = 0  # greedy constrained tokens their grammar accepted unmasked: masks not computed
    refused_tokens: int = 0  # ... that a multi-step call sampled and the grammar refused (the call's rest dropped)
    walked_tokens: int = 0  # rejected greedy constrained rows whose masked argmax was found without a mask
    fast_forward_tokens: int = 0  # tokens a grammar forced, fed as decode rows of one step: decode steps saved
    spec_steps: int = 0  # speculative decoding: drafts verified (each in one step)
    spec_draft_tokens: int = 0  # draft tokens fed for verification
    spec_accepted_tokens: int = 0  # draft tokens the samples after them confirmed (decode steps saved)
    mask_ms_mean: float | None = None  # host time to compute a batch's constraint masks, recent steps
    mask_ms_p99: float | None = None
    draining: bool = False  # stopping (SIGTERM): its requests under way finish, it takes no new work


# ---- engine <-> serve core: registration and heartbeats (appended for parrot/engine/http_api.py) ----
def http_base_url(url: str | None) -> str | None:
    """A base URL one side calls the other at (an engine's, the serve core's): http or https, a host, and nothing
    the caller would misread or leak (no user or password, query or fragment). ValueError otherwise."""
    if url is None:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise ValueError(f"{url!r} is not a URL: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host (e.g. http://10.0.0.5:9001)")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not carry a user, password, query or fragment (keys go in a header)")
    if port == 0:
        raise ValueError(f"{url!r}: port 0")
    return url


class EngineRegistration(BaseModel):
    """POST {serve_core}/v1/engine/register: an engine announces itself once it is listening."""

    name: str = Field(min_length=1, max_length=256, description="unique engine name; heartbeats refer to it")
    url: str = Field(max_length=2048, description="base URL the serve core reaches the engine's /fill, /generate, "
                                                  "... at: http:// or https://, a host, no user, query or fragment")
    model: str
    max_context_len: int = Field(ge=1)
    max_batch_size: int | None = Field(None, ge=1, description="sequences per step: the serve core's capacity model")
    runtime: RuntimeInfo | None = Field(None, description="its state as it registers (warm-up progress included), "
                                                          "until its first heartbeat")

    _url = field_validator("url")(http_base_url)


class EngineHeartbeat(BaseModel):
    """POST {serve_core}/v1/engine/heartbeat about every second; a 404 answer makes the engine register again."""

    name: str = Field(min_length=1, max_length=256)
    runtime: RuntimeInfo
    # the URL it registered with: a heartbeat under a name another engine registered since is refused (409)
    url: str | None = Field(None, max_length=2048)

    _url = field_validator("url")(http_base_url)


# ---- Parrot REST API (frontend <-> serve core): sessions, semantic variables, calls ----------------
Criterion = Literal["latency", "throughput"]


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_salt: str | None = Field(None, min_length=1, description="the session shares global constants and "
                                   "cached prompt prefixes only with sessions of the same salt (vLLM's cache_salt, "
                                   "per session): a tenant cannot tell from timing what another sent")


class SessionCreated(BaseModel):
    session_id: str
    session_token: str


class SemanticVarCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str
    name: str = Field(min_length=1, max_length=256)
    content: str | None = Field(None, max_length=1_000_000)


class SemanticVarSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str
    content: str = Field(max_length=1_000_000)


class SemanticVarCreated(BaseModel):
    var_id: str


class SemanticVarContent(BaseModel):
    var_id: str
    content: str


class SemanticCallParameter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    is_output: bool = False
    var_id: str | None = None
    value: str | None = Field(None, max_length=1_000_000)
    sampling_config: SamplingParams | None = None


class SemanticCallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str
    template: str = Field(min_length=1, max_length=1_000_000)
    parameters: list[SemanticCallParameter] = Field(default_factory=list, max_length=256)
    # the models the call may run on (the Parrot paper's semantic functions name theirs): a 404 when none of
    # them is one of the served model's names; None: any
    models: list[str] | None = Field(None, min_length=1, max_length=64)
    output_criteria: Criterion | None = Field(None, description="run now with this criterion, without a get")


class ParamInfo(BaseModel):
    name: str
    is_output: bool
    var_id: str


class CallCreated(BaseModel):
    request_id: str
    param_info: list[ParamInfo]


class NativeInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    var_id: str | None = None
    value: str | None = Field(None, max_length=1_000_000)


class NativeCallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str
    transform: str = Field(min_length=1, max_length=64)
    params: dict[str, Any] = Field(default_factory=dict)
    inputs: dict[str, NativeInput] = Field(default_factory=dict, max_length=64)
    outputs: list[str] = Field(min_length=1, max_length=16)
