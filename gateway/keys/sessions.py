"""Status-page sessions: a browser signs in once with the admin key and gets a cookie.

The cookie carries no key: `<expiry>.<nonce>.<HMAC-SHA256 of both>`, keyed by the digest of the
admin key, so every replica that shares the admin key accepts it, nothing is stored, and
changing the admin key ends every session. It is HttpOnly (no script reads it) and
SameSite=Strict (no other site's page sends it), and it opens only the read-only operator pages.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

COOKIE = "kvgate_session"
TTL_S = 12 * 3600


MAX_REVOKED = 10_000  # sessions signed out and not yet expired that one process remembers
MAX_CLIENTS = 10_000  # addresses the sign-in throttle remembers; past it the longest quiet one is forgotten
MAX_FAILURES = 5  # wrong keys per client per minute at the sign-in form; then it waits
FAILURE_WINDOW_S = 60.0


class SessionBook:
    """What one gateway process remembers about sign-ins: sessions signed out before they
    expired, and recent wrong keys per client address (a guesser is slowed, not served)."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self.revoked: dict[str, int] = {}  # "<expiry>.<nonce>" -> expiry
        self.failures: dict[str, list[float]] = {}  # client address -> times of wrong keys (< MAX_FAILURES)
        self.throttled: dict[str, list[float]] = {}  # the same for addresses that must wait

    def wait_s(self, client: str) -> float:
        """Seconds `client` must wait before it may try a key again (0: it may now)."""
        recent = self._recent(client)
        if recent:
            self._book(client, recent)
        return FAILURE_WINDOW_S - (self.clock() - recent[0]) if len(recent) >= MAX_FAILURES else 0.0

    def failed(self, client: str) -> None:
        self._book(client, self._recent(client) + [self.clock()])

    def _recent(self, client: str) -> list[float]:
        now = self.clock()
        times = self.throttled.pop(client, None) or self.failures.pop(client, [])
        return [t for t in times if now - t < FAILURE_WINDOW_S]

    def _book(self, client: str, times: list[float]) -> None:
        """File `client` as the newest entry of its book. Each book is ordered by latest entry and
        bounded by forgetting its oldest; addresses being throttled have their own book, so a
        flood of one-try addresses (clearing everything once let a guesser with 10,000 spare
        addresses reset its own count) forgets only other one-try addresses."""
        book = self.throttled if len(times) >= MAX_FAILURES else self.failures
        while len(book) >= MAX_CLIENTS:
            del book[next(iter(book))]
        book[client] = times

    def revoke(self, cookie: str | None) -> None:
        """Sign a session out: this process refuses its cookie from now on (until it would have
        expired anyway). Other replicas refuse it only at its expiry (docs/security.md)."""
        session = _session(cookie)
        if session is None:
            return
        now = self.clock()
        for old in [s for s, until in self.revoked.items() if until < now]:
            del self.revoked[old]
        if len(self.revoked) < MAX_REVOKED:
            self.revoked[session] = int(session.partition(".")[0])


def issue(secret: bytes, now: float | None = None) -> str:
    expiry = str(int((time.time() if now is None else now) + TTL_S))
    session = f"{expiry}.{secrets.token_hex(8)}"  # the nonce tells one session from another, for sign-out
    return f"{session}.{_mac(secret, session)}"


def valid(cookie: str | None, secret: bytes | None, now: float | None = None,
          book: SessionBook | None = None) -> bool:
    """A cookie this gateway issued, not expired and not signed out. Anything else, however
    malformed (non-ASCII digits, thousands of them), is simply not valid."""
    session = _session(cookie)
    if session is None or secret is None or (book is not None and session in book.revoked):
        return False
    if int(session.partition(".")[0]) < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(cookie.rpartition(".")[2], _mac(secret, session))


def _session(cookie: str | None) -> str | None:
    """"<expiry>.<nonce>" of a well-formed cookie, else None."""
    if not cookie or len(cookie) > 128 or not cookie.isascii():
        return None
    session = cookie.rpartition(".")[0]
    expiry, _, nonce = session.partition(".")
    if not (expiry.isdigit() and len(expiry) <= 12 and nonce):
        return None
    return session


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


def _mac(secret: bytes, session: str) -> str:
    return hmac.new(secret, b"kvgate-status-session:" + session.encode(), hashlib.sha256).hexdigest()
