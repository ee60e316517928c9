"""Budgets as the serving path uses them: reserve at admission, settle at the end, read for /key/info.

    admission   every budget that applies to the key and model must have room for the request's
                bound, (prompt bound + max_tokens) x choices in its unit: held in one atomic call
    the end     the holds are dropped and what the backend reported is charged; a cut answer is
                charged the tokens it streamed (and its prompt bound, which the backend never
                reported); an answer with no token is charged nothing
    refusal     429 `quota_exceeded` naming the budget, Retry-After until the window has room

A shadow budget is counted and warns, but never refuses. Past a budget's soft limit an answer
carries `x-kvgate-budget-warning: <budget>=<percent used>` and kvgate_budget_soft_limit_total counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from gateway.budgets.memory import Charge, MemoryStore
from gateway.budgets.redis_store import RedisStore
from gateway.budgets.rules import Rule, Usage
from gateway.config import BudgetsConfig, GatewayConfig, LimitsStoreConfig
from gateway.errors import BudgetExceeded

log = logging.getLogger("kvgate.budgets")

WARNING_HEADER = "x-kvgate-budget-warning"
MESSAGE_OVERHEAD_BYTES = 32  # a chat message's role and template tokens, bounded from above


@dataclass
class Hold:
    """One admitted request's reservation, and what it has produced so far (to settle a cut answer)."""

    request_id: str
    key: object
    model: str
    charges: list[tuple[Rule, Charge]]
    prompt_bound: int
    warnings: list[str] = field(default_factory=list)
    streamed: int = 0  # output tokens seen
    prompt_seen: int | None = None  # prompt tokens a backend reported
    settled: bool = False

    def observe(self, events) -> None:
        for e in events:
            self.streamed += len(e.token_ids) or bool(e.text)
            if e.usage is not None and e.usage.prompt_tokens:
                self.prompt_seen = e.usage.prompt_tokens

    def usage_of(self, usage: dict | None) -> tuple[Usage, bool]:
        """What to charge: the reported usage, or (cut: no usage) what was seen. And whether cut."""
        if usage:
            return Usage.of(usage), False
        if not self.streamed:
            return Usage(), True
        return Usage(self.prompt_seen if self.prompt_seen is not None else self.prompt_bound, 0, self.streamed), True


def prompt_bound(parsed) -> int:
    """Most tokens the prompts can be (every prompt): token ids as sent, text by its UTF-8 bytes (a
    token is at least one byte), chat by its messages' and tools' JSON plus a template's overhead."""
    if parsed.prompts is not None:
        return sum(len(p) if isinstance(p, list) else len(p.encode()) for p in parsed.prompts)
    messages = parsed.messages or []
    text = json.dumps(messages, ensure_ascii=False) + json.dumps(parsed.tools or [], ensure_ascii=False)
    return len(text.encode()) + MESSAGE_OVERHEAD_BYTES * (len(messages) + 1)


class Budgets:
    def __init__(self, cfg: BudgetsConfig, model_pools: dict[str, str], store, clock=time.time):
        self.cfg = cfg
        self.rules = [Rule(b, model_pools, cfg.prices) for b in cfg.limits]
        self.store = store
        self.clock = clock
        self._sink = open(cfg.usage_log, "a", buffering=1) if cfg.usage_log else None
        self._last: dict[tuple[str, str], tuple[float, float]] = {}  # (budget, subject) -> (spend, held)
        self._tasks: set[asyncio.Task] = set()
        self.refused = Counter("kvgate_budget_refused", "Requests refused by a budget (429).", ["budget"],
                               registry=None)
        self.soft = Counter("kvgate_budget_soft_limit", "Requests admitted past a budget's soft limit.",
                            ["budget"], registry=None)

    @property
    def enabled(self) -> bool:
        return bool(self.rules)

    # ------------------------------------------------------------------ admission

    async def reserve(self, key, model: str, parsed, free: bool = False) -> Hold | None:
        """Hold the request's bound on every budget of `key` and `model`, or raise BudgetExceeded."""
        applying = [(r, s) for r in self.rules if (s := r.applies(key, model)) is not None]
        if not applying:
            return None
        choices = parsed.num_choices
        bound = prompt_bound(parsed) * parsed.n
        output = (parsed.sampling.max_tokens or 0) * choices
        if free:  # a cache hit: held and charged 0
            bound = output = 0
        now = self.clock()
        charges = [(r, self._charge(r, s, r.bound(bound, output, model), now)) for r, s in applying]
        request_id = uuid.uuid4().hex
        verdict = await self.store.reserve(request_id, [c for _, c in charges])
        for (r, c), spent, held in zip(charges, verdict.spent, verdict.held):
            self._last[c.slot] = (spent, held + (c.amount if verdict.refused is None else 0))
        if verdict.refused is not None:
            rule, charge = charges[verdict.refused]
            self.refused.labels(rule.name).inc()
            raise BudgetExceeded(self._refusal(rule, charge, verdict.spent[verdict.refused],
                                               verdict.held[verdict.refused]), retry_after_s=verdict.wait_s)
        hold = Hold(request_id, key, model, charges, bound)
        for (r, c), spent, held in zip(charges, verdict.spent, verdict.held):
            used = spent + held + c.amount
            if r.cfg.soft_limit is not None and used >= r.cfg.soft_limit * r.limit or used > r.limit:
                self.soft.labels(r.name).inc()
                hold.warnings.append(f"{r.name}={min(999, int(100 * used / r.limit))}%")
        return hold

    def _charge(self, rule: Rule, subject: str, amount: float, now: float) -> Charge:
        window = rule.window(now)
        return Charge(rule.name, subject, window.id, rule.limit, amount, shadow=rule.cfg.shadow,
                      period_s=rule.cfg.period_s or 0.0, ttl_s=0.0 if window.rolling else window.end - now)

    @staticmethod
    def _refusal(rule: Rule, charge: Charge, spent: float, held: float) -> str:
        unit = rule.cfg.unit.replace("_", " ")
        return (f"Budget '{rule.name}' of {charge.subject} is spent: {spent:g} of {rule.limit:g} {unit} used "
                f"this {rule.cfg.window} window ({held:g} held by requests in flight); this request may "
                f"need {charge.amount:g}.")

    # ------------------------------------------------------------------ the end

    def settle(self, hold: Hold, usage: dict | None, status: int, cache_hit: bool = False, free: bool = False) -> None:
        """Charge what `hold`'s request used (from the recorder's synchronous finish: in a task)."""
        if hold.settled:
            return
        hold.settled = True
        used, cut = (Usage(), False) if free else hold.usage_of(usage)
        charges = []
        for rule, c in hold.charges:
            charges.append(Charge(c.budget, c.subject, c.window, c.limit, rule.cost(used, hold.model), held=c.amount,
                                  period_s=c.period_s, ttl_s=c.ttl_s))
        self._write(hold, used, cut, status, cache_hit, charges)
        task = asyncio.get_running_loop().create_task(self._settle(hold.request_id, charges))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, request_id: str, charges: list[Charge]) -> None:
        try:
            spent = await self.store.settle(request_id, charges)
        except Exception:  # noqa: BLE001 - a settle must never break serving; the sink has the record
            log.exception("budgets: settling %s failed", request_id)
            return
        for c, s in zip(charges, spent):
            last = self._last.get(c.slot, (0.0, 0.0))
            self._last[c.slot] = (s, max(0.0, last[1] - c.held))

    def _write(self, hold: Hold, used: Usage, cut: bool, status: int, cache_hit: bool, charges) -> None:
        if self._sink is None:
            return
        record = {"time": round(self.clock(), 3), "request_id": hold.request_id, "key": hold.key.name,
                  "team": hold.key.team, "model": hold.model, "status": status, "cut": cut, "cache_hit": cache_hit,
                  "input_tokens": used.input, "cached_input_tokens": used.cached, "output_tokens": used.output,
                  "budgets": {c.budget: c.amount for c in charges}}
        self._sink.write(json.dumps(record) + "\n")

    async def drain(self) -> None:
        """Wait for the settles in flight (shutdown; tests)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    # ------------------------------------------------------------------ reading

    async def info(self, key) -> list[dict]:
        """Each budget that binds `key` (for any model): its window, spend, holds and what is left."""
        now = self.clock()
        mine = [(r, s) for r in self.rules if (s := r.subject(key)) is not None]
        charges = [self._charge(r, s, 0.0, now) for r, s in mine]
        read = await self.store.read(charges) if charges else []
        out = []
        for (r, s), c, (spent, held) in zip(mine, charges, read):
            window = r.window(now)
            self._last[c.slot] = (spent, held)
            out.append({"name": r.name, "subject": s, "unit": r.cfg.unit, "limit": r.limit,
                        "window": r.cfg.window, "models": sorted(r.models) if r.models is not None else None,
                        "window_start": None if window.rolling else int(window.start),
                        "resets_at": None if window.rolling else int(window.end),
                        "period_s": r.cfg.period_s, "spend": spent, "reserved": held,
                        "remaining": max(0.0, r.limit - spent - held), "shadow": r.cfg.shadow,
                        "soft_limit": r.cfg.soft_limit})
        return out

    def overview(self) -> dict:
        """The status page's view: each budget and subject as this replica last saw it, and the store."""
        rules = {r.name: r for r in self.rules}
        rows = [{"budget": b, "subject": subj, "unit": rules[b].cfg.unit, "window": rules[b].cfg.window,
                 "limit": rules[b].limit, "spend": spent, "reserved": held,
                 "remaining": max(0.0, rules[b].limit - spent - held), "shadow": rules[b].cfg.shadow}
                for (b, subj), (spent, held) in sorted(self._last.items()) if b in rules]
        return {"store": self.store.status(), "budgets": rows}

    def collect(self):
        """Prometheus families: the counters and the last spend this replica saw per budget and subject
        (subjects are the config's keys and teams: a bounded set)."""
        yield from self.refused.collect()
        yield from self.soft.collect()
        spend = GaugeMetricFamily("kvgate_budget_spend", "Spend of a budget's current window, in its unit, as "
                                  "this replica last saw it.", labels=["budget", "subject"])
        remaining = GaugeMetricFamily("kvgate_budget_remaining", "What a budget's window has left (limit - spend "
                                      "- reserved), in its unit.", labels=["budget", "subject"])
        limits = {r.name: r.limit for r in self.rules}
        for (budget, subject), (spent, held) in sorted(self._last.items()):
            spend.add_metric([budget, subject], spent)
            remaining.add_metric([budget, subject], max(0.0, limits.get(budget, 0.0) - spent - held))
        yield spend
        yield remaining
        up = GaugeMetricFamily("kvgate_budget_store_up", "1 when spend is counted in the shared store (or memory).",
                               labels=["kind"])
        up.add_metric([self.store.kind], 1.0 if getattr(self.store, "up", True) else 0.0)
        yield up

    def describe(self):
        return []

    async def start(self) -> None:
        await self.store.start()

    async def stop(self) -> None:
        await self.drain()
        await self.store.stop()
        if self._sink is not None:
            self._sink.close()


def make_budgets(config: GatewayConfig, env=None) -> Budgets:
    cfg = config.budgets
    pools = {n: m.name for m in config.models for n in [m.name, *m.aliases]}
    return Budgets(cfg, pools, _store(cfg, config.auth.limits_store, env))


def _store(cfg: BudgetsConfig, limits_store: LimitsStoreConfig, env):
    where = cfg.store or limits_store
    if not cfg.limits or where.kind == "memory":
        return MemoryStore(cfg.reservation_ttl_s)
    env = os.environ if env is None else env
    url = env.get(where.url_env)
    section = "budgets.store" if cfg.store else "auth.limits_store"
    if not url:
        raise ValueError(f"{section}.url_env: environment variable {where.url_env} is not set")
    password = env.get(where.password_env) if where.password_env else None
    return RedisStore(where, url, password=password, fail_open=cfg.on_store_down == "open",
                      reservation_ttl_s=cfg.reservation_ttl_s)

