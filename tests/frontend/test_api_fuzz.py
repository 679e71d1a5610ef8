"""API fuzz driven by the server's own OpenAPI schema: for every documented operation, hypothesis draws
path and query parameters and JSON bodies from the schema (valid shapes, wrong types, missing and extra
fields, random JSON) and sends them to a real server, with and without a session's credentials. No answer
may be a 5xx, and every error body carries a message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parrot.engine.engine import LLMEngine
from tests.conftest import tiny_engine_config, tiny_model
from tests.servers import serving_core

_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**10) | st.floats(allow_nan=False)
                     | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
_SPECIAL = st.sampled_from(["", "{{", "}}", "{{a}}", "{{a}} {{b}}", "{{a", "x" * 300, "\x00", "é🦜", "var-x"])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, dict, list[tuple[str, str, dict]]]]:
    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    with serving_core(engine, "tiny", model.tokenizer, default_max_tokens=4) as (url, core):
        schema = httpx.get(f"{url}/openapi.json").json()
        ops = [(path, method, op) for path, item in schema["paths"].items() for method, op in item.items()
               if not path.startswith("/v1/engine")]  # engine registration: covered in tests/serve/test_engines.py
        yield url, schema, ops
    engine.shutdown()


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(schema: dict, root: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of a JSON schema (the subset FastAPI emits), sometimes off the schema on purpose."""
    schema = _resolve(schema, root)
    if depth > 4:
        return _json
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root, depth + 1) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fixed = {k: from_schema(v, root, depth + 1) for k, v in props.items() if k in required}
        optional = {k: from_schema(v, root, depth + 1) for k, v in props.items() if k not in required}
        values = st.fixed_dictionaries(fixed, optional=optional)
        if not props:
            return st.dictionaries(st.text(max_size=6), _json, max_size=3)
        return values
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), root, depth + 1), max_size=4)
    if kind == "string":
        return st.text(max_size=20) | _SPECIAL
    if kind == "integer":
        lo, hi = schema.get("minimum", -5), schema.get("maximum", 10**6)
        return st.integers(lo - 1, hi + 1)
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False, min_value=-10, max_value=10**4)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return _json


def _body(op: dict, root: dict) -> st.SearchStrategy:
    content = op.get("requestBody", {}).get("content", {}).get("application/json")
    if content is None:
        return st.none()
    good = from_schema(content["schema"], root)
    mutated = good.flatmap(lambda b: st.dictionaries(st.text(max_size=6), _json, max_size=2).map(
        lambda extra: {**b, **extra} if isinstance(b, dict) else extra))
    return st.one_of(good, good, mutated, _json)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_no_operation_answers_5xx(server: tuple[str, dict, list], data: st.DataObject) -> None:
    url, root, ops = server
    path, method, op = data.draw(st.sampled_from(ops), label="operation")
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/session", json={})
        sid, token = r.json()["session_id"], r.json()["session_token"]
        params: dict[str, Any] = {}
        concrete = path
        for p in op.get("parameters", []):
            where, name = p["in"], p["name"]
            if where == "path":
                value = data.draw(st.just(sid) | st.text(min_size=1, max_size=12).filter(lambda s: "/" not in s)
                                  | _SPECIAL.filter(lambda s: s and "/" not in s), label=name)
                concrete = concrete.replace("{" + name + "}", quote(str(value), safe=""))
            elif where == "query" and name != "timeout" and data.draw(st.booleans(), label=f"has {name}"):
                value = data.draw(st.just(sid) if name == "session_id" else from_schema(p.get("schema", {}), root),
                                  label=name)
                params[name] = value if isinstance(value, str | int | float) else json.dumps(value)
        params.setdefault("timeout", 1) if any(p["name"] == "timeout" for p in op.get("parameters", [])) else None
        body = data.draw(_body(op, root), label="body")
        if isinstance(body, dict) and "session_id" in body and data.draw(st.booleans(), label="own session"):
            body["session_id"] = sid
        auth = data.draw(st.sampled_from([{}, {"Authorization": f"Bearer {token}"}, {"Authorization": "Bearer x"},
                                          {"Authorization": "garbage"}, {"X-Session-Token": token}]), label="auth")
        kw: dict[str, Any] = {"headers": auth, "params": params}
        if body is not None:
            kw["content"] = json.dumps(body)
            kw["headers"] = {**auth, "content-type": "application/json"}
        if concrete.endswith("/stream"):
            with c.stream(method.upper(), concrete, **kw) as resp:
                status = resp.status_code
                for line in resp.iter_lines():
                    assert not line.startswith("event: error") or "code" in line, line
                    if line.startswith("data: [DONE]") or line.startswith("event: error"):
                        break
                text = ""
        else:
            resp = c.request(method.upper(), concrete, **kw)
            status, text = resp.status_code, resp.text
        assert status < 500, (method, concrete, body, status, text)
        if status >= 400 and text:
            err = resp.json()
            assert err.get("detail") or err.get("error", {}).get("message"), err
        c.delete(f"/v1/session/{sid}", headers={"Authorization": f"Bearer {token}"})
