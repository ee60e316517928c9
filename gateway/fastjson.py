"""JSON on the hot path: orjson where it can, the standard library where it cannot.

orjson encodes a stream chunk ~10x and parses ~4x faster than `json`. It refuses what the
standard library takes (lone surrogates, integers over 64 bits, nesting over 1024): those cases
fall back to `json`, so every input has the same meaning and the same errors as before. One
difference remains, on purpose: orjson reads an integer beyond the 64-bit range as a float, which
no field can hold anyway (every numeric parameter is bounded far below; see protocol/completions.py).
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):  # a lone surrogate, an int over 64 bits
        return json.dumps(value, separators=(",", ":")).encode()  # ASCII: "\\ud800" stays an escape


def loads(data: bytes | str) -> Any:
    """Parse; raises ValueError (json.JSONDecodeError) as `json.loads` does."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
