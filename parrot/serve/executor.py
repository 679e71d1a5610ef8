"""GraphExecutor: lazy, topological execution of one session's graph.

A completion chain runs when all its inputs are ready AND its output is needed: some client reads a
variable that depends on it (`get` / `stream` with a criterion), or its request was submitted with
`output_criteria`. Performance deduction (perf.py) walks back from the variable being read. Ready and
needed chains become CompletionTasks for the GlobalScheduler. Native calls (string transforms) run on
the server as soon as their inputs are ready and their outputs are needed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from parrot.errors import ConflictError
from parrot.serve import perf
from parrot.serve.graph import CompletionChain, ComputeGraph, RequestChain
from parrot.serve.perf import Criterion
from parrot.serve.transforms import TransformCall
from parrot.serve.variables import SemanticVariable

NATIVE_ID_PREFIX = "n-"  # a native call's request id begins so (a semantic call's does not)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class NativeNode:
    call: TransformCall
    inputs: dict[str, SemanticVariable]
    outputs: dict[str, SemanticVariable]
    request_id: str
    done: bool = False
    needed: bool = False
    criterion: Criterion | None = None  # the most urgent criterion a reader needs its outputs with


@dataclass
class GraphExecutor:
    graph: ComputeGraph = field(default_factory=ComputeGraph)
    criteria: dict[str, Criterion] = field(default_factory=dict)  # needed chains by id
    # variables clients asked for (read, or outputs of a call submitted with output_criteria) while pending: a
    # call computing one that arrives later (a reader may wait before its producer is submitted) is needed too
    wanted: dict[str, Criterion] = field(default_factory=dict)
    natives: list[NativeNode] = field(default_factory=list)  # native calls not run yet (scanned by `ready`)
    _native_of: dict[str, NativeNode] = field(default_factory=dict)  # output var id -> node, while not run
    _native_readers: dict[str, list[NativeNode]] = field(default_factory=dict)  # input var id -> nodes not run
    history: list[CompletionChain] = field(default_factory=list)  # every chain inserted, finished ones too
    native_history: list[NativeNode] = field(default_factory=list)  # every native call added, run ones too

    def add_request(self, chain: RequestChain, output_criteria: Criterion | None) -> None:
        """Insert a request's chains (refused, with the graph unchanged, where an output already has a producer
        here or among the native calls not run, or where a cycle would close). Each chain's output takes its
        app depth; an output some reader or needed call already waits for makes its chain needed."""
        for c in chain.chains:
            var = c.output_var
            if var.is_pending and var.producer is not None:  # a call (a native one too, running or not) computes it
                kind = "native call" if var.producer.startswith(NATIVE_ID_PREFIX) else "call"
                raise ConflictError(f"output variable {var.name!r} ({var.id}) already has a producer "
                                    f"({kind} {var.producer})")
        self.graph.insert(chain, via=self._computed_from)  # a cycle through native calls is refused too
        self.history.extend(chain.chains)
        for c in chain.chains:  # in template order: a later output reads the earlier ones
            c.output_var.depth = perf.depth(c.dependency_vars)
        for c in chain.chains:
            self._need_if_waited_for(c.output_var, output_criteria)

    def add_native(self, node: NativeNode) -> None:
        for var in node.outputs.values():
            self._native_of[var.id] = node
            var.depth = perf.depth(node.inputs.values()) - 1
        for var in node.inputs.values():
            self._native_readers.setdefault(var.id, []).append(node)
        self.natives.append(node)
        self.native_history.append(node)
        for var in node.outputs.values():
            self._need_if_waited_for(var, None)

    def _need_if_waited_for(self, var: SemanticVariable, criterion: Criterion | None) -> None:
        """`var` just got its producer: needed if a client asked for it (or `criterion`: output_criteria), or a
        needed call not started reads it; with the most urgent of their criteria."""
        crit = self.wanted.get(var.id)
        if criterion is not None:
            crit = perf.merge(crit, criterion)
        for consumer in self.graph.consumers_of(var):
            if not consumer.started and consumer.id in self.criteria:
                crit = perf.merge(crit, self.criteria[consumer.id])
        for n in self._native_readers.get(var.id, ()):
            if n.needed and not n.done and n.criterion is not None:
                crit = perf.merge(crit, n.criterion)
        if crit is not None:
            self.need(var, crit)

    def _computed_from(self, var_id: str) -> list[str]:
        """The variables native calls not run yet compute from variable `var_id`."""
        return [out.id for n in self._native_readers.get(var_id, ()) for out in n.outputs.values()]

    def _retire(self, done: list[NativeNode]) -> None:
        """Run (or failed) native calls leave the pending list (the history keeps them for the live view)."""
        if not done:
            return
        gone = {id(n) for n in done}
        self.natives = [n for n in self.natives if id(n) not in gone]
        for n in done:
            for var in n.outputs.values():
                self.wanted.pop(var.id, None)
                if self._native_of.get(var.id) is n:
                    del self._native_of[var.id]
            for var in n.inputs.values():
                readers = [r for r in self._native_readers.get(var.id, ()) if r is not n]
                if readers:
                    self._native_readers[var.id] = readers
                else:
                    self._native_readers.pop(var.id, None)

    def need(self, var: SemanticVariable, criterion: Criterion) -> list[CompletionChain]:
        """A client waits for `var`: mark everything it depends on as needed (calls submitted later that compute
        it, too: `wanted`). Returns the chains this made latency-critical that were not before."""
        if var.is_pending:
            self.wanted[var.id] = perf.merge(self.wanted.get(var.id), criterion)
        stack, seen = [var], set()
        upgraded: list[CompletionChain] = []
        while stack:
            v = stack.pop()
            if v.id in seen:
                continue
            seen.add(v.id)
            native = self._native_of.get(v.id)
            if native is not None:
                native.needed = True
                native.criterion = perf.merge(native.criterion, criterion)
                stack.extend(native.inputs.values())
            for chain, was in perf.deduce(self.graph, v, criterion, self.criteria):
                stack.extend(chain.dependency_vars)
                if was == "throughput" and self.criteria[chain.id] == "latency":
                    upgraded.append(chain)
        return upgraded

    def unneed(self, var: SemanticVariable, still_needed: Callable[[SemanticVariable], bool]) -> list[SemanticVariable]:
        """`need`'s undoing, one step: nothing needs `var` now (its reader left), so neither does the chain that
        computes it (not started) or its native call (not run, and no other of its outputs `still_needed`).
        Returns their inputs, which may be needed no more in turn."""
        upstream: list[SemanticVariable] = []
        self.wanted.pop(var.id, None)
        for chain in self.graph.chains:
            if chain.output_var is var and not chain.started and self.criteria.pop(chain.id, None) is not None:
                upstream += chain.dependency_vars
        native = self._native_of.get(var.id)
        if native is not None and native.needed and not native.done and \
                not any(still_needed(v) for v in native.outputs.values() if v is not var):
            native.needed = False
            native.criterion = None
            upstream += native.inputs.values()
        return upstream

    def ready(self) -> tuple[list[tuple[CompletionChain, Criterion]], list[NativeNode]]:
        """Needed chains whose inputs are all ready (marked started), and runnable native calls."""
        chains = []
        for chain in self.graph.ready_chains():
            criterion = self.criteria.get(chain.id)
            if criterion is not None:
                self.graph.mark_started(chain)
                chains.append((chain, criterion))
        natives = [n for n in self.natives if not n.done and n.needed and all(v.is_ready for v in n.inputs.values())]
        for n in natives:
            n.done = True
        self._retire(natives)
        return chains, natives

    @staticmethod
    def depth(chain: CompletionChain) -> int:
        return chain.output_var.depth

    def group(self, chain: CompletionChain) -> str | None:
        return perf.task_group(self.graph, chain)

    def finished(self, chain: CompletionChain) -> None:
        self.criteria.pop(chain.id, None)
        self.wanted.pop(chain.output_var.id, None)
        self.graph.remove(chain)

    def fail_downstream(self, fail: Callable[[SemanticVariable, str], None]) -> None:
        """Chains and natives waiting on a failed variable can never run: fail their outputs too, with
        the reason of the input that failed."""
        def why(vars_: list[SemanticVariable]) -> str | None:
            bad = next((v for v in vars_ if v.is_failed), None)
            return None if bad is None else f"input {bad.name!r} ({bad.id}) failed: {bad.error}"

        changed = True
        while changed:
            changed = False
            for chain in self.graph.chains:
                reason = None if chain.started else why(chain.dependency_vars)
                if reason is not None:
                    self.graph.mark_started(chain)
                    if chain.output_var.is_pending:
                        fail(chain.output_var, reason)
                    self.finished(chain)
                    changed = True
            failed = []
            for n in self.natives:
                reason = None if n.done else why(list(n.inputs.values()))
                if reason is not None:
                    n.done = True
                    failed.append(n)
                    for v in n.outputs.values():
                        if v.is_pending:
                            fail(v, reason)
                    changed = True
            self._retire(failed)
