"""A routing policy's `policy_options`, checked the same way by every policy that takes them."""

from __future__ import annotations


def check_known(policy: str, options: dict, known: frozenset[str] | set[str]) -> None:
    """Refuse an option the policy does not read, by name: a misspelt weight must not be ignored."""
    unknown = set(options) - set(known)
    if unknown:
        raise ValueError(f"{policy}: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")


def weights(policy: str, options: dict, *names: str) -> tuple[float, ...]:
    """The named weights (1.0 when absent), each a number >= 0."""
    values = tuple(float(options.get(name, 1.0)) for name in names)
    if any(v < 0 for v in values):
        raise ValueError(f"{policy}: {' and '.join(names)} must be >= 0")
    return values
