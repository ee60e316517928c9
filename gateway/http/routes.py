"""An endpoint, declared once: its path, methods, handler, who may call it, whether it takes the
hot route, the dialect of its errors and its OpenAPI entry. The table of the gateway's endpoints
is gateway/api/routes.py; every part that needs one of these facts reads it from that table (the
router, the auth middleware, the hot routes, the Anthropic-error rewriting, the OpenAPI document).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from starlette.routing import Route

# Who may call an endpoint, when keys are configured (the admin key is asked for in any case).
OPEN = "open"  # anyone, no key: probes and the version
CLIENT = "client"  # any valid key (an unknown path is treated so)
TENANT = "tenant"  # any valid key sees its own models; the operator (admin key, a key with the
#                    metrics scope, a status-page session) sees every model
TENANT_PAGE = "tenant_page"  # TENANT, and a browser with neither key nor session gets the sign-in form
OPERATOR = "operator"  # the operator only
ADMIN = "admin"  # the admin key (an unknown /admin/ path too)
SIGN_IN = "sign_in"  # anyone: the sign-in form's POST checks the admin key itself
SIGN_OUT = "sign_out"  # a status-page session, or any valid key
ACCESS = (OPEN, CLIENT, TENANT, TENANT_PAGE, OPERATOR, ADMIN, SIGN_IN, SIGN_OUT)


@dataclass(frozen=True)
class Endpoint:
    path: str
    methods: tuple[str, ...]
    handler: Callable
    access: str = CLIENT
    hot: bool = False  # POST served past Starlette's stack (http/hot_routes.py, docs/design/hot-path.md)
    errors: str = "openai"  # or "anthropic": error bodies in Anthropic's shape (http/asgi.AnthropicErrors)
    # (the OpenAPI document's context) -> {method: operation} or None where this gateway does not
    # serve it now; None here: not in the document
    openapi: Callable[[Any], dict | None] | None = None

    def __post_init__(self):
        if self.access not in ACCESS:
            raise ValueError(f"{self.path}: access {self.access!r} is not one of {ACCESS}")
        if self.hot and self.methods != ("POST",):
            raise ValueError(f"{self.path}: a hot route is POST only")


def starlette_routes(endpoints: Sequence[Endpoint]) -> list[Route]:
    return [Route(e.path, e.handler, methods=list(e.methods)) for e in endpoints]


def hot_handlers(endpoints: Sequence[Endpoint]) -> dict[str, Callable]:
    return {e.path: e.handler for e in endpoints if e.hot}


def paths_erring_in(endpoints: Sequence[Endpoint], dialect: str) -> frozenset[str]:
    return frozenset(e.path for e in endpoints if e.errors == dialect)


def access_by_path(endpoints: Sequence[Endpoint]) -> dict[str, str]:
    paths = [e.path for e in endpoints]
    if len(paths) != len(set(paths)):
        raise ValueError(f"an endpoint is declared twice: {sorted(p for p in paths if paths.count(p) > 1)}")
    return {e.path: e.access for e in endpoints}


def access_of(table: dict[str, str], path: str) -> str:
    return table.get(path) or (ADMIN if path.startswith("/admin/") else CLIENT)
