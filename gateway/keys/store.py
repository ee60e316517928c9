"""API keys: who may call, read from the config and the keys file.

Keys come from the config (`key_env` names an environment variable; `key` is for files kept out
of version control) and from an optional keys file named by an environment variable. Only
SHA-256 digests are kept; a presented key is hashed and compared with every stored digest in
constant time, without stopping at a match. Keys are never logged: logs and metrics use names.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.config import ApiKeyConfig, AuthConfig, GatewayConfig, check_key_classes, format_path
from gateway.errors import PermissionDenied

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
    team: str | None = None  # team budgets count every key of the team
    cache_salt: str | None = None  # the salt its requests carry (tenant_salt), resolved

    def salt_for(self, configured: str | None) -> str | None:
        """The key's own cache salt, else the one `configured` for its SLA class, resolved."""
        return self.cache_salt or tenant_salt(configured, self.digest)

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
    digest = _digest(secret)
    return ApiKey(k.name, digest, models, k.sla_class, k.requests_per_minute, k.tokens_per_minute,
                  k.max_concurrency, sla_classes, frozenset(k.scopes), k.team, tenant_salt(k.cache_salt, digest))


TENANT_SALT_PREFIX = "kvgate."  # a client's own cache_salt may not start so: it cannot name a tenant's


def tenant_salt(configured: str | None, digest: bytes | None) -> str | None:
    """The cache_salt the gateway sets for a tenant: `per_key` derives one from the key's digest (no
    one without the key can name it), a fixed string is hashed, so a client cannot send a tenant's
    salt as its own. None: no tenant salt (no key for per_key: nothing to tell tenants apart)."""
    if configured is None or (configured == "per_key" and digest is None):
        return None
    material = b"per_key\0" + digest if configured == "per_key" else b"fixed\0" + configured.encode()
    return TENANT_SALT_PREFIX + hashlib.sha256(b"kvgate-cache-salt\0" + material).hexdigest()[:32]


def _env_secret(where: str, name: str, env) -> str:
    value = env.get(name)
    if not value:
        raise ValueError(f"{where}: environment variable {name} is not set")
    return value
