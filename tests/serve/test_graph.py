"""The compute graph: chains, edges, readiness, cycle and conflict checks, upstream walks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parrot.errors import ConflictError, InvalidRequestError
from parrot.serve.graph import (
    CompletionChain,
    ComputeGraph,
    ConstantFill,
    PlaceholderFill,
    PlaceholderGen,
    RequestChain,
)
from parrot.serve.variables import SemanticVariable

_ids = itertools.count()


def var(name: str, content: str | None = None) -> SemanticVariable:
    return SemanticVariable(f"v{next(_ids)}-{name}", name, "s1", content)


def const(text: str) -> SemanticVariable:
    return SemanticVariable(f"c{next(_ids)}", "constant", None, text, is_constant=True)


def request(rid: str, reads: list[SemanticVariable], writes: list[SemanticVariable]) -> RequestChain:
    """One chain per output: `const, reads..., gen(write)` for the first, `const, gen` after."""
    nodes = [ConstantFill(const("sys")), *(PlaceholderFill(v) for v in reads)]
    for w in writes:
        nodes += [PlaceholderGen(w, {"max_tokens": 4}), ConstantFill(const("and"))]
    return RequestChain.build(rid, "s1", nodes)


def test_build_splits_and_links():
    sys_, q, a, b = const("sys"), var("q", "hi"), var("a"), var("b")
    nodes = [ConstantFill(sys_), PlaceholderFill(q), PlaceholderGen(a), ConstantFill(const("then")),
             PlaceholderFill(q), PlaceholderGen(b), ConstantFill(const("tail"))]
    rc = RequestChain.build("r1", "s1", nodes)
    c0, c1 = rc.chains
    assert (c0.id, c1.id) == ("r1/0", "r1/1") and c1.prev is c0 and c0.prev is None
    assert c0.input_vars == [sys_, q] and c0.output_var is a and c0.nodes == nodes[:3]
    assert c1.input_vars == [nodes[3].var, q] and c1.output_var is b
    assert c1.dependency_vars == [a, nodes[3].var, q]
    assert c1.prefix_vars == [sys_, q, a, nodes[3].var, q]
    assert rc.output_vars == [a, b]
    assert RequestChain.build("r2", "s1", [ConstantFill(sys_)]).chains == []


def test_insert_edges_and_readiness():
    g = ComputeGraph()
    x, y, z = var("x"), var("y"), var("z")
    ra = request("A", [x], [y])
    rb = request("B", [y], [z])
    g.insert(ra)
    g.insert(rb)
    (a,), (b,) = ra.chains, rb.chains
    assert len(g) == 2 and a in g and b in g
    assert g.producers_of(y) == [a] and g.producers_of(x) == [] and g.consumers_of(y) == [b]
    assert g.consumers_of(x) == [a]
    assert y.producer == "A" and z.producer == "B"
    assert g.ready_chains() == []
    x.set("input")
    assert g.ready_chains() == [a]
    g.mark_started(a)
    assert g.ready_chains() == []
    y.set("generated")
    g.remove(a)
    assert g.ready_chains() == [b] and a not in g
    assert g.producers_of(y) == [] and g.consumers_of(x) == []
    assert x not in g.variables and y in g.variables
    g.remove(a)  # removing twice is harmless
    g.remove(b)
    assert len(g) == 0 and g.variables == []


def test_second_chain_waits_for_first():
    g = ComputeGraph()
    a, b = var("a"), var("b")
    rc = request("R", [], [a, b])
    g.insert(rc)
    c0, c1 = rc.chains
    assert g.ready_chains() == [c0]
    assert g.consumers_of(a) == [c1]
    a.set("first")
    assert g.ready_chains() == [c0, c1]


@pytest.mark.parametrize("case", ["self", "pair", "in_request", "triangle"])
def test_cycles_are_rejected_and_graph_unchanged(case):
    g = ComputeGraph()
    x, y, w = var("x"), var("y"), var("w")
    if case == "self":
        bad = request("A", [x], [x])
    elif case == "pair":
        g.insert(request("A", [x], [y]))
        bad = request("B", [y], [x])
    elif case == "in_request":  # the second chain's output feeds the first chain
        bad = request("A", [y], [x, y])
    else:
        g.insert(request("A", [x], [y]))
        g.insert(request("B", [y], [w]))
        bad = request("C", [w], [x])
    before = g.to_json()
    with pytest.raises(InvalidRequestError, match="cycle"):
        g.insert(bad)
    assert g.to_json() == before
    assert all(c not in g for c in bad.chains)


def test_output_conflicts():
    g = ComputeGraph()
    x, y = var("x"), var("y")
    g.insert(request("A", [x], [y]))
    before = g.to_json()
    with pytest.raises(ConflictError, match="already has a producer"):
        g.insert(request("B", [], [y]))
    with pytest.raises(ConflictError, match="already ready"):
        g.insert(request("C", [], [var("set", "done")]))
    failed = var("f")
    failed.fail("x")
    with pytest.raises(ConflictError, match="already failed"):
        g.insert(request("D", [], [failed]))
    z = var("z")
    with pytest.raises(ConflictError, match="already has a producer"):
        g.insert(request("E", [], [z, z]))
    with pytest.raises(ConflictError, match="already in the graph"):
        g.insert(RequestChain("A", "s1", [CompletionChain([], PlaceholderGen(var("n")), "A", "s1")]))
    assert g.to_json() == before


def test_upstream_chains():
    g = ComputeGraph()
    docs = [var(f"doc{i}", f"text {i}") for i in range(3)]
    sums = [var(f"sum{i}") for i in range(3)]
    final, other = var("final"), var("other")
    maps = [request(f"map{i}", [docs[i]], [sums[i]]) for i in range(3)]
    for r in maps:
        g.insert(r)
    red = request("reduce", sums, [final])
    g.insert(red)
    g.insert(request("unrelated", [], [other]))
    up = g.upstream_chains(final)
    assert up[-1] is red.chains[0]
    assert {c.id for c in up} == {"map0/0", "map1/0", "map2/0", "reduce/0"}
    assert g.upstream_chains(sums[1]) == maps[1].chains
    assert g.upstream_chains(docs[0]) == []
    two = request("two", [final], [var("p"), var("q")])
    g.insert(two)
    assert [c.id for c in g.upstream_chains(two.chains[1].output_var)][-2:] == ["two/0", "two/1"]


def test_to_json():
    g = ComputeGraph()
    x, y = var("x", "in"), var("y")
    rc = request("A", [x], [y])
    g.insert(rc)
    data = g.to_json()
    (chain,) = data["chains"]
    assert chain["id"] == "A/0" and chain["output_var"] == y.id and not chain["started"]
    assert [n["type"] for n in chain["nodes"]] == ["ConstantFill", "PlaceholderFill", "PlaceholderGen"]
    states = {v["id"]: v["state"] for v in data["variables"]}
    assert states[x.id] == "ready" and states[y.id] == "pending"
    assert {"from": x.id, "to": "A/0"} in data["edges"] and {"from": "A/0", "to": y.id} in data["edges"]


def _acyclic(requests: list[tuple[list[int], list[int]]]) -> bool:
    """Independent check on request level: var -> request edges for reads, request -> var for writes,
    plus the in-request order (chain i+1 depends on chain i): a request is acyclic iff no write of it
    is reachable from itself. Kahn's algorithm over a graph of variables and chains."""
    edges: dict[str, set[str]] = {}
    for r, (reads, writes) in enumerate(requests):
        for i, w in enumerate(writes):
            chain = f"r{r}c{i}"
            deps = [f"v{v}" for v in reads] if i == 0 else [f"v{writes[i - 1]}"]
            for d in deps:
                edges.setdefault(d, set()).add(chain)
            edges.setdefault(chain, set()).add(f"v{w}")
    nodes = set(edges) | {n for t in edges.values() for n in t}
    indeg = dict.fromkeys(nodes, 0)
    for targets in edges.values():
        for t in targets:
            indeg[t] += 1
    queue = [n for n, d in indeg.items() if d == 0]
    seen = 0
    while queue:
        n = queue.pop()
        seen += 1
        for t in edges.get(n, ()):
            indeg[t] -= 1
            if indeg[t] == 0:
                queue.append(t)
    return seen == len(nodes)


reqs = st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3),
                          st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True)), max_size=10)


@settings(max_examples=200, deadline=None)
@given(reqs)
def test_random_insertions_never_accept_a_cycle(requests):
    g = ComputeGraph()
    pool = [var(f"x{i}") for i in range(6)]
    accepted: list[tuple[list[int], list[int]]] = []
    produced: set[int] = set()
    for n, (reads, writes) in enumerate(requests):
        before = g.to_json()
        conflict = any(w in produced for w in writes)
        cyclic = not _acyclic([*accepted, (reads, writes)])
        try:
            g.insert(request(f"R{n}", [pool[i] for i in reads], [pool[i] for i in writes]))
        except ConflictError:
            assert conflict
            assert g.to_json() == before
            continue
        except InvalidRequestError:
            assert cyclic and not conflict
            assert g.to_json() == before
            continue
        assert not conflict and not cyclic
        accepted.append((reads, writes))
        produced.update(writes)
    # whatever was accepted runs to completion in topological order
    for v in pool:
        if not g.producers_of(v) and v.is_pending:
            v.set("given")
    done = 0
    while ready := g.ready_chains():
        for chain in ready:
            g.mark_started(chain)
            chain.output_var.set("out")
            g.remove(chain)
            done += 1
    assert len(g) == 0 and done == sum(len(w) for _, w in accepted)
