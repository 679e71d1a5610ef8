"""Pydantic schemas shared across layers: engine primitives and runtime info.

This module is the only vocabulary the serve layer and the engine share; it imports neither."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How a Generate decodes. Ranges are checked here; vocabulary bounds by the engine."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(128, ge=1, description="stop after this many generated tokens")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = whole vocabulary")
    seed: int | None = Field(None, ge=0, lt=2**32, description="per-request seed; None = random")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in the output)")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


WAITED = ("seconds this work already waited upstream (e.g. the task it belongs to, in the serve core): the "
          "engine queues it as if it had arrived that long ago, so a task's later primitives keep its place")

PRIORITY = ("0 (default) runs before 1, 1 before 2...: waiting work is admitted and prefilled by (priority, "
            "arrival); the serve core sends 0 for latency-critical tasks and 1 for throughput tasks")


class FillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context_id: str = Field(min_length=1, max_length=256)
    parent_context_id: str | None = Field(None, description="fork this context first if context_id is new")
    token_ids: list[int] = Field(min_length=1)
    waited_s: float = Field(0.0, ge=0.0, le=86400.0, description=WAITED)
    priority: int = Field(0, ge=0, le=9, description=PRIORITY)


class FillResponse(BaseModel):
    context_id: str
    num_tokens: int  # tokens in the context after the fill


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context_id: str = Field(min_length=1, max_length=256)
    parent_context_id: str | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    waited_s: float = Field(0.0, ge=0.0, le=86400.0, description=WAITED)
    priority: int = Field(0, ge=0, le=9, description=PRIORITY)


class GenerateResponse(BaseModel):
    context_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    num_tokens: int  # tokens in the context after the generation


class StreamChunk(BaseModel):
    """One event of /generate_stream: new text (possibly empty) and the token that produced it."""

    token_id: int | None = None
    text: str = ""
    finish_reason: str | None = None


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
    num_contexts: int
    num_cached_tokens: int
    running: int
    waiting: int
    recent_step_ms: float
    steps: int
    shape_misses: int
    preemptions: int
    evictions: int
    cascade_steps: int
    max_batch_size: int | None = None  # sequences per step; None when the engine does not say
    aborts: int = 0  # primitives aborted before they finished
    compiled_shapes: int = 0  # step shapes compiled so far (warm-up progress)
    total_shapes: int = 0  # step shapes to compile; warm-up is over when all are compiled
    warmup_s: float | None = None  # engine start to every shape compiled (None while warming up)
    process_uptime_s: float | None = None  # at warm-up end: process start to every shape compiled
    rss_bytes: int | None = None  # the engine process's resident memory


# ---- engine <-> serve core: registration and heartbeats (appended for parrot/engine/http_api.py) ----
class EngineRegistration(BaseModel):
    """POST {serve_core}/v1/engine/register: an engine announces itself once it is listening."""

    name: str = Field(min_length=1, max_length=256, description="unique engine name; heartbeats refer to it")
    url: str = Field(description="base URL the serve core reaches the engine's /fill, /generate, ... at")
    model: str
    max_context_len: int = Field(ge=1)
    max_batch_size: int | None = Field(None, ge=1, description="sequences per step: the serve core's capacity model")


class EngineHeartbeat(BaseModel):
    """POST {serve_core}/v1/engine/heartbeat about every second; a 404 answer makes the engine register again."""

    name: str = Field(min_length=1, max_length=256)
    runtime: RuntimeInfo


# ---- Parrot REST API (frontend <-> serve core): sessions, semantic variables, calls ----------------
Criterion = Literal["latency", "throughput"]


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
    models: list[str] | None = None
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
