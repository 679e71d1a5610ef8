"""Job: one Fill or Generate primitive as the engine tracks it from arrival to finish."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parrot.engine.tokenizer import IncrementalDetokenizer
from parrot.protocol import FillResponse, GenerateResponse, SamplingParams, StreamChunk, TokenLogprob

if TYPE_CHECKING:
    from parrot.engine.logprobs import TokenTexts
    from parrot.engine.structured import Constraint

_ids = itertools.count()


class JobKind(enum.Enum):
    FILL = "fill"
    GENERATE = "generate"


class JobStatus(enum.Enum):
    WAITING = "waiting"  # queued; its context may not exist yet
    RUNNING = "running"  # holds its context; being prefilled or decoded
    FINISHED = "finished"


@dataclass(eq=False)
class Job:
    kind: JobKind
    context_id: str
    parent_context_id: str | None
    fill_tokens: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None
    # called from the engine thread: each StreamChunk, then once with the final result or an exception
    on_chunk: Callable[[StreamChunk], None] | None = None
    on_done: Callable[[object | None, BaseException | None], None] | None = None
    job_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower first (latency-critical work before throughput work)
    client: str | None = None  # whose work it is (an API key): several clients share a full batch (`Scheduler`)
    queued: int = 0  # jobs the scheduler took before this one (`Scheduler.add`): the last tie-break of `order`
    status: JobStatus = JobStatus.WAITING
    base_len: int = -1  # context length before this fill was applied (-1: not yet); failures roll back
    created: bool = False  # this fill made its context (a new one, or a fork): failing, it frees it
    pending: list[int] = field(default_factory=list)  # tokens to feed before this job can finish/decode
    output_ids: list[int] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    stop_ids: frozenset[int] = frozenset()
    # those of stop_ids a stop names as its stop_reason: the request's stop_token_ids but the model's EOS (an end
    # of the model's own, as vLLM reports it; EOS counts as named where ignore_eos is set)
    named_stop_ids: frozenset[int] = frozenset()
    finish_reason: str | None = None
    preemptions: int = 0
    constraint: Constraint | None = None  # the grammar the output follows (compiled at submit)
    context_tokens: list[int] = field(default_factory=list)  # the context's token list (the scheduler's, growing)
    texts: TokenTexts | None = None  # token texts for logprobs (set at submit when they are asked for)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    fill_logprobs: int | None = None  # a fill asked for its tokens' logprobs, with this many alternatives
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # fill token index -> its logprob
    forced: bool = False  # `pending` holds tokens the grammar forced after the last sampled one
    # the output's length when its grammar refused a token a multi-step loop sampled without a mask: the token at
    # that place is sampled by a single step, checked or masked (-1: none refused there)
    refused_at: int = -1
    # a constrained job's free runs (tokens sampled between two places where its grammar forced or refused one):
    # the current one's length so far and the recent ones' lengths, which size its multi-step calls
    run_tokens: int = 0
    runs: list[int] = field(default_factory=list)
    parent_num_tokens: int | None = None  # a new context forks this many of the parent's tokens (None: all)

    @property
    def order(self) -> tuple[int, float, int]:
        """Queue position: by priority, then arrival, then the order the scheduler took them in (jobs of one
        arrival, e.g. a fill and the generate forking its context, keep it when a preempted one is queued again)."""
        return (self.priority, self.arrival, self.queued)


@dataclass
class JobOutput:
    """What one step produced for one job: chunks to stream (a token's, then the final one carrying the
    finish reason), and/or its end (a result or an error)."""

    job: Job
    chunks: list[StreamChunk] = field(default_factory=list)
    result: FillResponse | GenerateResponse | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None
