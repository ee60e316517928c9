"""bench/structured_battery.py, the validity battery of structured outputs: at least 50 schemas,
each a valid JSON Schema (the gateway would refuse one that is not), with unique names; regexes
that compile; choices that are non-empty lists of strings."""

import re
import sys
from pathlib import Path

import jsonschema_rs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from structured_battery import CHOICES, REGEXES, SCHEMAS  # noqa: E402


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
