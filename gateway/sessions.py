"""Status-page sessions: a browser signs in once with the admin key and gets a cookie.

The cookie carries no key: `<expiry>.<HMAC-SHA256 of the expiry>`, keyed by the digest of the
admin key, so every replica that shares the admin key accepts it, nothing is stored, and
changing the admin key ends every session. It is HttpOnly (no script reads it) and
SameSite=Strict (no other site's page sends it), and it opens only the read-only operator pages.
"""

from __future__ import annotations

import hashlib
import hmac
import time

COOKIE = "kvgate_session"
TTL_S = 12 * 3600


def issue(secret: bytes, now: float | None = None) -> str:
    expiry = str(int((time.time() if now is None else now) + TTL_S))
    return f"{expiry}.{_mac(secret, expiry)}"


def valid(cookie: str | None, secret: bytes | None, now: float | None = None) -> bool:
    if not cookie or secret is None:
        return False
    expiry, _, mac = cookie.partition(".")
    if not expiry.isdigit() or int(expiry) < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac, _mac(secret, expiry))


def set_cookie_header(value: str, secure: bool) -> str:
    attributes = f"{COOKIE}={value}; Path=/; Max-Age={TTL_S}; HttpOnly; SameSite=Strict"
    return attributes + ("; Secure" if secure else "")


def clear_cookie_header() -> str:
    return f"{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict"


def cookie_of(headers: dict[bytes, bytes]) -> str | None:
    for part in headers.get(b"cookie", b"").decode("latin-1").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


def _mac(secret: bytes, expiry: str) -> str:
    return hmac.new(secret, b"kvgate-status-session:" + expiry.encode(), hashlib.sha256).hexdigest()
