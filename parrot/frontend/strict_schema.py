"""Strict JSON schemas: no object takes keys its schema does not list.

OpenAI's strict structured outputs mean this, and vLLM's default matcher treats schemas so; llguidance
follows JSON Schema, where an object without `additionalProperties` takes any other key too. Applied to
`response_format` json_schema with `strict: true`, to the parameters of constrained tool calls and to the
SDK's `P.Output(schema=PydanticModel)`. No dependencies beyond the stdlib (the SDK uses it).
"""

from __future__ import annotations

from typing import Any

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_KEEP = ("enum", "const", "default", "examples", "required")  # values, not schemas


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: no object takes properties its schema does not list. Objects that do not say
    otherwise get `additionalProperties: false`, through every subschema."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in _KEEP:
            out[key] = value
        else:
            out[key] = strict_schema(value)
    if ("properties" in schema or schema.get("type") == "object") and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
