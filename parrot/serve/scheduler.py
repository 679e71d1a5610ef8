"""GlobalScheduler: dispatches ready completion tasks to engines, knowing the app's structure.

Order: latency-critical tasks before throughput tasks, then app-FIFO (requests deeper in an app's DAG,
i.e. activated by earlier work, first), then arrival. A task group (chains feeding one consumer) is
dispatched together. Placement, per task: the live engine holding the longest cached prefix of the
task's tokens (ContextManager: any cached context, at any length, whose tokens begin the prompt),
counting prefixes (semantic boundaries and full blocks) that tasks placed earlier in the same round
will create, so tasks sharing a prefix land together and fill it once; among equals, the least loaded.
An engine's capacity depends on what it runs: latency-critical tasks are admitted while fewer than
`latency_cap` of them run there, whatever throughput work it holds (a chat never waits for a batch
job to finish); throughput tasks fill it to its batch size, but only up to `latency_cap` tasks in all
while it has latency-critical work (short steps for that work). With the tasks of several API keys
waiting, the keys take turns after the latency-critical work: a fair share of the engines (`_fair`).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from parrot.serve.contexts import ContextManager, block_hashes, last_match

Criterion = Literal["latency", "throughput"]
_ids = itertools.count()


@dataclass(eq=False)
class CompletionTask:
    session_id: str
    tokens: list[int]  # the whole prompt (fills) of the completion chain
    boundaries: list[int]  # token offsets where semantic variables end: the shareable prefixes
    criterion: Criterion = "throughput"
    depth: int = 0  # how many producer tasks precede it in its app (app-FIFO)
    group: str | None = None  # task group id
    payload: Any = None  # the executor's own record (chain, variables, sampling)
    task_id: str = field(default_factory=lambda: f"task-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    engine: str | None = None
    salt: str | None = None  # its cache_salt (a digest): it shares cached prefixes only with tasks of the same one
    client: int | None = None  # the API key it came with (its index in ServeConfig.api_keys), if any
    _hashes: tuple[int, list[int]] | None = field(default=None, repr=False)

    def hashes(self, block: int) -> list[int]:
        """block_hashes(tokens, block), computed once."""
        if self._hashes is None or self._hashes[0] != block:
            self._hashes = (block, block_hashes(self.tokens, block))
        return self._hashes[1]

    def sort_key(self) -> tuple:
        return (self.criterion != "latency", -self.depth, self.arrival)


@dataclass
class EngineView:
    """What the scheduler needs to know of a live engine."""

    name: str
    max_batch: int
    queued: int = 0  # work the engine reports waiting (heartbeat)


class GlobalScheduler:
    def __init__(self, contexts: ContextManager, engines: Callable[[], Sequence[EngineView]],
                 latency_cap: int = 16, app_aware: bool = True, cache_aware: bool | None = None,
                 fair: bool = True) -> None:
        """`app_aware=False` is the plain-serving baseline: first come first served, no task groups, no
        latency caps. `cache_aware` (default: `app_aware`): place a task where its longest prefix is
        cached; otherwise by load only. `fair`: several API keys' tasks waiting take turns (`_fair`);
        False: one queue order whatever the key."""
        self.fair = fair
        self.app_aware = app_aware
        self.cache_aware = app_aware if cache_aware is None else cache_aware
        self.contexts = contexts
        self.engines = engines
        self.latency_cap = latency_cap
        self.queue: list[CompletionTask] = []
        self.running: dict[str, CompletionTask] = {}  # task id -> task (dispatched, not finished)
        self.requeued = 0  # tasks re-dispatched after their engine died
        # API key -> tasks dispatched since it last had none queued or running, from the level of the others
        # when it came (`_fair`)
        self._service: Counter[int | None] = Counter()

    def submit(self, task: CompletionTask) -> None:
        self.queue.append(task)

    def load(self, engine: str) -> int:
        return sum(1 for t in self.running.values() if t.engine == engine)

    def _capacity(self, view: EngineView, adding: CompletionTask) -> int:
        """Tasks `view` can take now. Its load is the tasks placed there and not finished: the engine's own
        waiting count (`view.queued`) is those same tasks' primitives, as of its last heartbeat, so counting
        it too would hold tasks back on stale figures until the next dispatch tick."""
        load = self.load(view.name)
        room = view.max_batch - load
        if not self.app_aware:
            return room
        latency_running = sum(1 for t in self.running.values() if t.engine == view.name and t.criterion == "latency")
        if adding.criterion == "latency":  # whatever throughput work it holds: the engine preempts that for it
            return max(min(view.max_batch, self.latency_cap) - latency_running, self._below_share(view, adding))
        if latency_running:
            return min(room, self.latency_cap - load)
        return room

    def _below_share(self, view: EngineView, adding: CompletionTask) -> int:
        """1 where latency-critical `adding`'s API key runs fewer tasks on `view` than its share of the batch (its size
        over the keys with tasks there, and this one) while another key runs more: the engine gives it that share,
        preempting the other key's newest work no more urgent (`Scheduler._yield_to_fair_share`), so it goes to a full
        engine too. Else 0 (throughput work waits for its turn here)."""
        if not self.fair:
            return 0
        per = Counter(t.client for t in self.running.values() if t.engine == view.name)
        per.setdefault(adding.client, 0)
        if len(per) < 2:
            return 0
        share = max(1, view.max_batch // len(per))
        return int(per[adding.client] < share and any(n > share for n in per.values()))

    def schedule(self) -> list[CompletionTask]:
        """Place as many queued tasks as capacity allows; returns them with `engine` set."""
        views = {v.name: v for v in self.engines()}
        if not views or not self.queue:
            return []
        ordered = self._ordered()
        placed: list[CompletionTask] = []
        planned: dict[tuple[str, str | None, tuple[int, ...]], int] = {}  # prefixes this round will create
        # (engine, salt, k, hash of k full blocks) this round fills
        planned_blocks: set[tuple[str, str | None, int, int]] = set()
        block = self.contexts.block
        for task in ordered:
            best, best_key = None, None
            hashes = task.hashes(block) if self.cache_aware else []
            for view in views.values():
                if self._capacity(view, task) <= 0:
                    continue
                cached = 0
                if self.cache_aware:
                    ctx = self.contexts.longest_cached(view.name, task.tokens, hashes, task.salt)
                    cached = ctx.num_tokens if ctx is not None else 0
                    for b in task.boundaries:
                        if b > cached and planned.get((view.name, task.salt, tuple(task.tokens[:b]))):
                            cached = b
                    for k in range(len(hashes) - 1, 0, -1):
                        if k * block <= cached:
                            break
                        if (view.name, task.salt, k, hashes[k]) in planned_blocks:
                            cached = k * block
                            break
                # a latency task may go to a full engine (it preempts throughput work there), but one with room
                # comes first: no work is thrown away for it where another engine can take it as it is
                room = task.criterion != "latency" or self.load(view.name) < view.max_batch
                key = (room, cached, -self.load(view.name) - view.queued)
                if best_key is None or key > best_key:
                    best, best_key = view, key
            if best is None:
                continue  # no engine has room now; it waits for the next round
            task.engine = best.name
            self.running[task.task_id] = task
            self._service[task.client] += 1
            placed.append(task)
            if self.cache_aware:
                for b in task.boundaries:
                    planned[(best.name, task.salt, tuple(task.tokens[:b]))] = 1
                planned_blocks.update((best.name, task.salt, k, hashes[k]) for k in range(1, len(hashes)))
        placed_ids = {t.task_id for t in placed}
        self.queue = [t for t in self.queue if t.task_id not in placed_ids]
        if self._service:  # forget the keys with nothing waiting or running (`_fair`)
            active = {t.client for t in self.queue} | {t.client for t in self.running.values()}
            for client in [c for c in self._service if c not in active]:
                del self._service[client]
        return placed

    def _ordered(self) -> list[CompletionTask]:
        """Queue order with task groups kept together (a group sorts by its most urgent member); with the
        tasks of several API keys waiting, their turns interleaved (`_fair`)."""
        if not self.app_aware:
            return sorted(self.queue, key=lambda t: t.arrival)
        ordered = sorted(self.queue, key=CompletionTask.sort_key)
        groups: dict[str, tuple] = {}
        for t in ordered:
            if t.group is not None:
                groups.setdefault(t.group, t.sort_key())
        ordered.sort(key=lambda t: (groups[t.group] if t.group is not None else t.sort_key(), t.group or "",
                                    t.sort_key()))
        if self.fair and len({t.client for t in ordered}) > 1:
            return self._fair(ordered)
        return ordered

    def _fair(self, ordered: list[CompletionTask]) -> list[CompletionTask]:
        """A fair share of the engines between API keys: latency-critical work still first, then the keys
        take turns. A task's turn is how many tasks of its key run or come before it in `ordered` (each key's
        own order kept), so a key that floods the queue or already runs many tasks waits for the others'
        turns, and a key with one request waiting is served next. A task group takes the turn of its first
        member and stays together; its size counts towards its key's later turns. Between equal turns, the
        key with fewer tasks dispatched goes first (round robin as slots free one at a time), counted since it
        last had nothing waiting or running."""
        running = Counter(t.client for t in self.running.values())
        # a key that comes (back) starts one dispatch behind the least served of the others: it goes next, then
        # takes turns with them (no credit kept for the time it had nothing waiting)
        active = set(running) | {t.client for t in ordered}
        level = min((n - 1 for c, n in self._service.items() if c in active), default=0)
        for client in active - set(self._service):
            self._service[client] = level
        turns = running.copy()
        group_key: dict[str, tuple[bool, int, int]] = {}
        keyed: list[tuple[bool, int, int, int, CompletionTask]] = []
        for i, t in enumerate(ordered):
            if t.group is None or t.group not in group_key:
                key = (t.criterion != "latency", turns[t.client], self._service[t.client])
                if t.group is not None:
                    group_key[t.group] = key
            else:
                key = group_key[t.group]
            turns[t.client] += 1
            keyed.append((*key, i, t))
        keyed.sort(key=lambda k: k[:4])
        return [k[4] for k in keyed]

    def shared_boundaries(self, task: CompletionTask) -> set[int]:
        """The boundaries of `task` worth keeping as contexts of their own: the deepest one up to which another
        queued or running task has the same tokens, and each shallower one that more tasks share (where their
        prompts branch). The boundaries between are filled in one piece with the next kept one: a separate
        fill of a piece no other live task stops at would be an engine step of its own, and a later task
        still forks those tokens from the longer context, block by block."""
        others = [t for t in (*self.queue, *self.running.values()) if t is not task and t.salt == task.salt]
        if not others:
            return set()
        common = [self._common_prefix(task, t) for t in others]
        shared: set[int] = set()
        deeper = 0  # tasks sharing the next kept boundary
        for b in reversed(task.boundaries):
            n = sum(c >= b for c in common)
            if n > deeper:
                shared.add(b)
                deeper = n
        return shared

    def _common_prefix(self, a: CompletionTask, b: CompletionTask) -> int:
        """How many leading tokens `a` and `b` have in common: whole blocks by their chained hashes, then
        token by token."""
        block = self.contexts.block
        ha, hb = a.hashes(block), b.hashes(block)
        n = last_match(0, min(len(ha), len(hb)) - 1, lambda k: ha[k] == hb[k]) * block
        end = min(len(a.tokens), len(b.tokens))
        while n < end and a.tokens[n] == b.tokens[n]:
            n += 1
        return n

    def shared_blocks(self, task: CompletionTask) -> int:
        """How many leading full blocks of `task`'s tokens another queued or running task has too (the
        longest block-aligned prefix worth filling once and keeping as a context of its own)."""
        block = self.contexts.block
        mine = task.hashes(block)
        best = 0
        for t in (*self.queue, *self.running.values()):
            if t is task or t.salt != task.salt or len(t.tokens) < (best + 1) * block:
                continue
            theirs = t.hashes(block)
            top = min(len(mine), len(theirs)) - 1
            if top <= best or mine[best + 1] != theirs[best + 1]:
                continue
            best = last_match(best + 1, top, lambda k, theirs=theirs: mine[k] == theirs[k])
        return best

    def finished(self, task: CompletionTask) -> None:
        self.running.pop(task.task_id, None)

    def engine_dead(self, engine: str) -> list[CompletionTask]:
        """Requeue the dead engine's unfinished tasks (they run again elsewhere); returns them."""
        lost = [t for t in self.running.values() if t.engine == engine]
        self.requeued += len(lost)
        for t in lost:
            del self.running[t.task_id]
            t.engine = None
            self.queue.append(t)
        return lost
