"""Token counts read from an upstream's answer, checked before they are charged anywhere."""

from __future__ import annotations

MAX_COUNT = 2**31 - 1  # more tokens than any request runs


def token_count(fields: dict, name: str) -> int:
    """fields[name] as a token count (absent: 0); ValueError naming it when it is not one."""
    value = fields.get(name)
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ValueError(f"usage.{name} is {value!r}, not a token count")
    return value
