"""The status page's sign-in: a form that takes the admin key and sets a session cookie.

    GET /status (a browser, keys on, no session) -> 401 with this form
    POST /status/login key=<admin key>           -> 303 to /status, Set-Cookie (keys/sessions.py)
    POST /status/logout                          -> 303 to /status, the cookie cleared
"""

from __future__ import annotations

import html
import logging
from pathlib import Path
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse

from gateway.errors import AuthenticationError, RateLimited, RequestTooLarge
from gateway.keys import sessions
from gateway.state import state_of

log = logging.getLogger("kvgate.auth")

PAGE = Path(__file__).parents[1] / "static" / "login.html"
MAX_FORM_BYTES = 4096
FORM = "application/x-www-form-urlencoded"


def page(store, message: str | None = None) -> HTMLResponse:
    if store.admin_digest is None:
        message = "This gateway has no admin key (auth.admin_key_env): sign-in is off. " \
                  "Read /status.json with a key that has the metrics scope."
    note = f'<p class="error" id="message">{html.escape(message)}</p>' if message else ""
    return HTMLResponse(PAGE.read_text().replace("<!--message-->", note), status_code=401,
                        headers={"cache-control": "no-store"})


async def status_login(request: Request):
    store = state_of(request).keys
    if not request.headers.get("content-type", "").startswith(FORM):
        raise AuthenticationError("Sign in with the form at /status, or send a key as a Bearer token.")
    book: sessions.SessionBook = state_of(request).sessions
    client = request.client.host if request.client else "?"
    wait = book.wait_s(client)
    if wait:
        raise RateLimited(f"Too many wrong keys from this address; try again in {wait:.0f} s.", retry_after_s=wait)
    key = await _form_field(request, "key")
    if not key or not store.is_admin(key):
        # For the operator (repeated failures are someone guessing); never the key itself.
        log.warning("status page: a sign-in with a wrong key from %s", client)
        book.failed(client)
        return page(store, "That is not the admin key.")
    response = RedirectResponse("/status", status_code=303)
    response.headers["set-cookie"] = sessions.set_cookie_header(
        sessions.issue(store.admin_digest), secure=_https(request))
    return response


def _https(request: Request) -> bool:
    """Whether the browser reached us over TLS: our own scheme, which uvicorn takes from
    X-Forwarded-Proto when a proxy in server.trusted_proxies (a TLS-terminating ingress) sent it."""
    return request.url.scheme == "https"


async def status_logout(request: Request):
    state_of(request).sessions.revoke(sessions.cookie_of(dict(request.scope["headers"])))
    response = RedirectResponse("/status", status_code=303)
    response.headers["set-cookie"] = sessions.clear_cookie_header()
    return response


async def _form_field(request: Request, name: str) -> str | None:
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_FORM_BYTES:
            raise RequestTooLarge(f"A sign-in form is at most {MAX_FORM_BYTES} bytes.")
    values = parse_qs(body.decode("utf-8", errors="replace")).get(name)
    return values[0] if values else None
