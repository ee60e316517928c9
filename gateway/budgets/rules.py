"""What a budget is, as the ledger uses it: who it binds, what a request costs in its unit, its window.

    calendar day     [reset_at today, + 1 day)           UTC, reset_at from the config ("00:00")
    calendar month   [day 1 at reset_at, next day 1)     the window's start names it: one counter each
    rolling          (now - period_s, now]               each settled charge is an event that ages out
"""

from __future__ import annotations

import calendar
import datetime as dt
from dataclasses import dataclass

from gateway.config import BudgetConfig, ModelPrice

DAY_S = 86400


@dataclass(frozen=True)
class Usage:
    """Tokens of one request: prompt tokens not cached, prompt tokens cached, completion tokens."""

    input: int = 0
    cached: int = 0
    output: int = 0

    @classmethod
    def of(cls, usage: dict) -> "Usage":
        """From an OpenAI usage object (prompt tokens include the cached ones)."""
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return cls(max(0, usage.get("prompt_tokens", 0) - cached), cached, usage.get("completion_tokens", 0))


@dataclass(frozen=True)
class Window:
    start: float  # seconds since the epoch; rolling: now - period
    end: float  # when the window's spend is forgotten (rolling: never as one)
    rolling: bool = False

    @property
    def id(self) -> str:
        return "roll" if self.rolling else str(int(self.start))


class Rule:
    """One configured budget, with the prices of the models it counts."""

    def __init__(self, cfg: BudgetConfig, model_pools: dict[str, str], prices: dict[str, ModelPrice]):
        self.cfg = cfg
        self.name = cfg.name
        self.limit = cfg.limit
        self.models = None if cfg.models is None else frozenset(model_pools[m] for m in cfg.models)
        self.prices = prices
        hours, minutes = cfg.reset_at.split(":")
        self.reset_offset_s = int(hours) * 3600 + int(minutes) * 60

    def subject(self, key) -> str | None:
        """Whose spend a request of `key` counts toward ("key=alice", "team=ml"), or None."""
        if self.cfg.key is not None:
            return f"key={key.name}" if self.cfg.key in ("*", key.name) else None
        if key.team is None:
            return None
        return f"team={key.team}" if self.cfg.team in ("*", key.team) else None

    def applies(self, key, model: str) -> str | None:
        if self.models is not None and model not in self.models:
            return None
        return self.subject(key)

    def cost(self, usage: Usage, model: str) -> float:
        """What `usage` of `model` costs in this budget's unit."""
        unit = self.cfg.unit
        if unit == "tokens":
            return usage.input + usage.cached + usage.output
        if unit == "input_tokens":
            return usage.input + usage.cached
        if unit == "output_tokens":
            return usage.output
        if unit == "weighted_tokens":
            w = self.cfg.weights
            cached = w.input if w.cached_input is None else w.cached_input
            return usage.input * w.input + usage.cached * cached + usage.output * w.output
        price = self.prices[model]
        cached = price.input_per_million if price.cached_input_per_million is None else price.cached_input_per_million
        return (usage.input * price.input_per_million + usage.cached * cached
                + usage.output * price.output_per_million) / 1e6

    def bound(self, prompt_tokens: int, output_tokens: int, model: str) -> float:
        """The most a request can cost: its prompt bound read at the dearer of cached and uncached."""
        return max(self.cost(Usage(prompt_tokens, 0, output_tokens), model),
                   self.cost(Usage(0, prompt_tokens, output_tokens), model))

    def window(self, now: float) -> Window:
        if self.cfg.window == "rolling":
            return Window(now - self.cfg.period_s, now + self.cfg.period_s, rolling=True)
        if self.cfg.window == "day":
            start = (now - self.reset_offset_s) // DAY_S * DAY_S + self.reset_offset_s
            return Window(start, start + DAY_S)
        return _month(now, self.reset_offset_s)


def _month(now: float, offset_s: int) -> Window:
    """The calendar month (starting on day 1 at `offset_s` past midnight UTC) holding `now`."""
    t = dt.datetime.fromtimestamp(now - offset_s, dt.timezone.utc)
    start = calendar.timegm((t.year, t.month, 1, 0, 0, 0)) + offset_s
    year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
    return Window(start, calendar.timegm((year, month, 1, 0, 0, 0)) + offset_s)
