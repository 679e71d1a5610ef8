"""Lone UTF-16 surrogates (a JSON "\\ud800" escape with no partner) read as U+FFFD wherever a body is read
(parrot/frontend/text_body.py), and never made by a native transform: every answer that writes such text
back is a 200 with U+FFFD, not a 500 or a stream cut in the middle. A real uvicorn server on loopback over
the tiny random model; the SDK too."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

import parrot as P
from parrot.engine.engine import LLMEngine
from parrot.frontend.text_body import unicode_only
from tests.conftest import tiny_engine_config, tiny_model
from tests.servers import serving_core

JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    model = tiny_model()
    engine = LLMEngine(model, tiny_engine_config()).start(precompile=False)
    with serving_core(engine, "tiny", model.tokenizer) as (base, _):
        yield base
    engine.shutdown()


def test_unicode_only_replaces_lone_surrogates_everywhere() -> None:
    raw = json.loads('{"a\\ud800": ["x\\udfff", {"k": "\\ud83e\\udd9c\\ud800"}], "n": 1}')
    assert unicode_only(raw) == {"a\ufffd": ["x\ufffd", {"k": "\U0001f99c\ufffd"}], "n": 1}  # pairs are kept


def test_an_echoed_prompt_streamed_or_not(url: str) -> None:
    body = b'{"model": "tiny", "prompt": "hi\\ud800", "echo": true, "max_tokens": 2, "temperature": 0, "logprobs": 1'
    r = httpx.post(f"{url}/v1/completions", content=body + b"}", headers=JSON, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("hi\ufffd")
    with httpx.stream("POST", f"{url}/v1/completions", content=body + b', "stream": true}', headers=JSON,
                      timeout=60) as s:
        events = [line for line in s.iter_raw()]
    text = b"".join(events).decode()
    assert s.status_code == 200 and text.rstrip().endswith("data: [DONE]") and "hi\ufffd" in text


def test_a_response_echoes_its_fields(url: str) -> None:
    body = (b'{"model": "tiny", "input": "x", "instructions": "be \\ud800", "user": "\\udfff", "metadata": '
            b'{"k": "\\ud800"}, "max_output_tokens": 2')
    r = httpx.post(f"{url}/v1/responses", content=body + b"}", headers=JSON, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["instructions"], out["user"], out["metadata"]) == ("be \ufffd", "\ufffd", {"k": "\ufffd"})
    with httpx.stream("POST", f"{url}/v1/responses", content=body + b', "stream": true}', headers=JSON,
                      timeout=60) as s:
        text = b"".join(s.iter_raw()).decode()
    assert s.status_code == 200 and ('"response.completed"' in text or '"response.incomplete"' in text), text


def test_rest_values_and_transform_outputs(url: str) -> None:
    """A variable set with a lone surrogate, and json_field reading "\\ud800" out of JSON text: both hold U+FFFD,
    and the variable, the session and its graph are answered."""
    with httpx.Client(base_url=url, timeout=60) as c:
        s = c.post("/v1/session", json={}).json()
        sid, auth = s["session_id"], {"Authorization": f"Bearer {s['session_token']}"}
        body = json.dumps({"session_id": sid, "name": "v", "content": "a\ud800"})  # (escaped: ASCII JSON)
        var = c.post("/v1/semantic_var", content=body.encode(), headers={**auth, **JSON}).json()["var_id"]
        doc = c.post("/v1/semantic_var", headers=auth, json={"session_id": sid, "name": "doc",
                                                               "content": '{"a": "x\\ud800y"}'}).json()["var_id"]
        made = c.post("/v1/native_call", headers=auth, json={
            "session_id": sid, "transform": "json_field", "params": {"path": "a"},
            "inputs": {"text": {"var_id": doc}}, "outputs": ["output"]})
        assert made.status_code == 201, made.text
        out = next(p["var_id"] for p in made.json()["param_info"] if p["is_output"])
        for var_id, want in ((var, "a\ufffd"), (out, "x\ufffdy")):
            r = c.get(f"/v1/semantic_var/{var_id}", params={"session_id": sid, "timeout": 10}, headers=auth)
            assert r.status_code == 200 and r.json()["content"] == want, r.text
        assert c.get(f"/v1/session/{sid}", headers=auth).status_code == 200
        assert c.get(f"/v1/session/{sid}/graph", headers=auth).status_code == 200


def test_the_sdk_sends_lone_surrogates(url: str) -> None:
    """A file name read with surrogateescape holds lone surrogates: the SDK sends it (as an escape)."""
    with P.VirtualMachine(url) as vm:
        assert vm.transform("upper", text="name\udcff.txt").get() == "NAME\ufffd.TXT"
