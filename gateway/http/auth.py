"""The auth middleware: which key (or status-page session) may call which path."""

from __future__ import annotations

from gateway.errors import AuthenticationError, PermissionDenied
from gateway.keys.store import KeyStore

OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/version"})
# The operator's read-only pages: every model's numbers. With keys configured they take the admin
# key, a key with the metrics scope, or a status-page session (keys/sessions.py); another key sees
# only its own models on /status.json and gets no /metrics.
OPERATOR_PATHS = frozenset({"/metrics", "/status", "/status.json"})
LOGIN_PATH, LOGOUT_PATH = "/status/login", "/status/logout"

def bearer_token(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = raw.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = headers.get(b"x-api-key")
    return api_key.decode("latin-1") if api_key else None



class AuthMiddleware:
    """Every route but liveness/readiness needs a key when keys are configured; /admin/* needs
    the admin key. The matched key is put in `scope["state"]["api_key"]`; `scope["state"]
    ["operator"]` is True for whoever may see every model on the operator pages."""

    def __init__(self, app, keys_of, sessions=None):
        self.app = app
        self.keys_of = keys_of  # () -> KeyStore; read per request, so a reload takes effect
        self.sessions = sessions  # a sessions.SessionBook: sessions signed out

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        from gateway.http.asgi import send_error

        store: KeyStore = self.keys_of()
        headers = dict(scope["headers"])
        token = bearer_token(headers)
        path = scope["path"]
        if path.startswith("/admin/"):
            if token is None or not store.is_admin(token):
                return await send_error(send, AuthenticationError("The admin key is missing or wrong."))
            return await self.app(scope, receive, send)
        if not store.enabled:
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        if token is not None and path in OPERATOR_PATHS and store.is_admin(token):
            state["operator"] = True
            return await self.app(scope, receive, send)
        if token is None:
            return await self._without_key(store, headers, scope, receive, send)
        key = store.lookup(token)
        if key is None:
            return await send_error(send, AuthenticationError("Incorrect API key provided."))
        state["api_key"] = key
        state["operator"] = "metrics" in key.scopes and path in OPERATOR_PATHS
        if path == "/metrics" and not state["operator"]:
            return await send_error(send, PermissionDenied(
                f"Key '{key.name}' may not read /metrics: it takes the admin key or a key with the metrics scope."))
        return await self.app(scope, receive, send)

    async def _without_key(self, store: KeyStore, headers, scope, receive, send):
        """No key: a status-page session may read the operator pages; a browser asking for the
        status page gets the sign-in form; anything else is a 401."""
        from gateway.http import login
        from gateway.keys import sessions
        from gateway.http.asgi import send_error

        path = scope["path"]
        signed_in = sessions.valid(sessions.cookie_of(headers), store.admin_digest, book=self.sessions)
        if signed_in and (path in OPERATOR_PATHS or path == LOGOUT_PATH):
            scope["state"]["operator"] = True
            return await self.app(scope, receive, send)
        if path == LOGIN_PATH:
            return await self.app(scope, receive, send)
        if path == "/status" and scope["method"] == "GET" and b"text/html" in headers.get(b"accept", b""):
            return await login.page(store)(scope, receive, send)
        return await send_error(send, AuthenticationError("Missing API key."))
