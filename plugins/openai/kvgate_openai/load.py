"""How busy the upstream is: its own metrics while they are fresh, our in-flight count otherwise."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from gateway.backend import LoadSnapshot, LoRAState
from kvgate_openai import metrics
from kvgate_openai.pool import ClientPool
from kvgate_openai.settings import OpenAISettings
from kvgate_openai.transport import Response, StreamBroken, UpstreamUnreachable

log = logging.getLogger("kvgate.openai")


class LoadTracker:
    """Keeps the latest scrape, the in-flight count and the health verdict.

    Health reflects the latest evidence: `unhealthy_after` failures in a row (scrapes that got no
    answer, requests that could not connect) make the deployment unhealthy, one success heals it.
    Without a poller nothing could heal it, so then connection failures only fail their request.
    """

    def __init__(self, settings: OpenAISettings):
        self.settings = settings
        self.inflight = 0
        self.reading: metrics.Reading | None = None
        self.read_at = 0.0
        self.failures = 0
        self.polling = False
        self.throttled_until = 0.0  # the upstream said 429/503: it is full until then
        # /v1/models shows the upstream's context length when the operator gives it.
        self.info = {"max_model_len": str(settings.max_model_len)} if settings.max_model_len else {}
        self.adapters: dict[str, str] | None = None  # lora_adapters: name -> root, from its /v1/models
        self.lora: metrics.LoRAInfo | None = None  # lora_adapters: its vllm:lora_requests_info

    def snapshot(self) -> LoadSnapshot:
        now = time.monotonic()
        extra = {"inflight": float(self.inflight)}
        if self.throttled_until > now:
            extra["throttled_s"] = self.throttled_until - now
        if self.reading is not None:
            extra["metrics_age_s"] = now - self.read_at
        if self.reading is not None and now - self.read_at <= self.settings.stale_after_s:
            r = self.reading
            return LoadSnapshot(r.waiting, r.running, r.kv_cache_usage, self.settings.capacity, self.healthy, extra,
                                self.info, lora=self.lora_state())
        extra["metrics_stale"] = 1.0
        return LoadSnapshot(0, self.inflight, 0.0, self.settings.capacity, self.healthy, extra, self.info,
                            lora=self.lora_state())

    def lora_state(self) -> LoRAState | None:
        """The upstream's adapters (once its /v1/models was read) and their slots (its gauge)."""
        if self.adapters is None:
            return None
        info = self.lora or metrics.LoRAInfo(0, (), ())
        return LoRAState(info.max_loras, dict(self.adapters), info.running, info.waiting)

    @property
    def healthy(self) -> bool:
        return not self.polling or self.failures < self.settings.unhealthy_after

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self) -> None:
        self.failures += 1

    def throttled(self, seconds: float) -> None:
        self.throttled_until = max(self.throttled_until, time.monotonic() + seconds)

    def record(self, reading: metrics.Reading | None) -> None:
        self.succeeded()
        if reading is not None:
            self.reading = reading
            self.read_at = time.monotonic()


async def poll_forever(pool: ClientPool, url: str, tracker: LoadTracker, deployment: str) -> None:
    """Scrape `url` every poll interval until cancelled (by the backend's stop()). `pool` is the
    scrapes' own: a pool whose every connection carries a generation must not hold them up."""
    s = tracker.settings
    tracker.polling = True
    warned = False
    while True:
        try:
            async with asyncio.timeout(s.stale_after_s):  # an older answer would be stale anyway
                response, text = await _scrape(pool, url, s.max_scrape_bytes)
        except (TimeoutError, UpstreamUnreachable, StreamBroken) as exc:
            tracker.failed()
            log.debug("scrape of %s for %s failed: %s", url, deployment, type(exc).__name__)
        else:
            if text is None and not warned:
                log.warning("deployment %s: the metrics at %s are over max_scrape_bytes (%d); not read",
                            deployment, url, s.max_scrape_bytes)
            reading = None if text is None else _reading_of(response, text, s.metrics)
            tracker.record(reading)
            if s.lora_adapters:
                await _read_adapters(pool, tracker, text if response.status_code == 200 else None)
            if reading is None and not warned:
                warned = True
                log.info("deployment %s: no load metrics at %s (HTTP %s); using in-flight counts",
                         deployment, url, response.status_code)
        await asyncio.sleep(s.metrics_poll_s)


async def _read_adapters(pool: ClientPool, tracker: LoadTracker, metrics_text: str | None) -> None:
    """vLLM's adapters: its /v1/models entries with a `parent` (name -> `root`), and the slots its
    vllm:lora_requests_info says; an unreadable answer keeps what was read before."""
    if metrics_text is not None:
        tracker.lora = metrics.lora_info(metrics_text) or tracker.lora
    try:
        s = tracker.settings
        async with asyncio.timeout(s.stale_after_s):
            response, text = await _scrape(pool, s.base_url + "/models", s.max_scrape_bytes)
        models = json.loads(text)["data"] if response.status_code == 200 and text is not None else None
        tracker.adapters = {m["id"]: m.get("root") or m["id"] for m in models
                            if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent")}
    except (TimeoutError, UpstreamUnreachable, StreamBroken, ValueError, KeyError, TypeError):
        pass


async def _scrape(pool: ClientPool, url: str, limit: int) -> tuple[Response, str | None]:
    """The answer and its text, read to at most `limit` bytes (None past it: a page that size is
    no metrics page, and reading it whole would hold it all in memory). Prometheus' text format
    is UTF-8."""
    response = await pool.send("GET", url, content=b"", headers={})
    try:
        parts, size = [], 0
        async for part in response.aiter_bytes():
            size += len(part)
            if size > limit:
                return response, None
            parts.append(part)
    finally:
        await response.aclose()
    return response, b"".join(parts).decode("utf-8", errors="replace")


def _reading_of(response: Response, text: str, preset: str) -> metrics.Reading | None:
    if response.status_code != 200 or "json" in response.headers.get("content-type", ""):
        return None  # no metrics, or trtllm-serve's JSON stats at /metrics
    try:
        return metrics.parse(text, preset)
    except ValueError:
        return None
