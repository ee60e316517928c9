"""The live status page: GET /status (HTML, no build step) polls GET /status.json.

The JSON is computed on each call from the live state: models and deployments with their load,
breakers and engine counters, SLA classes, request totals, recent TTFT/TPOT percentiles, and the
last errors. Rates and sparklines are computed by the page from successive polls.
"""

from __future__ import annotations

import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse

from gateway.observability.recent import percentile
from gateway.state import GatewayState, state_of

PAGE = Path(__file__).parents[1] / "static" / "status.html"
async def status_page(request: Request) -> HTMLResponse:
    return HTMLResponse(PAGE.read_text())


async def status_json(request: Request) -> JSONResponse:
    state = state_of(request)
    seen = request.scope.get("state", {})
    key = seen.get("api_key")
    if key is not None and not seen.get("operator"):
        return JSONResponse(_tenant_view(state, key))
    recent = state.recent
    return JSONResponse({
        "time": time.time(),
        "uptime_s": time.time() - state.started_at,
        "models": [_pool(p) for p in state.registry.pools],
        "sla_classes": [c.model_dump() for c in state.config.sla_classes],
        "requests": {"total": recent.requests, "failed": recent.failed, "cancelled": recent.cancelled},
        "latency": {
            "ttft_p50": percentile(recent.ttft, 0.5), "ttft_p99": percentile(recent.ttft, 0.99),
            "tpot_p50": percentile(recent.tpot, 0.5), "tpot_p99": percentile(recent.tpot, 0.99),
        },
        "recent_errors": list(recent.errors),  # with the key's name: the operator may see whose
        "limits_store": state.limiter.status(),
        "budgets": state.budgets.overview() if state.budgets is not None else None,
        "key_problems": list(state.key_problems),  # keys-file entries left out (no key is shown)
    })


def _tenant_view(state: GatewayState, key) -> dict:
    """What a client key sees: its own models' health and its own recent errors. Not the
    deployments behind a model (their names hold pod addresses, their problems internal URLs),
    nor other tenants' errors, totals or latencies."""
    return {
        "time": time.time(),
        "view": "key",
        "models": [_tenant_pool(p) for p in state.registry.pools if key.may_use([p.name, *p.aliases])],
        "sla_classes": [c.model_dump() for c in state.config.sla_classes],
        "recent_errors": [_without_key(e) for e in state.recent.errors if e.get("key") == key.name],
    }


def _tenant_pool(pool) -> dict:
    up = sum(1 for d in pool.deployments if d.started and d.backend.load().healthy)
    return {"name": pool.name, "aliases": pool.aliases, "up": up > 0, "deployments_up": up,
            "in_flight": pool.in_flight, "queued": pool.admission.queued}


def _without_key(error: dict) -> dict:
    return {k: v for k, v in error.items() if k != "key"}


def _pool(pool) -> dict:
    return {
        "name": pool.name, "aliases": pool.aliases, "policy": pool.config.policy,
        "in_flight": pool.in_flight, "queued": pool.admission.queued,
        "deployments": [_with_kv_index(_deployment(d), pool.policy.kv_feed) for d in pool.deployments],
        "discovery": [g.status() for g in pool.groups],
        # precise_prefix: sampled decisions (matched tokens, the chosen engine's TTFT estimate)
        "recent_routes": getattr(pool.policy, "recent_routes", list)(),
    }


def _deployment(d) -> dict:
    load = d.backend.load()
    engine = None
    if "prefix_cache_queries" in load.extra:
        queries = load.extra.get("prefix_cache_queries", 0)
        engine = {
            "prefix_cache_hit_rate": (load.extra.get("prefix_cache_hits", 0) / queries) if queries else None,
            "preemptions": load.extra.get("num_preemptions", 0),
            "kv_blocks_total": load.extra.get("kv_blocks_total"),
        }
    if load.extra.get("spec_decode_num_speculative_tokens", 0) > 0:
        engine = {**(engine or {}), "spec_decode": _spec_decode(load.extra)}
    if "engine_restarts" in load.extra:
        engine = {**(engine or {}), "restarts": load.extra["engine_restarts"]}
    return {
        "name": d.name, "backend": d.config.backend if d.config else None, "role": d.role,
        "up": bool(d.started and load.healthy), "start_error": d.start_error, "problem": load.problem,
        "breaker": d.breaker.state, "in_flight": d.in_flight,
        "waiting": load.waiting, "running": load.running, "kv_cache_usage": load.kv_cache_usage,
        "capacity": load.capacity, "engine": engine, "lora": _lora(load.lora),
    }


def _lora(lora) -> dict | None:
    """Its LoRA adapters (null: it serves none): those it holds, and those its running and
    waiting requests use, in its max_loras slots."""
    if lora is None:
        return None
    return {"adapters": sorted(lora.adapters), "running": list(lora.running), "waiting": list(lora.waiting),
            "max_loras": lora.max_loras}


def _with_kv_index(view: dict, feed) -> dict:
    """precise_prefix: the blocks the model's KV index says this deployment caches, and whether
    its events are live (null: it publishes none, or the policy keeps no index)."""
    stream = feed.streams.get(view["name"]) if feed is not None else None
    if stream is not None:
        view["kv_index"] = {"blocks": feed.index.blocks_of(view["name"]), "live": stream.live}
    return view


def _spec_decode(extra: dict) -> dict:
    """Speculative decoding since the engine started: how many drafts pay (None before any)."""
    drafts, proposed = extra.get("spec_decode_num_drafts", 0), extra.get("spec_decode_num_draft_tokens", 0)
    accepted = extra.get("spec_decode_num_accepted_tokens", 0)
    return {
        "num_speculative_tokens": int(extra["spec_decode_num_speculative_tokens"]),
        "drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }
