"""An upstream's refusal as the gateway error that means the same to our client.

| upstream                         | we raise                                          |
|----------------------------------|---------------------------------------------------|
| 400 / 422                        | InvalidRequestError (ContextLengthExceeded when   |
|                                  | the code or message says so), upstream message    |
| 404                              | NotFoundError, upstream message                   |
| 413                              | RequestTooLarge                                   |
| 401 / 403                        | BackendError: our credential, not the client's    |
| 429                              | RateLimited with the upstream's Retry-After       |
| 503                              | Overloaded with the upstream's Retry-After        |
| 504                              | BackendTimeout                                    |
| other >= 500, garbage            | BackendError                                      |

Error bodies come as OpenAI's `{"error": {...}}`, vLLM's older `{"object": "error", ...}` or
FastAPI's `{"detail": ...}`; `code` may be a string or (vLLM) the HTTP status as an int.
"""

from __future__ import annotations

import email.utils
import json
import math
import time

from gateway.errors import (
    APIError,
    BackendError,
    BackendTimeout,
    ContextLengthExceeded,
    InvalidRequestError,
    NotFoundError,
    Overloaded,
    RateLimited,
    RequestTooLarge,
)

MAX_MESSAGE = 1000
CONTEXT_HINTS = ("maximum context length", "context length", "context_length_exceeded")


class Scrubber:
    """Removes a secret from text that came from the upstream (some echo a key back)."""

    def __init__(self, secret: str | None):
        self.secret = secret

    def __call__(self, text: str) -> str:
        if self.secret and self.secret in text:
            text = text.replace(self.secret, "***")
        return text[:MAX_MESSAGE]


def error_fields(body) -> tuple[str | None, str | None, str | None, int | None]:
    """(message, type, string code, int code) from any of the error body shapes."""
    if not isinstance(body, dict):
        return None, None, None, None
    err = body.get("error") if isinstance(body.get("error"), dict) else body
    message = err.get("message")
    if message is None and "detail" in err:
        message = err["detail"] if isinstance(err["detail"], str) else json.dumps(err["detail"])
    code = err.get("code")
    str_code = code if isinstance(code, str) and code else None
    int_code = code if isinstance(code, int) and not isinstance(code, bool) else None
    if str_code and str_code.isdigit():  # "400" sent as a string
        str_code, int_code = None, int(str_code)
    return (str(message) if message is not None else None), err.get("type"), str_code, int_code


def for_status(status: int, body, headers, deployment: str, scrub: Scrubber) -> APIError:
    """The gateway error for an upstream HTTP error response."""
    message, _, code, _ = error_fields(body)
    message = scrub(message or f"The upstream answered HTTP {status}.")
    param = body.get("error", {}).get("param") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    if status in (401, 403):
        return BackendError(f"The backend '{deployment}' rejected the gateway's credentials (HTTP {status}).")
    if status == 429:
        return RateLimited(message, retry_after_s=retry_after_s(headers))
    if status == 503:
        return Overloaded(message, retry_after_s=retry_after_s(headers))
    if status == 504:
        return BackendTimeout(f"The backend '{deployment}' timed out: {message}")
    if status >= 500:
        return BackendError(f"The backend '{deployment}' failed (HTTP {status}): {message}")
    if status == 404:
        return NotFoundError(message, param=param, code=code)
    if status == 413:
        return RequestTooLarge(message, param=param)
    return _invalid(message, param, code)


def for_stream_error(body, deployment: str, scrub: Scrubber) -> APIError:
    """The gateway error for a `data: {"error": ...}` event inside an upstream stream."""
    message, type_, code, int_code = error_fields(body)
    status = int_code if int_code and 400 <= int_code < 600 else _status_of_type(type_)
    if status is None:
        return BackendError(f"The backend '{deployment}' failed: {scrub(message or 'unknown error')}")
    return for_status(status, body, {}, deployment, scrub)


def _status_of_type(type_: str | None) -> int | None:
    return {
        "invalid_request_error": 400,
        "BadRequestError": 400,
        "rate_limit_error": 429,
        "service_unavailable_error": 503,
    }.get(type_ or "")


def _invalid(message: str, param: str | None, code: str | None) -> APIError:
    if code == "context_length_exceeded" or any(h in message.lower() for h in CONTEXT_HINTS):
        return ContextLengthExceeded(message, param=param)
    return InvalidRequestError(message, param=param, code=code)


MAX_RETRY_AFTER_S = 3600.0  # an upstream's wait is passed on at most this long


def retry_after_s(headers, default: float = 1.0) -> float:
    """Seconds to wait, from `retry-after-ms` or `Retry-After` (seconds or an HTTP date), in
    [0, MAX_RETRY_AFTER_S]; inf, nan or garbage from the upstream is the default."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return _bounded(float(ms) / 1000, default)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return default
    try:
        return _bounded(float(value), default)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return default
    return _bounded(when.timestamp() - time.time(), default)


def _bounded(seconds: float, default: float) -> float:
    if not math.isfinite(seconds):
        return default
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)
