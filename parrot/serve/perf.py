"""Performance deduction: which chains are needed, how urgently, and which belong together.

Reading a variable with a criterion (latency or throughput) makes every chain it transitively depends
on needed with that criterion; latency wins over throughput. A chain's depth is the length of the
longest producer path above it, ended calls included (app-FIFO: deeper work of an app was activated by
earlier work and goes first). Chains whose outputs feed one consumer chain form a task group, dispatched together so
the consumer can start as soon as possible.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from parrot.serve.graph import CompletionChain, ComputeGraph
from parrot.serve.variables import SemanticVariable

Criterion = Literal["latency", "throughput"]


def merge(a: Criterion | None, b: Criterion) -> Criterion:
    return "latency" if "latency" in (a, b) else "throughput"


def deduce(graph: ComputeGraph, var: SemanticVariable, criterion: Criterion,
           criteria: dict[str, Criterion]) -> list[tuple[CompletionChain, Criterion | None]]:
    """Mark the chains `var` depends on as needed (in `criteria`, by chain id); returns them, each with the
    criterion it had before (None: not needed)."""
    out = []
    for chain in graph.upstream_chains(var):
        was = criteria.get(chain.id)
        criteria[chain.id] = merge(was, criterion)
        out.append((chain, was))
    return out


def depth(inputs: Iterable[SemanticVariable]) -> int:
    """The depth of a call reading `inputs`: one more than the deepest call computing one of them (0 when
    clients set them all). Each variable keeps its producer's depth (`SemanticVariable.depth`), so a step
    submitted after the ones it reads have ended (and left the graph) still counts them. A native call adds
    no depth (its outputs are as deep as its inputs): it is the app's code between two LLM calls."""
    return 1 + max((v.depth for v in inputs), default=-1)


def task_group(graph: ComputeGraph, chain: CompletionChain) -> str | None:
    """The group of chains feeding the same consumer as `chain` (None if it feeds none, or alone)."""
    for consumer in graph.consumers_of(chain.output_var):
        producers = {p.id for v in consumer.dependency_vars for p in graph.producers_of(v)}
        if len(producers) > 1:
            return f"group:{consumer.id}"
    return None
