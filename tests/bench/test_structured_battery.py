"""bench/structured_battery.py, the validity battery of structured outputs: at least 50 schemas,
each a valid JSON Schema (the gateway would refuse one that is not), with unique names; regexes
that compile; choices that are non-empty lists of strings; tools whose parameters are object
schemas, and tool cases that name one of them. (The battery itself runs in bench/structured_validity.py.)"""

import re
import sys
from pathlib import Path

import jsonschema_rs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from structured_battery import CHOICES, REGEXES, SCHEMAS, TOOL_CASES, TOOLS  # noqa: E402


def test_the_battery_holds_fifty_valid_schemas():
    assert len(SCHEMAS) >= 50
    names = [name for name, _, _ in SCHEMAS]
    assert len(set(names)) == len(names)
    for _, schema, request in SCHEMAS:
        jsonschema_rs.meta.validate(schema)
        assert request.strip()


def test_regexes_and_choices_are_well_formed():
    for _, pattern, _ in REGEXES:
        re.compile(pattern)
    for _, choices, _ in CHOICES:
        assert choices and all(isinstance(c, str) and c for c in choices)


def test_the_tool_battery_offers_valid_object_schemas_and_names_its_tools():
    names = [t["function"]["name"] for t in TOOLS]
    assert len(set(names)) == len(names)
    for t in TOOLS:
        parameters = t["function"].get("parameters")
        if parameters is not None:  # absent: no arguments, as OpenAI allows
            jsonschema_rs.meta.validate(parameters)
            assert parameters["type"] == "object"
    assert {fits for _, fits, _ in TOOL_CASES} <= set(names)
    assert len({case for case, _, _ in TOOL_CASES}) == len(TOOL_CASES)
