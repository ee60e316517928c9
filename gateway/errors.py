"""Errors with the OpenAI wire shape.

Every refusal the gateway or a backend makes is one of these. Each knows its HTTP status, OpenAI
error `type` and `code`, and renders as `{"error": {"message", "type", "param", "code"}}`.
Backends raise them from `generate` to refuse a request; the gateway turns them into responses.
Messages are for clients: never a traceback, a path or a secret.
"""

from __future__ import annotations


class APIError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(APIError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


class ContextLengthExceeded(InvalidRequestError):
    code = "context_length_exceeded"


class RequestTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str = "Missing or invalid API key.", **kw):
        super().__init__(message, **kw)
        self.headers.setdefault("WWW-Authenticate", "Bearer")


class NotFoundError(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFoundError):
    code = "model_not_found"

    def __init__(self, model: str, **kw):
        super().__init__(f"The model '{model}' does not exist.", param="model", **kw)


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class _RetryAfterError(APIError):
    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw):
        super().__init__(message, **kw)
        # Whole seconds for Retry-After, and the precise value for clients that read -ms.
        self.headers.setdefault("Retry-After", str(max(1, round(retry_after_s))))
        self.headers.setdefault("retry-after-ms", str(int(retry_after_s * 1000)))


class RateLimited(_RetryAfterError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Overloaded(_RetryAfterError):
    status = 503
    type = "service_unavailable_error"
    code = "server_is_overloaded"


class BackendError(APIError):
    """The backend failed (crashed, dropped the connection, returned garbage)."""

    status = 502
    type = "server_error"
    code = "upstream_error"


class BackendTimeout(APIError):
    status = 504
    type = "server_error"
    code = "timeout"
