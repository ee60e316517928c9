"""API keys and per-key limits.

Keys come from the config (`key_env` names an environment variable; `key` is for files kept out
of version control) and from an optional keys file named by an environment variable. Only
SHA-256 digests are kept; a presented key is hashed and compared with every stored digest in
constant time, without stopping at a match. Keys are never logged: logs and metrics use names.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import deque
from dataclasses import dataclass, field

import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.config import ApiKeyConfig, AuthConfig, GatewayConfig, check_key_classes, format_path
from gateway.errors import AuthenticationError, InvalidRequestError, PermissionDenied, RateLimited

OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/version"})
# The operator's read-only pages: every model's numbers. With keys configured they take the admin
# key, a key with the metrics scope, or a status-page session (sessions.py); another key sees
# only its own models on /status.json and gets no /metrics.
OPERATOR_PATHS = frozenset({"/metrics", "/status", "/status.json"})
LOGIN_PATH, LOGOUT_PATH = "/status/login", "/status/logout"
MIN_ADMIN_KEY = 16  # characters: the admin key can be guessed at the sign-in form


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)
    models: frozenset[str] | None  # None: every model
    sla_class: str | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrency: int | None
    sla_classes: frozenset[str] | None = None  # classes it may ask for; None: every class
    scopes: frozenset[str] = frozenset()  # "metrics": reads the operator pages for every model

    def may_use(self, model_names: list[str]) -> bool:
        return self.models is None or any(n in self.models for n in model_names)

    def check_sla_class(self, name: str, header: str) -> None:
        """A class above the key's allowance is refused (403 naming the header), not lowered:
        a client that asked for a class learns that it does not get it."""
        if self.sla_classes is not None and name not in self.sla_classes:
            allowed = ", ".join(sorted(self.sla_classes))
            raise PermissionDenied(f"Key '{self.name}' may not use SLA class '{name}' (allowed: {allowed}).",
                                   param=header, code="sla_class_not_allowed")


class KeyStore:
    def __init__(self, keys: list[ApiKey], admin_digest: bytes | None):
        self.keys = keys
        self.admin_digest = admin_digest

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @classmethod
    def of(cls, config: GatewayConfig, problems: list[str] | None = None) -> "KeyStore":
        """The keys of a whole config: those of the keys file are checked against its SLA classes
        too (the config's own keys were, when it was parsed). `problems`: see from_config."""
        return cls.from_config(config.auth, sla=({c.name for c in config.sla_classes}, config.default_sla_class),
                               problems=problems)

    @classmethod
    def from_config(cls, auth: AuthConfig, env: dict[str, str] | None = None,
                    sla: tuple[set[str], str] | None = None, problems: list[str] | None = None) -> "KeyStore":
        """Resolve every secret now, so a missing variable fails the config, not a request.

        With `problems` (a list), a bad entry of the keys file is left out and described there
        instead of refusing every key: a reload then still applies what is valid (a revoked key
        goes), and a broken entry is no key until it is fixed."""
        env = os.environ if env is None else env
        default_class = sla[1] if sla else GatewayConfig.model_fields["default_sla_class"].default
        keys = [_resolve(f"auth.keys[{i}]", k, env, default_class) for i, k in enumerate(auth.keys)]
        if auth.keys_file_env:
            for where, entry in _keys_file_entries(auth.keys_file_env, env, problems):
                try:
                    k = entry if isinstance(entry, ApiKeyConfig) else _entry(where, entry)
                    if sla:
                        check_key_classes(where, k, *sla)
                    key = _resolve(where, k, env, default_class)
                    if key.name in {k.name for k in keys}:
                        raise ValueError(f"{where}: another key is named '{key.name}'")
                except ValueError as exc:
                    if problems is None:
                        raise
                    problems.append(str(exc))
                    continue
                keys.append(key)
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError("auth.keys: two keys share a name")
        admin = _env_secret("auth.admin_key_env", auth.admin_key_env, env) if auth.admin_key_env else None
        if admin is not None and len(admin) < MIN_ADMIN_KEY:
            raise ValueError(f"auth.admin_key_env: the admin key is shorter than {MIN_ADMIN_KEY} characters "
                             "(it signs the status page's sessions; e.g. `openssl rand -hex 24`)")
        return cls(keys, _digest(admin) if admin else None)

    def lookup(self, presented: str) -> ApiKey | None:
        digest = _digest(presented)
        found = None
        for key in self.keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def is_admin(self, presented: str) -> bool:
        return self.admin_digest is not None and hmac.compare_digest(_digest(presented), self.admin_digest)


def keys_file_path(env_name: str, env=None) -> str:
    return _env_secret("auth.keys_file_env", env_name, os.environ if env is None else env)


def _keys_file_entries(env_name: str, env, problems: list[str] | None = None) -> list[tuple[str, object]]:
    """(where, entry) of each key in the file: validated ApiKeyConfigs when `problems` is None
    (one bad entry raises), else the raw entries, each validated by the caller on its own."""
    path = keys_file_path(env_name, env)
    try:
        data = yaml.safe_load(open(path).read())
    except OSError as exc:
        raise ValueError(f"auth.keys_file_env: cannot read the keys file named by {env_name}: {exc.strerror}") from None
    except yaml.YAMLError:
        raise ValueError(f"auth.keys_file_env: the keys file named by {env_name} is not valid YAML") from None
    if problems is not None:
        if not isinstance(data, list):
            raise ValueError(f"keys file [{env_name}]: not a list of keys")
        return [(f"keys file [{env_name}][{i}]", entry) for i, entry in enumerate(data)]
    try:
        parsed = TypeAdapter(list[ApiKeyConfig]).validate_python(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(f"keys file [{env_name}]{format_path(err['loc'])}: {err['msg']}") from None
    return [(f"keys file [{env_name}][{i}]", k) for i, k in enumerate(parsed)]


def _entry(where: str, raw) -> ApiKeyConfig:
    try:
        return ApiKeyConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = format_path(err["loc"])
        raise ValueError(f"{where}{'.' + path if path else ''}: {err['msg'].removeprefix('Value error, ')}") from None


def _resolve(where: str, k: ApiKeyConfig, env, default_class: str) -> ApiKey:
    secret = k.key if k.key is not None else _env_secret(f"{where}.key_env", k.key_env, env)
    if len(secret) < 8:
        raise ValueError(f"{where}: the key is shorter than 8 characters")
    models = None if "*" in k.models else frozenset(k.models)
    # No list: the key's default class alone (opt in to the others), so a key cannot jump the
    # queue with x-sla-class unless it was given that class.
    sla_classes = None if "*" in k.sla_classes else frozenset(k.sla_classes or [k.sla_class or default_class])
    return ApiKey(k.name, _digest(secret), models, k.sla_class, k.requests_per_minute,
                  k.tokens_per_minute, k.max_concurrency, sla_classes, frozenset(k.scopes))


def _env_secret(where: str, name: str, env) -> str:
    value = env.get(name)
    if not value:
        raise ValueError(f"{where}: environment variable {name} is not set")
    return value


def bearer_token(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = raw.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = headers.get(b"x-api-key")
    return api_key.decode("latin-1") if api_key else None


class _Window:
    """Events in the last 60 s, each with a weight (1 per request, or a token count)."""

    def __init__(self):
        self.events: deque[list] = deque()  # [time, weight]; a refunded reservation's weight drops
        self.total = 0

    def trim(self, now: float) -> None:
        while self.events and now - self.events[0][0] >= 60.0:
            self.total -= self.events.popleft()[1]

    def add(self, now: float, weight: int) -> list:
        event = [now, weight]
        self.events.append(event)
        self.total += weight
        return event

    def refund(self, event: list, now: float) -> None:
        """Take back an event's weight, unless it has already left the window."""
        self.trim(now)
        if now - event[0] < 60.0:
            self.total -= event[1]
            event[1] = 0

    def seconds_until_below(self, limit: int, now: float) -> float:
        """How long until the total drops under `limit` as old events expire."""
        total = self.total
        for t, w in self.events:
            total -= w
            if total < limit:
                return max(0.0, 60.0 - (now - t))
        return 60.0


def check_weight(key: ApiKey, weight: int) -> None:
    """A request larger than the key's whole minute can never pass: a 400, not a 429."""
    if key.requests_per_minute and weight > key.requests_per_minute:
        raise InvalidRequestError(f"This request has {weight} choices (prompts x n), more than the "
                                  f"{key.requests_per_minute} requests per minute of key '{key.name}'.",
                                  param="n")


class KeyLimiter:
    """Requests/min, tokens/min and concurrency per key name, in sliding 60 s windows.

    Kept across config reloads (state is by key name), so a reload does not reset anyone's budget.
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._requests: dict[str, _Window] = {}
        self._tokens: dict[str, _Window] = {}
        self._in_flight: dict[str, int] = {}
        # Per key, the token reservations of requests in flight, oldest first (a key's requests
        # are interchangeable for counting: finish refunds the oldest).
        self._reserved: dict[str, deque[list]] = {}

    def admit(self, key: ApiKey, weight: int = 1, reserve_tokens: int = 0) -> None:
        """Count a new request of `weight` choices (prompts x n) against `key`, or raise 429 with
        how long to wait. A request larger than the key's whole minute can never pass.
        `reserve_tokens` (the most it can generate) is charged to the key's tokens now, so a burst
        of requests cannot all pass a budget none of them has used yet; `finish` refunds it."""
        now = self.clock()
        check_weight(key, weight)
        self._check(key, weight, now)
        self._requests[key.name].add(now, weight)
        self._in_flight[key.name] = self._in_flight.get(key.name, 0) + 1
        # Admitted while the key is under its minute (one request may end over it), and charged
        # at most the whole minute, so a long max_tokens does not lock the key out for longer.
        reserve_tokens = min(reserve_tokens, key.tokens_per_minute or 0)
        if reserve_tokens:
            self._reserved.setdefault(key.name, deque()).append(self._tokens[key.name].add(now, reserve_tokens))

    def check(self, key: ApiKey) -> None:
        """Raise 429 when `key` is at one of its limits now, counting nothing: the serving path
        asks before it reads and parses a body, so a key at its limit costs no parsing."""
        self._check(key, 1, self.clock())

    async def admissible(self, key: ApiKey) -> None:
        """`check` as the serving path calls it (a shared store answers over the network)."""
        self.check(key)

    def count_refused(self, key: ApiKey) -> None:
        """A request of `key` refused before admission (a 4xx): it still counts as a request."""
        if key.requests_per_minute:
            self._requests.setdefault(key.name, _Window()).add(self.clock(), 1)

    def _check(self, key: ApiKey, weight: int, now: float) -> None:
        requests = self._requests.setdefault(key.name, _Window())
        tokens = self._tokens.setdefault(key.name, _Window())
        requests.trim(now)
        tokens.trim(now)
        if key.requests_per_minute and requests.total + weight > key.requests_per_minute:
            wait = requests.seconds_until_below(key.requests_per_minute - weight + 1, now)
            raise RateLimited(f"Rate limit of {key.requests_per_minute} requests per minute reached for key '{key.name}'.",
                              retry_after_s=wait)
        if key.tokens_per_minute and tokens.total >= key.tokens_per_minute:
            wait = tokens.seconds_until_below(key.tokens_per_minute, now)
            raise RateLimited(f"Rate limit of {key.tokens_per_minute} tokens per minute reached for key '{key.name}'.",
                              retry_after_s=wait)
        in_flight = self._in_flight.get(key.name, 0)
        if key.max_concurrency and in_flight >= key.max_concurrency:
            raise RateLimited(f"Key '{key.name}' already has {in_flight} requests in flight (its limit).",
                              retry_after_s=1)

    async def acquire(self, key: ApiKey, weight: int = 1, reserve_tokens: int = 0) -> None:
        """`admit` as the serving path calls it (a shared store answers over the network)."""
        self.admit(key, weight, reserve_tokens)

    def finish(self, key: ApiKey, tokens: int) -> None:
        self.release(key)
        reserved = self._reserved.get(key.name)
        if reserved:
            self._tokens[key.name].refund(reserved.popleft(), self.clock())
            if not reserved:
                del self._reserved[key.name]
        self.charge(key, tokens)

    def release(self, key: ApiKey) -> None:
        """One of the key's requests is no longer in flight."""
        self._in_flight[key.name] = max(0, self._in_flight.get(key.name, 0) - 1)

    def charge(self, key: ApiKey, tokens: int) -> None:
        """Count `tokens` (prompt + completion of every choice) against the key's minute."""
        if tokens:
            self._tokens.setdefault(key.name, _Window()).add(self.clock(), tokens)

    async def start(self) -> None:
        """Nothing to connect to: the windows live in this process."""

    async def stop(self) -> None:
        pass

    def status(self) -> dict:
        return {"kind": "memory", "shared": False, "problem": None}


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
        from gateway.asgi import send_error

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
        from gateway import login, sessions
        from gateway.asgi import send_error

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
