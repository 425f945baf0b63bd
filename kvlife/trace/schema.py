"""Lifecycle event schema v1: the JSON Schema file and a dependency-free validator.

The schema file ships as package data (``kvlife/trace/schema/*.json``) so that other
tools (DuckDB, pandas, jsonschema) can check event files without importing kvlife.
:func:`validate_event` checks one record against the same rules without needing the
``jsonschema`` package (tests check both agree).
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

from kvlife.core.events import EVENT_SCHEMA_VERSION
from kvlife.trace.errors import TraceError

SCHEMA_FILE = f"lifecycle-event-v{EVENT_SCHEMA_VERSION}.schema.json"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@cache
def event_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the current event version."""
    text = resources.files("kvlife.trace").joinpath("schema", SCHEMA_FILE).read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def validate_event(record: dict[str, Any]) -> None:
    """Raise :class:`TraceError` naming the field if ``record`` breaks schema v1."""
    schema = event_schema()
    props: dict[str, Any] = schema["properties"]
    for name in schema["required"]:
        if name not in record:
            raise TraceError(f"event is missing field {name!r}: {record}")
    for name, value in record.items():
        spec = props.get(name)
        if spec is None:
            raise TraceError(f"event has unknown field {name!r}")
        bad = False
        if "const" in spec:
            bad = value != spec["const"]
        elif "enum" in spec:
            bad = value not in spec["enum"]
        elif spec["type"] == "string":
            bad = not isinstance(value, str) or ("pattern" in spec and _HEX64.match(value) is None)
        elif spec["type"] == "integer":
            bad = isinstance(value, bool) or not isinstance(value, int)
            bad = bad or value < spec.get("minimum", value)
        elif spec["type"] == "number":
            bad = isinstance(value, bool) or not isinstance(value, int | float)
            bad = bad or value < spec.get("minimum", value)
        if bad:
            raise TraceError(f"event field {name!r} has an invalid value {value!r}")
