"""GlobalScheduler: criteria order, task groups, context-aware placement, capacity, failover."""

from __future__ import annotations

from parrot.serve.contexts import ContextManager
from parrot.serve.scheduler import CompletionTask, EngineView, GlobalScheduler


def make(engines: list[EngineView], cm: ContextManager | None = None, cap: int = 8) -> GlobalScheduler:
    return GlobalScheduler(cm or ContextManager(), lambda: engines, latency_cap=cap)


def task(tokens: list[int], boundaries: list[int] | None = None, **kw) -> CompletionTask:
    return CompletionTask("s", tokens, boundaries or [len(tokens)], **kw)


def test_latency_first_then_app_fifo() -> None:
    s = make([EngineView("e", max_batch=1)])
    a = task([1], criterion="throughput")
    b = task([2], criterion="latency")
    c = task([3], depth=2)
    for t in (a, b, c):
        s.submit(t)
    order = []
    for _ in range(3):
        placed = s.schedule()
        order += placed
        for t in placed:
            s.finished(t)
    assert order == [b, c, a]


def test_placement_follows_the_longest_cached_prefix() -> None:
    cm = ContextManager()
    cm.register("e2", "sys", [1, 2, 3], None, None)
    s = make([EngineView("e1", 8), EngineView("e2", 8)], cm)
    t = task([1, 2, 3, 4], [3, 4])
    s.submit(t)
    assert s.schedule() == [t] and t.engine == "e2"


def test_tasks_sharing_a_prefix_land_together_and_others_spread() -> None:
    s = make([EngineView("e1", 8), EngineView("e2", 8)])
    shared = [task([9, 9, 9, k], [3, 4]) for k in range(3)]
    other = task([5, 6], [2])
    for t in [*shared, other]:
        s.submit(t)
    s.schedule()
    assert len({t.engine for t in shared}) == 1
    assert other.engine != shared[0].engine  # least loaded


def test_capacity_and_latency_cap() -> None:
    s = make([EngineView("e", 16)], cap=2)
    lat = [task([i], criterion="latency") for i in range(4)]
    for t in lat:
        s.submit(t)
    assert len(s.schedule()) == 2  # latency work keeps the engine's batch small
    # a latency task is admitted next to throughput work; throughput work is held to the cap meanwhile
    mixed = make([EngineView("e", 16)], cap=3)
    for i in range(3):
        mixed.submit(task([i]))
    assert len(mixed.schedule()) == 3
    chat = task([9], criterion="latency")
    mixed.submit(chat)
    mixed.submit(more := task([10]))
    assert mixed.schedule() == [chat] and mixed.queue == [more]
    thr = make([EngineView("e", 3)])
    for i in range(5):
        thr.submit(task([i]))
    assert len(thr.schedule()) == 3
    assert len(thr.queue) == 2
    # a latency task is placed on an engine whose batch throughput work fills (the engine makes room for it:
    # priority preemption), up to the latency cap or the batch size
    full = make([EngineView("e", 3)], cap=2)
    for i in range(3):
        full.submit(task([i]))
    assert len(full.schedule()) == 3
    chats = [task([9, i], criterion="latency") for i in range(4)]
    for t in chats:
        full.submit(t)
    assert full.schedule() == chats[:2] and full.queue == chats[2:]
    # ... but an engine with room comes first, even where the full one holds the task's prefix
    cm = ContextManager()
    cm.register("busy", "sys", [1, 2, 3], None, None)
    two = make([EngineView("busy", 2), EngineView("idle", 2)], cm)
    batch = [task([1, 2, 3, 9, i], [3, 5]) for i in range(2)]
    for t in batch:
        two.submit(t)
    assert two.schedule() == batch and {t.engine for t in batch} == {"busy"}  # where their prefix is: full now
    chat = task([1, 2, 3, 4], [3, 4], criterion="latency")
    two.submit(chat)
    assert two.schedule() == [chat] and chat.engine == "idle"


def test_task_group_dispatched_together() -> None:
    s = make([EngineView("e", 2)])
    lone = task([1])
    g = [task([2 + i], group="reduce-inputs") for i in range(2)]
    s.submit(lone)
    for t in g:
        s.submit(t)
    assert s.schedule() == [lone, g[0]]
    # the group is contiguous in the order, placed where its most urgent member sorts
    ordered = make([EngineView("e", 9)])
    for t in [task([7]), *[task([8 + i], group="G") for i in range(3)], task([20])]:
        ordered.submit(t)
    names = [t.group for t in ordered._ordered()]
    first_g = names.index("G")
    assert names[first_g : first_g + 3] == ["G", "G", "G"]


def test_dead_engine_tasks_are_requeued() -> None:
    engines = [EngineView("e1", 8), EngineView("e2", 8)]
    s = make(engines)
    ts = [task([i]) for i in range(4)]
    for t in ts:
        s.submit(t)
    s.schedule()
    on_e1 = [t for t in ts if t.engine == "e1"]
    assert on_e1
    lost = s.engine_dead("e1")
    assert set(lost) == set(on_e1)
    engines.pop(0)
    again = s.schedule()
    assert set(again) == set(on_e1) and all(t.engine == "e2" for t in again)


def test_baseline_mode_is_fifo_by_load_only() -> None:
    cm = ContextManager()
    cm.register("e2", "sys", [1, 2, 3], None, None)
    s = GlobalScheduler(cm, lambda: [EngineView("e1", 1), EngineView("e2", 1)], app_aware=False)
    first = task([1, 2, 3, 4], [3, 4], criterion="throughput")
    urgent = task([9], criterion="latency", depth=5)
    s.submit(first)
    s.submit(urgent)
    placed = s.schedule()
    assert placed == [first, urgent]  # arrival order, criteria ignored
    assert first.engine == "e1"  # the cached prefix on e2 is not considered; the tie goes to the first engine


def test_apc_baseline_mode_is_fifo_but_follows_cached_prefixes() -> None:
    """`--no-app-awareness` alone (bench system baseline-apc): arrival order, no criteria, depths, groups or
    latency caps, but placement still follows the automatic prefix cache."""
    cm = ContextManager(block=2)
    cm.register("e2", "sys", [1, 2, 3, 4], None, None)
    s = GlobalScheduler(cm, lambda: [EngineView("e1", 4), EngineView("e2", 4)], latency_cap=1, app_aware=False,
                        cache_aware=True)
    first = task([1, 2, 3, 4, 5], criterion="throughput", group="g")
    urgent = [task([9, i], criterion="latency", depth=5) for i in range(3)]
    second = task([7, 7], criterion="throughput", group="g")
    for t in (first, *urgent, second):
        s.submit(t)
    assert s.schedule() == [first, *urgent, second]  # arrival order; 3 latency tasks despite latency_cap=1
    assert first.engine == "e2"  # where its 4-token prefix is cached


def test_shared_boundaries_are_prefixes_another_live_task_has() -> None:
    s = make([EngineView("e", 8)])
    engineer_a = task([1, 2, 3, 4, 5, 6], [2, 4, 6])  # team prompt | design | module a
    engineer_b = task([1, 2, 3, 4, 7, 8], [2, 4, 6])  # same team prompt and design, module b
    alone = task([9, 9, 9], [1, 3])
    for t in (engineer_a, engineer_b, alone):
        s.submit(t)
    assert s.shared_boundaries(engineer_a) == {4}  # 2 is shared by the same task: one fill up to 4
    assert s.shared_boundaries(alone) == set()
    s.schedule()  # running tasks count too
    assert s.shared_boundaries(engineer_b) == {4}
    reviewer = task([1, 2, 5, 5], [2, 4])  # the same team prompt only: the prompts branch at 2
    s.submit(reviewer)
    assert s.shared_boundaries(engineer_b) == {2, 4}
    assert s.shared_boundaries(reviewer) == {2}
    s.finished(engineer_a)
    assert s.shared_boundaries(engineer_b) == {2}
    s.queue.remove(reviewer)
    assert s.shared_boundaries(engineer_b) == set()


def test_common_prefix_counts_tokens_past_the_last_whole_block() -> None:
    s = GlobalScheduler(ContextManager(block=4), lambda: [EngineView("e1", 8)])
    a, b = task([*range(10), 1, 2]), task([*range(10), 1, 3, 3])
    assert s._common_prefix(a, b) == s._common_prefix(b, a) == 11
    assert s._common_prefix(a, task([5, *range(11)])) == 0
    assert s._common_prefix(a, task(list(range(8)))) == 8  # all of the shorter one


def test_shared_blocks_are_the_longest_block_prefix_another_live_task_has() -> None:
    s = GlobalScheduler(ContextManager(block=4), lambda: [EngineView("e1", 8)])
    a = task([*range(14), 1])
    b = task([*range(11), 7, 7])  # shares 11 tokens with a: 2 full blocks
    c = task([50] * 9)
    for t in (a, b, c):
        s.submit(t)
    assert s.shared_blocks(a) == 2 and s.shared_blocks(b) == 2 and s.shared_blocks(c) == 0
    s.queue.remove(b)
    assert s.shared_blocks(a) == 0


def test_placement_sees_cached_prompts_and_planned_blocks_at_any_boundary() -> None:
    """Automatic prefix caching: a cached earlier prompt counts wherever the new task's own boundaries are,
    full blocks of tasks placed in the same round count too, and a full engine loses to one with room."""
    cm = ContextManager(block=4)
    cm.register("e2", "p", list(range(10)), None, None)  # an earlier prompt, cached on e2
    engines = [EngineView("e1", 8), EngineView("e2", 8)]
    s = make(engines, cm)
    t = task([*range(10), 50, 51])  # one boundary only: the end of its prompt
    s.submit(t)
    assert s.schedule() == [t] and t.engine == "e2"
    a, b = task([9] * 12 + [1]), task([9] * 12 + [2])  # nothing cached; they share 3 blocks
    s.running.clear()
    engines[1].queued = 1  # e2 is busier: a goes to e1, and b follows a there
    s.submit(a)
    s.submit(b)
    assert s.schedule() == [a, b] and a.engine == b.engine == "e1"
    s.running.clear()
    engines[1].queued = 0
    for i in range(8):  # e2 is full: its cache does not help
        busy = task([70 + i], engine="e2")
        s.running[busy.task_id] = busy
    u = task([*range(10), 60])
    s.submit(u)
    assert s.schedule() == [u] and u.engine == "e1"


def test_engine_reported_waiting_does_not_hold_tasks_back() -> None:
    """The engine's waiting count (last heartbeat) is the placed tasks' own primitives: capacity counts the
    placed tasks once, so a stale heartbeat never delays dispatch."""
    engines = [EngineView("e", 4, queued=4)]
    s = make(engines)
    first = [task([i]) for i in range(3)]
    for t in first:
        s.submit(t)
    assert s.schedule() == first
    late = [task([10 + i]) for i in range(2)]
    for t in late:
        s.submit(t)
    assert s.schedule() == late[:1]  # one place left of 4, whatever the engine last reported


def drain(s: GlobalScheduler) -> list[CompletionTask]:
    """Every queued task in dispatch order, one engine slot at a time."""
    order: list[CompletionTask] = []
    while s.queue:
        placed = s.schedule()
        order += placed
        for t in placed:
            s.finished(t)
    return order


def test_api_keys_take_turns() -> None:
    """A key that floods the queue does not hold back another key's request: the keys alternate, each
    key's own tasks keep their order."""
    s = make([EngineView("e", max_batch=1)])
    flood = [task([i], client=0) for i in range(6)]
    late = [task([100 + i], client=1) for i in range(2)]
    for t in [*flood, *late]:
        s.submit(t)
    assert drain(s) == [flood[0], late[0], flood[1], late[1], *flood[2:]]


def test_a_key_running_many_tasks_waits_for_the_others() -> None:
    s = make([EngineView("e", max_batch=4)])
    busy = [task([i], client=0) for i in range(4)]
    for t in busy:
        s.submit(t)
    assert s.schedule() == busy  # the engine is full with key 0's work
    more = [task([10 + i], client=0) for i in range(2)]
    other = [task([20 + i], client=1) for i in range(2)]
    for t in [*more, *other]:
        s.submit(t)
    for t in busy[:2]:
        s.finished(t)
    assert s.schedule() == other  # two slots free: key 1 runs nothing yet, so both are its
    assert s.queue == more


def test_latency_work_first_whatever_the_key() -> None:
    s = make([EngineView("e", max_batch=1)])
    batch = [task([i], client=0) for i in range(3)]
    chat = task([50], client=0, criterion="latency")
    other = task([60], client=1)
    for t in [*batch, other, chat]:
        s.submit(t)
    # then key 1's turn: key 0 had the chat
    assert drain(s) == [chat, other, *batch]


def test_a_task_group_stays_together_and_counts_its_size() -> None:
    s = make([EngineView("e", max_batch=4)])
    group = [task([i], client=0, group="map") for i in range(3)]
    after = task([9], client=0)
    other = [task([20 + i], client=1) for i in range(3)]
    for t in [*group, after, *other]:
        s.submit(t)
    first = s.schedule()
    assert first == [*group, other[0]]  # the group takes key 0's first turn, whole
    for t in first:
        s.finished(t)
    # key 0 had three tasks dispatched, key 1 one: key 1's next goes first
    assert s.schedule() == [other[1], after, other[2]]


def test_a_key_that_comes_late_gets_no_credit_for_its_absence() -> None:
    """Turns count from the level of the keys already served: a key that comes after another was served
    alone for a while goes next, then alternates with it; it does not take every slot to catch up."""
    s = make([EngineView("e", max_batch=1)])
    early = [task([i], client=0) for i in range(4)]
    for t in early[:2]:
        s.submit(t)
    assert drain(s) == early[:2]
    for t in early[2:]:
        s.submit(t)
    late = [task([10 + i], client=1) for i in range(2)]
    for t in late:
        s.submit(t)
    assert drain(s) == [late[0], early[2], late[1], early[3]]


def test_one_key_keeps_the_app_order() -> None:
    """With one key (or none) the order is the app-aware one: the turns only interleave several keys."""
    for client in (None, 3):
        s = make([EngineView("e", max_batch=1)])
        a = task([1], client=client)
        b = task([2], criterion="latency", client=client)
        c = task([3], depth=2, client=client)
        for t in (a, b, c):
            s.submit(t)
        assert drain(s) == [b, c, a]


def test_without_fair_share_the_keys_share_one_queue_order() -> None:
    s = GlobalScheduler(ContextManager(), lambda: [EngineView("e", max_batch=1)], fair=False)
    flood = [task([i], client=0) for i in range(3)]
    late = task([9], client=1)
    for t in [*flood, late]:
        s.submit(t)
    assert drain(s) == [*flood, late]


def test_a_chat_of_a_key_below_its_share_goes_to_an_engine_full_of_another_keys_chats() -> None:
    """The engine gives each key its share of a full batch (preempting the key furthest above it:
    `Scheduler._yield_to_fair_share`), so a latency-critical task of a key below its share is sent to a full engine;
    without fair share, or within its share, it waits for a slot."""
    for fair in (True, False):
        s = GlobalScheduler(ContextManager(), lambda: [EngineView("e", max_batch=4)], latency_cap=8, fair=fair)
        flood = [task([i], client=0, criterion="latency") for i in range(6)]
        for t in flood:
            s.submit(t)
        assert s.schedule() == flood[:4]  # the batch is full
        other = [task([10 + i], client=1, criterion="latency") for i in range(3)]
        batch_job = task([20], client=1)
        for t in [*other, batch_job]:
            s.submit(t)
        # a share of 2 of the 4 slots: two of key 1's chats go at once; its batch job waits for its turn
        assert s.schedule() == (other[:2] if fair else [])
