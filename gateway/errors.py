"""Errors with the OpenAI wire shape.

Every refusal the gateway or a backend makes is one of these. Each knows its HTTP status, OpenAI
error `type` and `code`, and renders as `{"error": {"message", "type", "param", "code"}}`.
Backends raise them from `generate` to refuse a request; the gateway turns them into responses.
Messages are for clients: never a traceback, a path or a secret.

`backend_fault` says whether an error raised by a backend means the backend is broken: only those
are charged to its circuit breaker and retried on another deployment. An error the request
caused (bad values found late, by a tokenizer say) goes back to the client as it is.
"""

from __future__ import annotations


class APIError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    backend_fault = True  # raised by a backend: the backend is broken (see the module doc)

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
    backend_fault = False


class RequestFailed(APIError):
    """This request failed alone inside a healthy backend (the engine dropped it and went on):
    not the backend's fault in the breaker's sense, and not worth another deployment's time."""

    status = 500
    type = "server_error"
    code = "request_failed"
    backend_fault = False


class ContextLengthExceeded(InvalidRequestError):
    code = "context_length_exceeded"


class RequestTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    backend_fault = False


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    backend_fault = False

    def __init__(self, message: str = "Missing or invalid API key.", **kw):
        super().__init__(message, **kw)
        self.headers.setdefault("WWW-Authenticate", "Bearer")


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"
    code = "permission_denied"
    backend_fault = False


class NotFoundError(APIError):
    # From a backend a 404 means the deployment names a model its upstream lacks: a fault.
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
    backend_fault = False


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
    backend_fault = False  # load: tried elsewhere, not charged


class BudgetExceeded(_RetryAfterError):
    """A key's or team's budget has no room for the request (gateway.budgets), until Retry-After."""

    status = 429
    type = "insufficient_quota"
    code = "quota_exceeded"
    backend_fault = False


class Overloaded(_RetryAfterError):
    status = 503
    type = "service_unavailable_error"
    code = "server_is_overloaded"
    backend_fault = False  # load: tried elsewhere, not charged


class BackendError(APIError):
    """The backend failed (crashed, dropped the connection, returned garbage)."""

    status = 502
    type = "server_error"
    code = "upstream_error"


class ClientClosedRequest(APIError):
    """The client went away before the answer (nginx's 499). Nobody reads the response; it is
    counted as cancelled, not as a failure of the service."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"
    backend_fault = False


class BackendTimeout(APIError):
    status = 504
    type = "server_error"
    code = "timeout"


LOAD_ERRORS = (Overloaded, RateLimited)


def request_fault(exc: APIError) -> bool:
    """Caused by the request (not a backend fault, not load): no failover, no breaker charge."""
    return not exc.backend_fault and not isinstance(exc, LOAD_ERRORS)
