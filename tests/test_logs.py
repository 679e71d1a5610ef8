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
