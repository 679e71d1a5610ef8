"""GraphExecutor's native calls: they run once their inputs are ready and their outputs are needed, then
leave the list `ready()` scans (a long session's finished calls cost nothing per scan), while the history
keeps them for the live view; a failed input fails the calls that read it."""

from __future__ import annotations

from parrot.serve.executor import GraphExecutor, NativeNode
from parrot.serve.transforms import validate_call
from parrot.serve.variables import SemanticVariable


def _native(ex: GraphExecutor, i: int, src: SemanticVariable) -> NativeNode:
    out = SemanticVariable(f"out{i}", f"out{i}", "s")
    node = NativeNode(validate_call("upper", None, ["text"], ["output"]), {"text": src}, {"output": out}, f"r{i}")
    ex.add_native(node)
    return node


def test_run_natives_leave_the_scanned_list_and_stay_in_the_history() -> None:
    ex = GraphExecutor()
    src = SemanticVariable("src", "src", "s")
    nodes = [_native(ex, i, src) for i in range(3)]
    for n in nodes:
        ex.need(n.outputs["output"], "latency")
    assert ex.ready()[1] == []  # the input is not set yet
    src.set("hello")
    _, runnable = ex.ready()
    assert runnable == nodes and all(n.done for n in nodes)
    assert ex.natives == []  # nothing left to scan
    assert ex.native_history == nodes
    assert ex.ready()[1] == []  # never handed out twice


def test_a_failed_input_fails_the_pending_natives_and_retires_them() -> None:
    ex = GraphExecutor()
    src = SemanticVariable("src", "src", "s")
    node = _native(ex, 0, src)
    failed: list[tuple[str, str]] = []
    src.fail("upstream broke")
    ex.fail_downstream(lambda v, why: failed.append((v.id, why)))
    assert failed and failed[0][0] == "out0" and "upstream broke" in failed[0][1]
    assert node.done and ex.natives == [] and ex.native_history == [node]


def test_unneed_undoes_need_one_step() -> None:
    """A reader of a native call's output left: the call is not needed now (it does not run once its input is
    ready) and its input is handed back, to be un-needed in turn; a call with another output still needed
    stays needed."""
    ex = GraphExecutor()
    src = SemanticVariable("src", "src", "s")
    node = _native(ex, 0, src)
    out = node.outputs["output"]
    ex.need(out, "latency")
    assert node.needed
    assert ex.unneed(out, lambda v: False) == [src] and not node.needed
    src.set("hello")
    assert ex.ready()[1] == []  # not needed: not run
    ex.need(out, "latency")  # a reader came back
    assert ex.ready()[1] == [node]

    other = SemanticVariable("other", "other", "s")
    two = NativeNode(validate_call("upper", None, ["text"], ["output"]), {"text": other},
                     {"output": SemanticVariable("a", "a", "s"), "more": SemanticVariable("b", "b", "s")}, "r9")
    ex.add_native(two)
    ex.need(two.outputs["output"], "latency")
    assert ex.unneed(two.outputs["output"], lambda v: v is two.outputs["more"]) == [] and two.needed
