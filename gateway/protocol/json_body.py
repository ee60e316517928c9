"""Reading a request body as JSON, refusing what a JSON parser accepts but a server should not.

- NaN and Infinity (Python's json accepts them; JSON does not), and numbers that overflow to
  infinity (1e999);
- integers of thousands of digits (Python refuses to convert them; that must be a 400, not a 500);
- nesting deeper than the limit (a deep body costs recursion everywhere it is walked later);
- lone surrogates ("\\ud800"): not Unicode scalar values; a tokenizer or an upstream would choke.

Every refusal is an InvalidRequestError naming the path of the bad value where there is one.
"""

from __future__ import annotations

import json
import math

import orjson

from gateway.config import format_path
from gateway.errors import InvalidRequestError


def parse_body(raw: bytes, max_depth: int):
    try:
        body = orjson.loads(raw)  # fast, and refuses NaN, infinities and lone surrogates itself
    except orjson.JSONDecodeError:
        body = _parse_strictly(raw, max_depth)  # says what is wrong, or takes what orjson cannot
    check_tree(body, max_depth)
    return body


def _parse_strictly(raw: bytes, max_depth: int):
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, our refusals, huge ints
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}.") from None


def check_tree(body, max_depth: int) -> None:
    """Walk the parsed body once (iteratively): depth and string validity."""
    stack = [(body, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= max_depth:
                raise _too_deep(max_depth, path)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, (*path, key)))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        param = format_path(path) or None
        where = f" in '{param}'" if param else ""
        raise InvalidRequestError(f"Invalid Unicode{where}: a lone surrogate is not a character.",
                                  param=param) from None


def _too_deep(max_depth: int, path: tuple = ()) -> InvalidRequestError:
    param = format_path(path) or None
    return InvalidRequestError(f"The request body nests deeper than {max_depth} levels.", param=param)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value
