"""Structured logs: one JSON object per line with the standard and extra fields."""

from __future__ import annotations

import json
import logging

from parrot.logs import JsonFormatter


def test_json_formatter_emits_one_object_with_extras() -> None:
    record = logging.LogRecord("parrot.serve.core", logging.WARNING, __file__, 1, "engine %s died", ("e1",), None)
    record.engine = "e1"
    out = json.loads(JsonFormatter().format(record))
    assert out["level"] == "warning" and out["logger"] == "parrot.serve.core"
    assert out["msg"] == "engine e1 died" and out["engine"] == "e1"
    assert out["ts"].endswith("Z")


def test_configured_logs_follow_the_current_stderr(monkeypatch) -> None:  # noqa: ANN001
    """A stderr replaced (and closed) after `configure` is not written to: records go to the current one."""
    import io
    import sys

    from parrot.logs import configure

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        configure("text", logging.WARNING)
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("parrot.test").warning("after the swap")
        out = second.getvalue()
        assert "Logging error" not in out and out.rstrip().endswith("WARNING parrot.test: after the swap")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
