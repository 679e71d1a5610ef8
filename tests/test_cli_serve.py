"""`parrot serve --engines N` starts engine processes with the settings they need: the compilation cache,
the log format and the serve core's API key; `--api-key` / PARROT_API_KEY reach the serve core."""

from __future__ import annotations

import subprocess

import pytest
import uvicorn

from parrot import cli
from parrot.serve import tokenizers


def test_serve_passes_engine_settings_and_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[list[str], dict]] = []
    apps: list[object] = []

    class FakePopen:
        def __init__(self, cmd: list[str], env: dict | None = None, **kw: object) -> None:
            started.append((cmd, env or {}))

        def terminate(self) -> None: ...

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.setattr(tokenizers.TokenizerManager, "get", lambda self, model: None)
    monkeypatch.delenv("PARROT_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve", "--engines", "2", "--compilation-cache-dir", "/tmp/cc",
                                          "--log-format", "json", "--api-key", "k3y", "--max-sessions", "5"])
    assert cli.cmd_serve(args) == 0
    assert len(started) == 2 and len(apps) == 1
    for i, (cmd, env) in enumerate(started):
        assert cmd[cmd.index("--compilation-cache-dir") + 1] == "/tmp/cc"
        assert cmd[cmd.index("--log-format") + 1] == "json"
        assert cmd[cmd.index("--name") + 1] == f"engine-{i}"
        assert env["PARROT_API_KEY"] == "k3y"
    config = cli.serve_config_from_args(args)
    assert config.api_key == "k3y" and config.max_sessions == 5
    monkeypatch.setenv("PARROT_API_KEY", "from-env")
    assert cli.serve_config_from_args(cli.build_parser().parse_args(["serve"])).api_key == "from-env"
