"""What the response cache keys on and what it keeps.

The key is a SHA-256 of the canonical JSON of everything that shapes the answer: the request after
the gateway's defaults (the sampling parameters as the backend receives them, the prompts or
messages, tools, response format, vendor fields, n), the model it resolved to, and the tenant
scope (the key's name, its team, or nothing when shared). `stream` and `stream_options` are not in
it: an entry is the backend's events, replayed through the same writers as a live answer, so a
stream hit is SSE with usage as the hit asked for, and a whole hit a whole answer.
"""

from __future__ import annotations

import hashlib
import json

import orjson

from gateway import fastjson
from gateway.backend import TokenEvent, TokenLogprob, ToolCallDelta, TopLogprob, Usage, token_event

STORED_FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})  # not "abort", not an error


def cacheable(parsed, tools_allowed: bool) -> bool:
    """Deterministic requests only: greedy (temperature 0) or seeded; several choices only with a
    seed (greedy choices of a batch may still differ); tools only where the model opts in (a tool
    call may have side effects the client wants each time); never a passed-through body."""
    s = parsed.sampling
    if parsed.passthrough is not None or (parsed.tools and not tools_allowed):
        return False
    if s.seed is None and (s.temperature != 0 or parsed.n > 1):
        return False
    return True


def cache_key(parsed, model: str, scope: str) -> str:
    canonical = {
        "model": model, "scope": scope, "chat": parsed.chat, "n": parsed.n,
        "sampling": vars(parsed.sampling), "prompts": parsed.prompts, "messages": parsed.messages,
        "tools": parsed.tools, "tool_choice": parsed.tool_choice, "parallel_tool_calls": parsed.parallel_tool_calls,
        "response_format": parsed.response_format, "reasoning_effort": parsed.reasoning_effort,
        "extra": parsed.extra,
    }
    if parsed.needs.adapter is not None:  # an adapter's answers are not the base model's
        canonical["adapter"] = parsed.needs.adapter
    try:
        text = orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # what fastjson hands to the standard library
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(text).hexdigest()


def encode(batches: list[tuple[int, list[TokenEvent]]]) -> bytes:
    """The events of an answer as they arrived, per choice: what a hit replays."""
    return fastjson.dumps([[index, [_event(e) for e in batch]] for index, batch in batches])


def decode(data: bytes) -> dict[int, list[list[TokenEvent]]]:
    """Choice index -> its batches of events."""
    out: dict[int, list[list[TokenEvent]]] = {}
    for index, batch in fastjson.loads(data):
        out.setdefault(index, []).append([_from(e) for e in batch])
    return out


def _event(e: TokenEvent) -> dict:
    d = {}
    if e.text:
        d["t"] = e.text
    if e.token_ids:
        d["i"] = list(e.token_ids)
    if e.logprobs:
        d["l"] = [[lp.token, lp.logprob, lp.token_id, [[t.token, t.logprob, t.token_id] for t in lp.top]]
                  for lp in e.logprobs]
    if e.finish_reason:
        d["f"] = e.finish_reason
    if e.usage is not None:
        d["u"] = [e.usage.prompt_tokens, e.usage.completion_tokens, e.usage.cached_tokens]
    if e.tool_calls:
        d["c"] = [[c.index, c.id, c.name, c.arguments] for c in e.tool_calls]
    if e.reasoning:
        d["r"] = e.reasoning
    if e.refusal:
        d["x"] = e.refusal
    return d


def _from(d: dict) -> TokenEvent:
    return token_event(  # one per kept event, on every hit: the cheap constructor
        text=d.get("t", ""), token_ids=tuple(d.get("i", ())), finish_reason=d.get("f"),
        logprobs=tuple(TokenLogprob(t, lp, i, tuple(TopLogprob(*top) for top in tops))
                       for t, lp, i, tops in d.get("l", ())),
        usage=Usage(*d["u"]) if "u" in d else None,
        tool_calls=tuple(ToolCallDelta(*c) for c in d.get("c", ())), reasoning=d.get("r", ""), refusal=d.get("x", ""))
