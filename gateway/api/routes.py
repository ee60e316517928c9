"""The gateway's endpoints, each declared once (gateway/http/routes.py says what a declaration
holds). gateway.app builds the router, the auth middleware's rules, the hot routes and the
Anthropic-error paths from this table, and GET /openapi.json documents it."""

from __future__ import annotations

from starlette.responses import RedirectResponse

from gateway.api import generate, lora, openapi, ops, status, tokens
from gateway.http import login
from gateway.http.routes import ADMIN, OPEN, OPERATOR, SIGN_IN, SIGN_OUT, TENANT, TENANT_PAGE, Endpoint

POST, GET = ("POST",), ("GET",)


async def _to_status(request) -> RedirectResponse:
    return RedirectResponse("/status")


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/v1/completions", POST, generate.completions, hot=True, openapi=openapi.completions_entry),
    Endpoint("/v1/chat/completions", POST, generate.chat_completions, hot=True, openapi=openapi.chat_entry),
    Endpoint("/v1/responses", POST, generate.responses, openapi=openapi.responses_entry),
    Endpoint("/v1/messages", POST, generate.messages, errors="anthropic", openapi=openapi.messages_entry),
    Endpoint("/v1/embeddings", POST, tokens.embeddings, openapi=openapi.embeddings_entry),
    Endpoint("/tokenize", POST, tokens.tokenize, openapi=openapi.tokenize_entry),
    Endpoint("/detokenize", POST, tokens.detokenize, openapi=openapi.detokenize_entry),
    Endpoint("/v1/messages/count_tokens", POST, tokens.count_message_tokens, errors="anthropic",
             openapi=openapi.count_tokens_entry),
    Endpoint("/v1/models", GET, generate.list_models, openapi=openapi.summary_entry("List models")),
    Endpoint("/key/info", GET, generate.key_info),
    Endpoint("/health", GET, ops.health, access=OPEN,
             openapi=openapi.summary_entry("Can serve every model (vLLM's health check)")),
    Endpoint("/version", GET, ops.version, access=OPEN, openapi=openapi.summary_entry("Version")),
    Endpoint("/health/live", GET, ops.health_live, access=OPEN, openapi=openapi.summary_entry("Liveness")),
    Endpoint("/health/ready", GET, ops.health_ready, access=OPEN, openapi=openapi.summary_entry("Readiness")),
    Endpoint("/admin/reload", POST, ops.admin_reload, access=ADMIN),
    Endpoint("/admin/reset_prefix_cache", POST, ops.admin_reset_prefix_cache, access=ADMIN),
    Endpoint("/v1/load_lora_adapter", POST, lora.load_lora_adapter, access=ADMIN),
    Endpoint("/v1/unload_lora_adapter", POST, lora.unload_lora_adapter, access=ADMIN),
    Endpoint("/metrics", GET, ops.metrics, access=OPERATOR),
    Endpoint("/openapi.json", GET, openapi.serving(lambda: ENDPOINTS)),
    Endpoint("/", GET, _to_status),
    Endpoint("/status", GET, status.status_page, access=TENANT_PAGE),
    Endpoint("/status.json", GET, status.status_json, access=TENANT),
    Endpoint("/status/login", POST, login.status_login, access=SIGN_IN),
    Endpoint("/status/logout", POST, login.status_logout, access=SIGN_OUT),
)
