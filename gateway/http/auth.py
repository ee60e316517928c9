"""The auth middleware: which key (or status-page session) may call which path."""

from __future__ import annotations

from gateway.errors import AuthenticationError, PermissionDenied
from gateway.http.routes import (
    ADMIN, OPEN, OPERATOR, SIGN_IN, SIGN_OUT, TENANT, TENANT_PAGE, access_of)
from gateway.keys.store import KeyStore

def bearer_token(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = raw.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = headers.get(b"x-api-key")
    return api_key.decode("latin-1") if api_key else None



class AuthMiddleware:
    """Who may call which endpoint, by its access (gateway/http/routes.py; the table is
    gateway/api/routes.py): with keys configured every endpoint but the OPEN ones needs a key;
    ADMIN ones need the admin key, configured keys or not. The matched key is put in
    `scope["state"]["api_key"]`; `scope["state"]["operator"]` is True for whoever may see every
    model on the operator pages (the admin key, a key with the metrics scope, a status-page
    session: keys/sessions.py); another key sees only its own models on /status.json."""

    def __init__(self, app, keys_of, sessions=None, access: dict[str, str] | None = None):
        self.app = app
        self.keys_of = keys_of  # () -> KeyStore; read per request, so a reload takes effect
        self.sessions = sessions  # a sessions.SessionBook: sessions signed out
        self.access = access or {}  # path -> access; an unknown path is CLIENT (ADMIN under /admin/)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        access = access_of(self.access, path)
        if access == OPEN:
            return await self.app(scope, receive, send)
        store: KeyStore = self.keys_of()
        if access != ADMIN and not store.enabled:  # no keys: nothing to read from the headers
            return await self.app(scope, receive, send)
        from gateway.http.asgi import send_error

        headers = dict(scope["headers"])
        token = bearer_token(headers)
        if access == ADMIN:
            if token is None or not store.is_admin(token):
                return await send_error(send, AuthenticationError("The admin key is missing or wrong."))
            return await self.app(scope, receive, send)
        if not store.enabled:
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        operator_page = access in (TENANT, TENANT_PAGE, OPERATOR)
        if token is not None and operator_page and store.is_admin(token):
            state["operator"] = True
            return await self.app(scope, receive, send)
        if token is None:
            return await self._without_key(store, headers, scope, receive, send, access)
        key = store.lookup(token)
        if key is None:
            return await send_error(send, AuthenticationError("Incorrect API key provided."))
        state["api_key"] = key
        state["operator"] = "metrics" in key.scopes and operator_page
        if access == OPERATOR and not state["operator"]:
            return await send_error(send, PermissionDenied(
                f"Key '{key.name}' may not read {path}: it takes the admin key or a key with the metrics scope."))
        return await self.app(scope, receive, send)

    async def _without_key(self, store: KeyStore, headers, scope, receive, send, access: str):
        """No key: a status-page session may read the operator pages; a browser asking for the
        status page gets the sign-in form; anything else is a 401."""
        from gateway.http import login
        from gateway.http.asgi import send_error
        from gateway.keys import sessions

        signed_in = sessions.valid(sessions.cookie_of(headers), store.admin_digest, book=self.sessions)
        if signed_in and access in (TENANT, TENANT_PAGE, OPERATOR, SIGN_OUT):
            scope["state"]["operator"] = True
            return await self.app(scope, receive, send)
        if access == SIGN_IN:
            return await self.app(scope, receive, send)
        if access == TENANT_PAGE and scope["method"] == "GET" and b"text/html" in headers.get(b"accept", b""):
            return await login.page(store)(scope, receive, send)
        return await send_error(send, AuthenticationError("Missing API key."))
