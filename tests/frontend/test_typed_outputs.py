"""Typed semantic variables: an output's sampling_config constraint through the REST API and the SDK, on a
real uvicorn server with the serve core and an embedded engine running a tiny random model."""

from __future__ import annotations

import re

import httpx
import pytest
from pydantic import BaseModel, Field

import parrot as P
from parrot.engine.engine import LLMEngine
from parrot.errors import InvalidRequestError
from tests.conftest import tiny_engine_config, tiny_model
from tests.servers import serving_core


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def url():
    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    with serving_core(engine, "tiny", tiny_model().tokenizer, default_max_tokens=8) as (base, _):
        yield base
    engine.shutdown()


@pytest.fixture
def vm(url: str):
    with P.VirtualMachine(url, timeout=120) as machine:
        yield machine


@P.semantic_function(template="Where is it? {{text}}\nPoint: {{p}}")
def point(text: P.Input, p: P.Output(max_tokens=40, temperature=1.0, seed=3, schema=Point)): ...


@P.semantic_function(template="Is it? {{q}} {{a}}")
def yes_no(q: P.Input, a: P.Output(max_tokens=4, temperature=1.0, seed=1, choices=["yes", "no"])): ...


@P.semantic_function(template="Code for {{q}}: {{code}}")
def code(q: P.Input, code: P.Output(max_tokens=12, temperature=1.0, seed=2, regex=r"[A-Z]{2}-\d{3}")): ...


@P.semantic_function(template="Say: {{q}} {{said}}")
def said(q: P.Input, said: P.Output(max_tokens=8, grammar='start: "hi" | "bye"')): ...


def test_sdk_typed_outputs(vm: P.VirtualMachine) -> None:
    p = point("the top left corner")
    a = yes_no("raining")
    c = code("Paris")
    s = said("hello")
    x = P.transform("json_field", {"path": "x"}, text=p)  # a field of the typed output, on the server
    got = p.get()
    assert isinstance(got, Point) and Point.model_validate_json(p.text) == got  # .text: the JSON itself
    assert x.get() == str(got.x)
    assert a.get() in ("yes", "no")
    text = c.get()
    assert len(text) == 6 and text[:2].isupper() and text[3:].isdigit()
    assert s.get() in ("hi", "bye")
    types = {v["id"]: v.get("type") for v in vm.inspect()["variables"]}
    assert types[a.id] == {"choice": ["yes", "no"]} and types[c.id] == {"regex": r"[A-Z]{2}-\d{3}"}
    assert types[p.id]["json_schema"]["properties"]["x"]["maximum"] == 9 and types[x.id] is None
    graph = vm._request("GET", f"/v1/session/{vm.session_id}/graph")  # the live view's graph too
    graph_types = {n["var_id"]: n["type"] for n in graph["nodes"] if n["kind"] == "variable"}
    assert graph_types[a.id] == {"choice": ["yes", "no"]}


def test_output_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="one of"):
        P.Output(choices=["a"], regex="a")
    with pytest.raises(TypeError, match="list of strings"):
        P.Output(choices="ab")
    with pytest.raises(TypeError, match="pydantic model"):
        P.Output(schema=int)
    assert P.Output(schema={"type": "integer"}).sampling_config()["json_schema"] == {"type": "integer"}
    # only what the app set goes to the server (whose own defaults apply; one of another version takes it)
    assert P.Output(max_tokens=8, stop="x").sampling_config() == {"max_tokens": 8, "stop": ["x"]}


def test_invalid_constraint_is_a_400_at_the_call(vm: P.VirtualMachine) -> None:
    @P.semantic_function(template="Q: {{q}} A: {{a}}")
    def bad(q: P.Input, a: P.Output(regex="a(b")): ...

    with pytest.raises(InvalidRequestError, match="unclosed group"):
        bad("x")
    assert vm.inspect()["variables"] == []  # nothing was scheduled


def test_typed_output_cut_by_max_tokens_fails_unless_complete(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        body = c.post("/v1/session", json={}).json()
        sid, auth = body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}
        schema = {"type": "object", "properties": {"t": {"type": "string", "minLength": 40}}, "required": ["t"]}
        r = c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": "Text: {{out}}",
            "parameters": [{"name": "out", "is_output": True,
                            "sampling_config": {"max_tokens": 4, "json_schema": schema}}]})
        assert r.status_code == 201, r.text
        var = r.json()["param_info"][0]["var_id"]
        r = c.get(f"/v1/semantic_var/{var}", params={"session_id": sid, "timeout": 60}, headers=auth)
        assert r.status_code == 424 and "did not complete its json_schema within max_tokens=4" in r.json()["detail"]
        # cut by max_tokens where its constraint may end (every run of digits is whole): the variable holds it
        r = c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": "Count to ten: 1 2 3 4 5 6 7 8 9 10. Now a long number: {{out}}",
            "parameters": [{"name": "out", "is_output": True,
                            "sampling_config": {"max_tokens": 3, "regex": "[0-9]+"}}]})
        var = r.json()["param_info"][0]["var_id"]
        r = c.get(f"/v1/semantic_var/{var}", params={"session_id": sid, "timeout": 60}, headers=auth)
        assert r.status_code == 200, r.text
        assert re.fullmatch("[0-9]+", r.json()["content"])
        r = c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": "Text: {{out}}",
            "parameters": [{"name": "out", "is_output": True, "sampling_config": {"grammar": "start: ("}}]})
        assert r.status_code == 400 and "invalid grammar" in r.json()["detail"]


def test_a_variable_given_to_fill_reads_as_typed(vm: P.VirtualMachine) -> None:
    slot = vm.variable("slot")
    made = point("the top left corner", p=slot)
    assert made.id == slot.id and isinstance(slot.get(), Point) and slot.get() == made.get()


def test_a_typed_output_a_stop_string_cut_short_fails(url: str) -> None:
    """A stop string (or stop_token_ids id) ending a typed output before its constraint is complete fails it, as
    max_tokens does: the variable never holds text outside its type."""
    with httpx.Client(base_url=url, timeout=120) as c:
        body = c.post("/v1/session", json={}).json()
        sid, auth = body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}
        r = c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": "Say: {{out}}",
            "parameters": [{"name": "out", "is_output": True,
                            "sampling_config": {"max_tokens": 8, "choice": ["yes please"], "stop": [" "]}}]})
        var = r.json()["param_info"][0]["var_id"]
        r = c.get(f"/v1/semantic_var/{var}", params={"session_id": sid, "timeout": 60}, headers=auth)
    assert r.status_code == 424, r.text
    assert "the stop string ' ' ended the output before it completed its choice" in r.json()["detail"]


@pytest.mark.parametrize(("stop", "status", "content"), [("please", 200, "yes please"), ("ple", 424, None)])
def test_a_stop_string_kept_at_the_end_of_a_whole_typed_output_keeps_it(url: str, stop: str, status: int,
                                                                         content: str | None) -> None:
    """With include_stop_str_in_output, a stop string that ends the typed output where its constraint is complete
    leaves the output whole: the variable holds it. One that ends it sooner fails it, as without."""
    with httpx.Client(base_url=url, timeout=120) as c:
        body = c.post("/v1/session", json={}).json()
        sid, auth = body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}
        r = c.post("/v1/semantic_call", headers=auth, json={
            "session_id": sid, "template": "Say: {{out}}",
            "parameters": [{"name": "out", "is_output": True, "sampling_config": {
                "max_tokens": 16, "choice": ["yes please"], "stop": [stop], "include_stop_str_in_output": True}}]})
        var = r.json()["param_info"][0]["var_id"]
        r = c.get(f"/v1/semantic_var/{var}", params={"session_id": sid, "timeout": 60}, headers=auth)
    assert r.status_code == status, r.text
    if content is not None:
        assert r.json()["content"] == content
    else:
        assert f"the stop string {stop!r} ended the output before it completed its choice" in r.json()["detail"]
