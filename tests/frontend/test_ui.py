"""The live web view's JSON (`/v1/session/{id}/graph`, `/v1/sessions`) and the shipped page, on a real
uvicorn server with an embedded engine running a tiny random model."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import httpx
import pytest

from parrot.config import ServeConfig
from parrot.engine.engine import LLMEngine
from parrot.serve.engine_processes import EngineProcesses
from tests.conftest import tiny_engine_config, tiny_model
from tests.servers import free_ports, serving_core

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You summarize text in one line. " * 2
SAMPLING = {"max_tokens": 4, "ignore_eos": True}


API_KEY = "k-admin"


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(tiny_model(), tiny_engine_config()).start(precompile=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serving_core(engine, "tiny", engine.tokenizer, default_max_tokens=8) as (url, core):
        yield url, core


@pytest.fixture(scope="module")
def keyed_server(engine):
    """The same engine behind a server with an API key."""
    config = ServeConfig(model="tiny", default_max_tokens=8, api_key=API_KEY)
    with serving_core(engine, "tiny", engine.tokenizer, config=config) as (url, core):
        yield url, core


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        yield c


def new_session(client: httpx.Client) -> tuple[str, dict]:
    body = client.post("/v1/session", json={}).json()
    return body["session_id"], {"Authorization": f"Bearer {body['session_token']}"}


def call(client: httpx.Client, sid: str, auth: dict, template: str, params: list[dict]) -> dict:
    r = client.post("/v1/semantic_call", headers=auth,
                    json={"session_id": sid, "template": template, "parameters": params})
    assert r.status_code == 201, r.text
    return {p["name"]: p["var_id"] for p in r.json()["param_info"]}


def map_reduce(client: httpx.Client, sid: str, auth: dict, n: int = 3) -> str:
    """n map calls, a native join, one reduce call (nothing runs until the result is read); the result id."""
    maps = [call(client, sid, auth, SYSTEM + "Chunk: {{chunk}}\nSummary: {{s}}",
                 [{"name": "chunk", "is_output": False, "value": f"part {i}: " + "abc " * (i + 1)},
                  {"name": "s", "is_output": True, "sampling_config": SAMPLING}]) for i in range(n)]
    r = client.post("/v1/native_call", headers=auth, json={
        "session_id": sid, "transform": "join", "params": {"sep": "\n"},
        "inputs": {f"part{i}": {"var_id": m["s"]} for i, m in enumerate(maps)}, "outputs": ["output"]})
    assert r.status_code == 201, r.text
    joined = {p["name"]: p["var_id"] for p in r.json()["param_info"]}["output"]
    red = call(client, sid, auth, SYSTEM + "Summaries: {{joined}}\nOverall: {{overall}}",
               [{"name": "joined", "is_output": False, "var_id": joined},
                {"name": "overall", "is_output": True, "sampling_config": SAMPLING}])
    return red["overall"]


def graph(client: httpx.Client, sid: str, auth: dict) -> dict:
    r = client.get(f"/v1/session/{sid}/graph", headers=auth)
    assert r.status_code == 200, r.text
    return r.json()


def test_map_reduce_graph_nodes_edges_states_and_timings(client: httpx.Client) -> None:
    sid, auth = new_session(client)
    overall = map_reduce(client, sid, auth)
    g = graph(client, sid, auth)
    calls = [n for n in g["nodes"] if n["kind"] == "call"]
    app_vars = [n for n in g["nodes"] if n["kind"] == "variable" and not n["constant"]]
    # 3 maps + join + reduce; 3 chunks, 3 summaries, the joined text, the overall summary
    assert len(calls) == 5 and len(app_vars) == 8
    assert all(n["state"] == "waiting" for n in calls)  # lazy: nothing runs before the result is read
    assert [n["detail"] for n in calls if n["label"] == "s"] == ["not requested yet"] * 3
    assert {n["detail"] for n in calls if n["label"] != "s"} == {"waiting for inputs"}
    assert {n["layer"] for n in calls if n["label"] == "s"} == {1}
    assert [n["layer"] for n in calls if n["call_type"] == "native"] == [3]
    assert [n["layer"] for n in calls if n["label"] == "overall"] == [5]
    ids = {n["id"] for n in g["nodes"]}
    assert all(e["from"] in ids and e["to"] in ids for e in g["edges"])
    assert any(e["to"] == f"var:{overall}" for e in g["edges"])

    r = client.get(f"/v1/semantic_var/{overall}", params={"session_id": sid, "criteria": "throughput",
                                                          "timeout": 60}, headers=auth)
    assert r.status_code == 200, r.text
    g = graph(client, sid, auth)
    calls = [n for n in g["nodes"] if n["kind"] == "call"]
    assert g["counts"] == {"calls": 5, "variables": len(g["nodes"]) - 5, "waiting": 0, "running": 0, "done": 5,
                           "failed": 0}
    for n in calls:
        if n["call_type"] == "native":
            continue
        assert n["engine"] == "local"
        t, k = n["timings"], n["tokens"]
        assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["total_s"] and t["tpot_s"] > 0
        assert k["prompt"] == k["cached"] + k["computed"] and k["output"] == 4
    # the system prompt is shared: some map forked its context instead of filling it again
    forked = [n for n in calls if n["tokens"] and n["tokens"]["forked_from"]]
    assert forked and all(n["tokens"]["cached"] >= n["tokens"]["forked_tokens"] > 0 for n in forked)
    # the variables wholly inside the forked context are named (a fork at a block boundary inside the first
    # piece names none: the few tokens to its end went into the call's own fill)
    assert any(n["tokens"]["cached_prefix"] for n in forked)
    shared = [c for c in g["contexts"] if c["forked_by"]]
    assert shared and all(c["owner"] == "global" for c in shared)  # the system prompt's context
    assert {f for c in shared for f in c["forked_by"]} == {n["id"] for n in forked}
    assert any(c["owner"] == "session" for c in g["contexts"]) and 0 < g["prefix_hit_rate"] <= 1
    assert all(v["state"] == "done" for v in g["nodes"] if v["kind"] == "variable")
    assert g["engines"][0]["name"] == "local" and g["engines"][0]["live"]
    assert g["engines"][0]["process"] is None  # an engine inside the server: no process of its own


def test_an_engine_process_shows_its_state(client: httpx.Client, server) -> None:
    """An engine whose process the server started (`--engines N`): the view shows the process's state,
    restarts and last exit code beside the engine."""
    _, core = server
    port = free_ports(1)
    procs = EngineProcesses([("local", port, [sys.executable, "-c", "import time; time.sleep(60)"])],
                            grace_s=5).start()
    core.engine_processes = procs
    try:
        sid, auth = new_session(client)
        engine = graph(client, sid, auth)["engines"][0]
        assert engine["name"] == "local"
        assert engine["process"] == {"port": port, "pid": procs.status()[0]["pid"], "state": "running",
                                     "restarts": 0, "last_exit_code": None}
    finally:
        core.engine_processes = None
        procs.stop()


def test_failed_call_carries_its_error(client: httpx.Client) -> None:
    sid, auth = new_session(client)
    ids = call(client, sid, auth, "x" * 600 + " {{y}}",
               [{"name": "y", "is_output": True, "sampling_config": {"max_tokens": 8}}])  # beyond the context
    dep = call(client, sid, auth, "Then {{y}} and {{z}}", [{"name": "y", "is_output": False, "var_id": ids["y"]},
                                                          {"name": "z", "is_output": True}])
    r = client.get(f"/v1/semantic_var/{dep['z']}", params={"session_id": sid, "timeout": 60}, headers=auth)
    assert r.status_code == 424
    calls = {n["label"]: n for n in graph(client, sid, auth)["nodes"] if n["kind"] == "call"}
    assert calls["y"]["state"] == "failed" and "maximum length" in calls["y"]["error"]
    assert calls["z"]["state"] == "failed" and "input 'y'" in calls["z"]["error"]


def test_graph_is_guarded_like_the_session(client: httpx.Client, server) -> None:
    _, core = server
    sid, auth = new_session(client)
    other, other_auth = new_session(client)
    assert client.get(f"/v1/session/{sid}/graph").status_code == 401
    assert client.get(f"/v1/session/{sid}/graph", headers=other_auth).status_code == 403
    assert client.get("/v1/session/nope/graph", headers=auth).status_code == 404
    # watching does not keep a session alive
    core.sessions[sid].last_access -= 100
    graph(client, sid, auth)
    assert core.sessions[sid].idle_seconds() >= 100
    # no API key on this server: no one sees every session
    assert client.get("/v1/sessions", headers=auth).status_code == 404


def test_the_api_key_opens_every_session(keyed_server) -> None:
    url, _ = keyed_server
    admin = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, timeout=60) as c:
        sid, token = (c.post("/v1/session", json={}, headers=admin).json()[k] for k in ("session_id", "session_token"))
        other = c.post("/v1/session", json={}, headers=admin).json()["session_id"]
        assert c.get(f"/v1/session/{sid}/graph", headers={"Authorization": f"Bearer {token}"}).status_code == 401
        assert c.get("/v1/sessions").status_code == 401
        listed = {s["session_id"] for s in c.get("/v1/sessions", headers=admin).json()["sessions"]}
        assert {sid, other} <= listed
        assert graph(c, other, admin)["session_id"] == other  # the key alone opens any session
        assert graph(c, sid, {**admin, "X-Session-Token": token})["session_id"] == sid
        assert c.get("/ui").status_code == 200 and c.get("/ui/ui.js").status_code == 200  # the page is open


def test_page_and_assets_are_served_without_any_cdn(client: httpx.Client) -> None:
    r = client.get("/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for ref in re.findall(r'(?:src|href)="([^"]+)"', r.text):
        assert ref.startswith("ui/"), ref  # relative to the page: also behind a proxy's prefix (--root-path)
        asset = client.get("/" + ref)
        assert asset.status_code == 200 and asset.text
        text = asset.text.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is a name, not a fetch
        assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert client.get("/ui/../pyproject.toml").status_code == 404
    assert client.get("/ui/nothing.js").status_code == 404


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the package files")
def test_a_built_wheel_ships_the_page(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "parrot"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    files += [str(p.relative_to(ROOT)) for p in (ROOT / "parrot/frontend/static").iterdir()]  # new, maybe untracked
    src = tmp_path / "src"
    for f in set(files):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"parrot/frontend/static/ui.html", "parrot/frontend/static/ui.js",
            "parrot/frontend/static/ui.css"} <= names


# ---- the page in a real headless browser -----------------------------------------------------------
def _chromium() -> str | None:
    return os.environ.get("PARROT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser test: playwright is not installed (pip install playwright)")
    exe = _chromium()
    if exe is None:
        pytest.skip("browser test: no chromium found (apt-get install chromium, or set PARROT_CHROMIUM)")
    with sync_playwright() as p:  # the system's chromium: playwright never downloads a browser here
        try:
            b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        except Exception as exc:  # e.g. a chromium too new or too old for this playwright
            pytest.skip(f"browser test: playwright cannot start {exe}: {str(exc).splitlines()[0]}")
        yield b
        b.close()


def test_the_page_draws_the_app_and_follows_it_live(browser, client: httpx.Client, server) -> None:
    url, core = server
    body = client.post("/v1/session", json={}).json()
    sid, token = body["session_id"], body["session_token"]
    auth = {"Authorization": f"Bearer {token}"}
    overall = map_reduce(client, sid, auth, n=3)
    page = browser.new_page(viewport={"width": 1400, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{url}/ui#session={sid}&token={token}")
        # 5 calls (3 maps, the join, the reduce) and 8 variables (3 chunks, 3 summaries, joined, overall)
        page.wait_for_function("document.querySelectorAll('#graph g.node').length === 13", timeout=15000)
        assert page.locator("#graph g.node.call").count() == 5
        assert page.locator("#graph g.node.variable").count() == 8
        assert page.locator("#graph path.edge").count() == 12
        states = page.locator("#graph g.node.call").evaluate_all("ns => ns.map(n => n.dataset.state)")
        assert states == ["waiting"] * 5  # lazy: nothing was read yet
        # reading the result runs the DAG; the page sees every call reach done
        reader = threading.Thread(target=lambda: client.get(
            f"/v1/semantic_var/{overall}", params={"session_id": sid, "criteria": "throughput", "timeout": 60},
            headers=auth))
        reader.start()
        page.wait_for_function(
            "[...document.querySelectorAll('#graph g.node.call')].every(n => n.dataset.state === 'done')",
            timeout=60000)
        reader.join(60)
        assert "5 done" in page.locator("#counts").inner_text()
        assert "local" in page.locator("#engines").inner_text()
        # an engine whose process the server started shows that process's state
        procs = EngineProcesses([("local", free_ports(1), [sys.executable, "-c", "import time; time.sleep(60)"])],
                                grace_s=5).start()
        core.engine_processes = procs
        try:
            page.wait_for_function("document.getElementById('engines').textContent.includes('running, 0 restart(s)')",
                                   timeout=15000)
        finally:
            core.engine_processes = None
            procs.stop()
        # constant text (the shared system prompt) is drawn on request
        page.locator("#show-constants").check()
        assert page.locator("#graph g.node.variable.constant").count() > 0
        page.locator("#show-constants").uncheck()
        # a failing call shows its error, on the node and in the details
        ids = call(client, sid, auth, "x" * 600 + " {{y}}",
                   [{"name": "y", "is_output": True, "sampling_config": {"max_tokens": 8}}])
        r = client.get(f"/v1/semantic_var/{ids['y']}", params={"session_id": sid, "timeout": 60}, headers=auth)
        assert r.status_code == 424
        failed = page.locator("#graph g.node.call[data-state='failed']")
        failed.wait_for(timeout=15000)
        title = failed.locator("title").text_content()
        assert "maximum length" in title
        shown = failed.locator("text.err").first.text_content().rstrip("…")  # the error's start, on the node
        assert len(shown) > 10 and shown in title
        failed.click()
        assert "maximum length" in page.locator("#details").inner_text()
        if os.environ.get("PARROT_UI_SCREENSHOT"):
            page.screenshot(path=os.environ["PARROT_UI_SCREENSHOT"], full_page=True)
        # the session ends: the page says so and keeps the last picture
        assert client.delete(f"/v1/session/{sid}", headers=auth).status_code == 204
        page.wait_for_function("document.getElementById('status').textContent === 'session ended'",
                               timeout=15000)
        assert page.locator("#graph g.node").count() == 15
    finally:
        page.close()
    assert not errors, errors


def test_the_page_asks_for_the_api_key_of_a_keyed_server(browser, keyed_server) -> None:
    url, _ = keyed_server
    admin = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, timeout=60) as c:
        body = c.post("/v1/session", json={}, headers=admin).json()
        sid, token = body["session_id"], body["session_token"]
        call(c, sid, {**admin, "X-Session-Token": token}, "Say: {{x}}", [{"name": "x", "is_output": True}])
    page = browser.new_page()
    try:
        page.goto(f"{url}/ui#session={sid}&token={token}")  # the link the SDK prints
        page.locator("#key-form").wait_for(timeout=15000)
        assert "API key" in page.locator("#error").inner_text()
        page.locator("#key-form input[name=key]").fill(API_KEY)
        page.locator("#key-form button").click()
        page.wait_for_function("document.querySelectorAll('#graph g.node').length === 2", timeout=15000)
        assert page.locator("#graph g.node.call").get_attribute("data-state") == "waiting"
        page.goto(f"{url}/ui#key={API_KEY}")  # every session
        page.get_by_role("link", name=sid).click()
        page.wait_for_function("document.querySelectorAll('#graph g.node').length === 2", timeout=15000)
    finally:
        page.close()
