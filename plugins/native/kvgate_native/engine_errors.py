"""The engine's refusals (core.interface.EngineError) as the gateway's OpenAI errors.

Whose fault: a request the engine refuses or drops alone is the client's error (4xx, or
`RequestFailed`), never charged to the deployment; only a dead or hung engine is.
"""

from __future__ import annotations

from gateway.errors import APIError, ContextLengthExceeded, InvalidRequestError, Overloaded, RequestFailed
from native_backend.core.interface import EngineError


def api_error(exc: EngineError, param: str | None = None) -> APIError:
    """`param`: the request path the refusal names (an embedding's `input[3]`); by default the
    field the engine's message starts with, and max_tokens for a context-length refusal."""
    if exc.kind == "context_length":
        return ContextLengthExceeded(exc.message, param=param or "max_tokens")
    if exc.kind == "invalid":
        return InvalidRequestError(exc.message, param=param or _named_field(exc.message))
    if exc.kind == "overloaded":
        return Overloaded(exc.message, retry_after_s=2)
    # The engine dropped this request alone and went on: not a fault of the deployment.
    return RequestFailed(f"The engine could not complete this request: {exc.message}")


def _named_field(message: str) -> str | None:
    """The engine's checks say 'field: problem' (a dotted path for a constraint's parameter,
    e.g. 'response_format.json_schema.schema')."""
    head, sep, _ = message.partition(":")
    return head if sep and head and all(part.isidentifier() for part in head.split(".")) else None
