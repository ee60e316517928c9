"""Drive schemathesis from hypothesis directly over every operation of a live gateway's
OpenAPI schema (schemathesis' own pytest plugin does not load under this pytest), both in the
positive (schema-valid) and negative (schema-violating) generation modes."""

from __future__ import annotations

import time

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error


def openai_error_shape(ctx, response, case):
    """Every refusal is {"error": {message, type, param, code}} with a string message (on
    Anthropic's /v1/messages, its own {"type": "error", "error": {type, message}})."""
    if 400 <= response.status_code < 500:
        body = response.json()
        error = body["error"]
        if case.operation.path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(error) == {"type", "message"}, body
        else:
            assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        assert "Traceback" not in error["message"] and ".py" not in error["message"], error
    return None


def pairs_of(base_url: str, operations: tuple[str, ...] = ("POST",)) -> int:
    """How many (operation, generation mode) pairs `fuzz` runs against this server's schema."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    return sum(len(GenerationMode) for op in ops if op.method.upper() in operations)


def examples_for_total(base_url: str, total: int, operations: tuple[str, ...] = ("POST",)) -> int:
    """Examples per pair so that a tier runs `total` cases over every pair together, however many
    endpoints the schema has (a tier sized per pair grew with each new endpoint)."""
    return -(-total // pairs_of(base_url, operations))


def fuzz(base_url: str, examples_per_mode: int, operations: tuple[str, ...] = ("POST",)) -> dict:
    """Run the cases; raise on the first failing check. Returns counts (every status, and the cases
    of each operation and generation mode: a pair that ran nothing must not hide in a total) and
    the time taken."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    statuses: dict[int, int] = {}
    per_pair: dict[str, int] = {}
    started = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() not in operations:
            continue
        for mode in GenerationMode:
            pair = f"{op.method.upper()} {op.path} {mode.value}"
            per_pair[pair] = 0

            @settings(max_examples=examples_per_mode, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call_and_validate(base_url=base_url, timeout=180,
                                                  checks=[not_a_server_error, openai_error_shape])
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                per_pair[pair] += 1

            run()
    return {"cases": sum(statuses.values()), "statuses": statuses, "per_pair": per_pair,
            "seconds": time.monotonic() - started}


def assert_each_pair_ran(result: dict, examples: int) -> None:
    """Every operation and mode ran at least half its examples (hypothesis stops a strategy early
    when it runs out of distinct cases; none of ours comes near that)."""
    assert result["per_pair"] and min(result["per_pair"].values()) >= examples // 2, result["per_pair"]
