"""Prometheus metrics for the gateway and the engines behind it (`GET /metrics`).

kvgate runs one uvicorn worker per process and scales by replicas (the Helm chart's HPA), so a
plain registry per process is exact; no multiprocess mode is needed. Each gateway gets its own
`CollectorRegistry` (several gateways can share a test process).

Latency buckets span milliseconds to minutes, so P50/P99 can be computed with
`histogram_quantile` for anything from a cache hit to a long generation. Engine gauges are read
from each backend's `load()` at scrape time, and also exported under vLLM's names so Kubernetes'
Gateway API Inference Extension and existing vLLM dashboards can read a kvgate engine.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                     0.75, 1.0, 2.5, 5.0, 10.0)
TOKEN_COUNT_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

def observe_times(histogram, amount: float, times: int) -> None:
    """`histogram.observe(amount)`, `times` times over, in one step: one bucket increment by
    `times` instead of `times` locked increments of the sum and a bucket scan each (the tokens of
    one upstream read arrive together: `times` inter-token gaps of 0). On a prometheus_client
    whose histogram children lack these internals, it observes one at a time."""
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for _ in range(times):
            histogram.observe(amount)
        return
    total.inc(amount * times)
    buckets[bisect_left(bounds, amount)].inc(times)  # the first bucket with amount <= its bound


BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


class GatewayMetrics:
    def __init__(self, state_of):
        """`state_of()` returns the current GatewayState (read at scrape time: survives reloads)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_requests", "Requests answered, by model, deployment, SLA class and status.",
                                ["model", "deployment", "sla_class", "status"], registry=r)
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "From request arrival to the first token sent.",
                              ["model", "sla_class"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvgate_inter_token_latency_seconds", "Gap between two tokens of one choice (TPOT).",
                             ["model"], buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("kvgate_e2e_request_latency_seconds", "From request arrival to its last byte.",
                             ["model", "sla_class"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("kvgate_queue_wait_seconds", "Time a request waited for admission to its pool.",
                                    ["model", "sla_class"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("kvgate_prompt_tokens", "Prompt tokens per request.", ["model"],
                                       buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.completion_tokens = Histogram("kvgate_completion_tokens", "Completion tokens per request.", ["model"],
                                           buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.shed = Counter("kvgate_shed_requests", "Requests refused as overloaded (503), by reason.",
                            ["model", "sla_class", "reason"], registry=r)
        self.rate_limited = Counter("kvgate_rate_limited_requests", "Requests refused by a key's limits (429).",
                                    ["key"], registry=r)
        self.retries = Counter("kvgate_backend_retries", "Attempts moved to another deployment before the first token.",
                               ["model", "deployment"], registry=r)
        self.failovers = Counter("kvgate_fallback_model_used", "Requests served by a fallback model.",
                                 ["model", "fallback"], registry=r)
        # Prefill/decode disaggregation (gateway.dispatch.disagg).
        self.pd_hops = Counter("kvgate_pd_hops", "Hops of disaggregated requests, by model, pool (prefill, decode) "
                               "and outcome (ok, failed: moved to another deployment or served colocated).",
                               ["model", "pool", "outcome"], registry=r)
        self.pd_hop_seconds = Histogram("kvgate_pd_hop_seconds", "Prefill hop: from sending it to the prefill's "
                                        "answer; decode hop: from sending it to its first token.",
                                        ["model", "pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.pd_colocated = Counter("kvgate_pd_colocated", "Requests of a disaggregated model the decode pool "
                                    "served without KV from a prefill hop, by reason (short_prompt, passthrough, "
                                    "no_prefill, no_params, unknown_producer).", ["model", "reason"], registry=r)
        self.cache_requests = Counter("kvgate_response_cache_requests", "Requests of models with a response cache, "
                                      "by result: hit, miss, bypass (not cacheable, or no-store) and stored.",
                                      ["model", "result"], registry=r)
        r.register(_LiveCollector(state_of))
        self.state_of = state_of
        self._series: dict = {}

    def series(self, metric, *labels: str):
        """`metric.labels(*labels)`, looked up once per metric and label values instead of once per
        request (a lock, label checks and a dict lookup each time). Only for series that are never
        removed: not `requests` or `retries`, whose gone discovery members are dropped."""
        key = (metric, labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child

    def exposition(self) -> bytes:
        self._forget_gone_members()
        return generate_latest(self.registry)

    def _forget_gone_members(self) -> None:
        """Members found in DNS (name@address) come and go with pods, whose addresses change on
        every restart: the series of one no longer in its group are dropped, or a long-lived
        gateway would export every address it has ever seen."""
        state = self.state_of()
        groups = state.registry.groups() if state is not None else []
        if not groups:
            return
        known = {d.name for g in groups for d in g.everyone()}
        for metric, labels in ((self.requests, ("model", "deployment", "sla_class", "status")),
                               (self.retries, ("model", "deployment"))):
            gone = {tuple(sample.labels[n] for n in labels) for family in metric.collect() for sample in family.samples
                    if "@" in sample.labels["deployment"] and sample.labels["deployment"] not in known}
            for values in gone:
                metric.remove(*values)


class _LiveCollector:
    """Gauges read from the live state at scrape time: pools, breakers, engines."""

    def __init__(self, state_of):
        self.state_of = state_of

    def describe(self):
        return []

    def collect(self):
        state = self.state_of()
        if state is None:
            return
        yield from _pool_gauges(state.registry)
        yield from _deployment_gauges(state.registry)
        yield from _engine_metrics(state.registry)
        yield from _spec_decode_metrics(state.registry)
        yield from _kv_transfer_metrics(state.registry)
        yield from _cache_config_info(state.registry)
        yield from _lora_requests_info(state.registry)
        yield from _restart_counters(state.registry)
        yield from _kv_index_metrics(state.registry)
        yield from _limits_store_gauge(state.limiter)
        yield from _discovery_metrics(state.registry)


def _pool_gauges(registry):
    in_flight = GaugeMetricFamily("kvgate_in_flight_requests", "Requests sent to backends and not yet closed.",
                                  labels=["model"])
    queued = GaugeMetricFamily("kvgate_queued_requests", "Requests waiting in the gateway for admission.",
                               labels=["model"])
    for pool in registry.pools:
        in_flight.add_metric([pool.name], pool.in_flight)
        queued.add_metric([pool.name], pool.admission.queued)
    yield in_flight
    yield queued


def _deployment_gauges(registry):
    breaker = GaugeMetricFamily("kvgate_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
                                labels=["model", "deployment"])
    up = GaugeMetricFamily("kvgate_deployment_up", "1 when the deployment is started and healthy.",
                           labels=["model", "deployment"])
    for d in registry.deployments():
        breaker.add_metric([d.model, d.name], BREAKER_STATES[d.breaker.state])
        up.add_metric([d.model, d.name], 1.0 if d.started and d.backend.load().healthy else 0.0)
    yield breaker
    yield up


def _limits_store_gauge(limiter):
    """Only for a shared store (Redis): 0 while this replica enforces the key limits alone."""
    status = limiter.status()
    if status["kind"] != "memory":
        up = GaugeMetricFamily("kvgate_limits_store_up", "1 when per-key limits are counted in the shared "
                               "store; 0 while this replica falls back to local limits.", labels=["store"])
        up.add_metric([status["kind"]], 1.0 if status["shared"] else 0.0)
        yield up


def _discovery_metrics(registry):
    """Deployments found in DNS: whether the last lookup answered, and their members by state."""
    groups = [(p.name, g) for p in registry.pools for g in p.groups]
    if not groups:
        return
    up = GaugeMetricFamily("kvgate_discovery_up", "1 when the last DNS lookup of a discovered deployment answered; "
                           "0 while it fails (its last known members keep serving).", labels=["model", "deployment"])
    members = GaugeMetricFamily("kvgate_discovery_members", "Members of a discovered deployment: routable, pending "
                                "(started, not healthy yet) or draining (gone from DNS, finishing requests).",
                                labels=["model", "deployment", "state"])
    failures = CounterMetricFamily("kvgate_discovery_failures", "DNS lookups of a discovered deployment that got no "
                                   "answer.", labels=["model", "deployment"])
    dropped = GaugeMetricFamily("kvgate_discovery_addresses_dropped", "Addresses of the last DNS answer left out: "
                                "not in the allowed networks, or over max_members.", labels=["model", "deployment", "reason"])
    for model, g in groups:
        up.add_metric([model, g.name], 1.0 if g.up else 0.0)
        for reason, count in g.dropped.items():
            dropped.add_metric([model, g.name, reason], count)
        for state, found in (("routable", g.routable), ("pending", g.pending), ("draining", g.draining)):
            members.add_metric([model, g.name, state], len(found))
        failures.add_metric([model, g.name], g.failures)
    yield up
    yield members
    yield failures
    yield dropped


# (our name, vLLM's name or None, help, kind, key in LoadSnapshot.extra or attribute)
ENGINE_SERIES = (
    ("kvgate_engine_requests_running", "vllm:num_requests_running", "Requests running in the engine.", "gauge", "running"),
    ("kvgate_engine_requests_waiting", "vllm:num_requests_waiting", "Requests waiting in the engine.", "gauge", "waiting"),
    ("kvgate_engine_kv_cache_usage", "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", "gauge", "kv_cache_usage"),
    ("kvgate_engine_prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter", "prefix_cache_queries"),
    ("kvgate_engine_prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter", "prefix_cache_hits"),
    ("kvgate_engine_preemptions", "vllm:num_preemptions", "Requests preempted (recomputed later).", "counter", "num_preemptions"),
    ("kvgate_engine_steps", None, "Engine steps run.", "counter", "num_steps"),
    ("kvgate_engine_step_tokens", None, "Tokens computed by engine steps (prompt and output).", "counter", "num_step_tokens"),
    ("kvgate_engine_step_seconds", None, "Time spent in engine steps.", "counter", "step_seconds"),
    ("kvgate_engine_kv_blocks_total", None, "KV-cache blocks in the engine.", "gauge", "kv_blocks_total"),
    ("kvgate_engine_grammar_compiles", None, "Output constraints (JSON schemas, regexes, grammars) compiled.",
     "counter", "grammar_compiles"),
    ("kvgate_engine_grammar_cache_hits", None, "Constrained requests served a grammar compiled before.",
     "counter", "grammar_cache_hits"),
    ("kvgate_engine_grammar_failures", None, "Constraints refused by the grammar library or past the compile "
     "deadline.", "counter", "grammar_failures"),
    ("kvgate_engine_grammar_compile_seconds", None, "Time spent compiling constraints.", "counter",
     "grammar_compile_seconds"),
    ("kvgate_engine_kv_clamped_keys", None, "fp8 KV: key values clamped at the format's range when written.", "counter", "kv_clamped_keys"),
    ("kvgate_engine_kv_clamped_values", None, "fp8 KV: value values clamped at the format's range when written.", "counter", "kv_clamped_values"),
)


def _restart_counters(registry):
    restarts = CounterMetricFamily("kvgate_engine_restarts", "Engine processes restarted after a death or hang.",
                                   labels=["model", "deployment"])
    for d in registry.deployments():
        load = d.backend.load() if d.started else None
        if load is not None and "engine_restarts" in load.extra:
            restarts.add_metric([d.model, d.name], load.extra["engine_restarts"])
    yield restarts


KV_EVENT_COUNTERS = {  # StreamStats field -> what the counter counts
    "batches": "KV event batches applied to the index.",
    "events": "KV events applied to the index.",
    "gaps": "Gaps in a deployment's KV event sequence numbers.",
    "resyncs": "KV event gaps repaired through the replay endpoint.",
    "forgotten": "Times a deployment's indexed blocks were dropped (lost events, restart, garbage).",
    "garbage": "Messages on a KV event stream that were not event batches.",
    "out_of_order": "KV event batches that arrived twice: live copies of what a replay brought (ignored).",
    "restarts": "KV event publishers seen starting over.",
}


def _kv_index_metrics(registry):
    """The precise_prefix index of each model: its size and bound, and each deployment's
    blocks and event stream counters."""
    size = GaugeMetricFamily("kvgate_kv_index_blocks", "Block hashes in the model's KV index.", labels=["model"])
    evicted = CounterMetricFamily("kvgate_kv_index_evicted_blocks", "Block hashes dropped to stay within "
                                  "max_index_blocks.", labels=["model"])
    held = GaugeMetricFamily("kvgate_kv_index_deployment_blocks", "KV blocks the index says a deployment holds.",
                             labels=["model", "deployment"])
    tokenize_failures = CounterMetricFamily("kvgate_kv_route_tokenize_failures", "Prompts a backend's /tokenize "
                                            "or the gateway's tokenizing threads did not turn into ids in time "
                                            "for routing (routed by affinity).", labels=["model"])
    counters = {name: CounterMetricFamily(f"kvgate_kv_events_{name}", doc, labels=["model", "deployment"])
                for name, doc in KV_EVENT_COUNTERS.items()}
    for pool in registry.pools:
        feed = pool.policy.kv_feed
        if feed is None:
            continue
        size.add_metric([pool.name], len(feed.index))
        evicted.add_metric([pool.name], feed.index.evicted)
        tokenize_failures.add_metric([pool.name], feed.tokens.failures)
        for name, stream in feed.streams.items():
            held.add_metric([pool.name, name], feed.index.blocks_of(name))
            for field, family in counters.items():
                family.add_metric([pool.name, name], getattr(stream.stats, field))
    yield from (size, evicted, held, tokenize_failures, *counters.values())


CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "num_gpu_blocks")  # vLLM's names for them


def _cache_config_info(registry):
    """vLLM's `vllm:cache_config_info` (value 1, the KV cache's configuration as labels) for every
    backend that reports one, so dashboards and routers can read each engine's capacity."""
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the engine's KV cache configuration.",
                               labels=["model_name", "engine", *CACHE_CONFIG_LABELS])
    for d in registry.deployments():
        info = d.backend.load().info if d.started else {}
        if all(label in info for label in CACHE_CONFIG_LABELS):
            family.add_metric([d.model, d.name, *(str(info[label]) for label in CACHE_CONFIG_LABELS)], 1.0)
    yield family


# vLLM's label names of vllm:lora_requests_info (vllm/v1/metrics/loggers.py), in its order
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


def _lora_requests_info(registry):
    """vLLM's `vllm:lora_requests_info` for every deployment serving LoRA adapters: its labels say
    `max_lora` and the adapters of waiting and of running requests (comma-joined), the value is
    when it was read (unix seconds: vLLM's set_to_current_time), so llm-d's lora-affinity scorer
    reads kvgate's engines as it reads vLLM's. `model_name` and `engine` tell this gateway's
    engines apart, as on the other vllm: series here."""
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=[*LORA_INFO_LABELS, "model_name", "engine"])
    now = time.time()
    for d in registry.deployments():
        lora = d.backend.load().lora if d.started else None
        if lora is not None:
            family.add_metric([str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running), d.model, d.name],
                              now)
    yield family


def _engines_reporting(registry, key: str) -> list:
    """(deployment, its load) of each started deployment whose load's extra has `key`."""
    loads = ((d, d.backend.load()) for d in registry.deployments() if d.started)
    return [(d, load) for d, load in loads if key in load.extra]


def _engine_metrics(registry):
    """Only backends that report engine counters (the native engine) appear here."""
    engines = _engines_reporting(registry, "num_steps")
    for ours, vllm_name, help_text, kind, key in ENGINE_SERIES:
        names = [ours] + ([vllm_name] if vllm_name else [])
        for name in names:
            labels = ["model", "deployment"] if name == ours else ["model_name", "engine"]
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_text, labels=labels)
            for d, load in engines:
                value = getattr(load, key) if key in ("running", "waiting", "kv_cache_usage") else load.extra.get(key, 0.0)
                family.add_metric([d.model, d.name], float(value))
            yield family


# Speculative decoding (vLLM v1's names and labels): (our name, vLLM's name, help, key in extra)
SPEC_DECODE_SERIES = (
    ("kvgate_engine_spec_decode_drafts", "vllm:spec_decode_num_drafts",
     "Speculative verifications (a request's step that carried drafts).", "spec_decode_num_drafts"),
    ("kvgate_engine_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens",
     "Draft tokens proposed and verified.", "spec_decode_num_draft_tokens"),
    ("kvgate_engine_spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
     "Draft tokens accepted (not counting the token the target adds).", "spec_decode_num_accepted_tokens"),
)
SPEC_PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos_pos_"  # + j, flattened by the native plugin


# Prefill/decode disaggregation in the engines (kv_role): (our name, help, kind, key in extra)
KV_TRANSFER_SERIES = (
    ("kvgate_engine_kv_transfers", "Consumer: reads of a producer's KV blocks completed.", "counter", "kv_transfers"),
    ("kvgate_engine_kv_transfer_failures", "Consumer: reads of a producer's KV blocks that failed (refused, timed "
     "out, producer gone): the prompt was recomputed.", "counter", "kv_transfer_failures"),
    ("kvgate_engine_kv_transfer_tokens", "Consumer: prompt tokens whose KV was read from producers.", "counter",
     "kv_transfer_tokens"),
    ("kvgate_engine_requests_waiting_for_remote_kv", "Consumer: requests admitted and reading their prompt's KV.",
     "gauge", "num_waiting_for_remote_kv"),
    ("kvgate_engine_kv_blocks_held", "Producer: KV blocks of finished prefills held for decode engines.", "gauge",
     "kv_blocks_held"),
    ("kvgate_engine_kv_transfers_served", "Producer: reads of held blocks served.", "counter", "kv_transfers_served"),
    ("kvgate_engine_kv_transfers_refused", "Producer: reads refused (stale or forged params: unknown request, "
     "block ids or hashes, another engine's id, another KV layout; or over kv_transfer_max_connections).",
     "counter", "kv_transfers_refused"),
    ("kvgate_engine_kv_holds_expired", "Producer: held blocks freed unread (kv_hold_timeout_s, or for room).",
     "counter", "kv_holds_expired"),
    ("kvgate_engine_kv_holds_released", "Producer: held blocks freed unread because the gateway released them "
     "(no decode engine would read them: the client left, every decode attempt failed, or the decode hop "
     "started without reading them).", "counter", "kv_holds_released"),
)
KV_TRANSFER_HISTOGRAMS = (  # (name, help, key of the sum; + _histogram_pos_j counts, _buckets_pos_j bounds)
    ("kvgate_engine_kv_transfer_bytes", "Consumer: bytes of each completed read of a prompt's KV.", "kv_transfer_bytes"),
    ("kvgate_engine_kv_transfer_seconds", "Consumer: duration of each completed read of a prompt's KV.",
     "kv_transfer_seconds"),
)


def _kv_transfer_metrics(registry):
    """Only engines with a KV connector (their stats carry its histograms' bounds) appear here."""
    engines = [(d, load.extra) for d, load in _engines_reporting(registry, "kv_transfer_bytes_buckets_pos_0")]
    for name, help_text, kind, key in KV_TRANSFER_SERIES:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            name, help_text, labels=["model", "deployment"])
        for d, extra in engines:
            family.add_metric([d.model, d.name], extra.get(key, 0.0))
        yield family
    for name, help_text, key in KV_TRANSFER_HISTOGRAMS:
        family = HistogramMetricFamily(name, help_text, labels=["model", "deployment"])
        for d, extra in engines:
            family.add_metric([d.model, d.name], _cumulative_buckets(extra, key), extra.get(key, 0.0))
        yield family


def _cumulative_buckets(extra: dict, key: str) -> list[tuple[str, float]]:
    """An engine's histogram (counts per bucket, flattened as <key>_histogram_pos_j, with the
    bounds as <key>_buckets_pos_j) as Prometheus' cumulative (le, count) pairs, +Inf last."""
    bounds, counts, j = [], [], 0
    while f"{key}_buckets_pos_{j}" in extra:
        bounds.append(extra[f"{key}_buckets_pos_{j}"])
        j += 1
    for j in range(len(bounds) + 1):
        counts.append(extra.get(f"{key}_histogram_pos_{j}", 0.0))
    running, pairs = 0.0, []
    for bound, count in zip([*map(repr, bounds), "+Inf"], counts):
        running += count
        pairs.append((bound, running))
    return pairs


def _spec_decode_metrics(registry):
    """Only engines running speculative decoding (k > 0 in their stats) appear here, as in vLLM."""
    engines = []
    for d in registry.deployments():
        if d.started:
            load = d.backend.load()
            if load.extra.get("spec_decode_num_speculative_tokens", 0) > 0:
                engines.append((d, load.extra))
    for ours, vllm_name, help_text, key in SPEC_DECODE_SERIES:
        for name, labels in ((ours, ["model", "deployment"]), (vllm_name, ["model_name", "engine"])):
            family = CounterMetricFamily(name, help_text, labels=labels)
            for d, extra in engines:
                family.add_metric([d.model, d.name], extra.get(key, 0.0))
            yield family
    help_text = "Draft tokens accepted at each position of the drafts (position 0 first)."
    for name, labels in (("kvgate_engine_spec_decode_accepted_tokens_per_pos", ["model", "deployment", "position"]),
                         ("vllm:spec_decode_num_accepted_tokens_per_pos", ["model_name", "engine", "position"])):
        family = CounterMetricFamily(name, help_text, labels=labels)
        for d, extra in engines:
            for position in range(int(extra["spec_decode_num_speculative_tokens"])):
                family.add_metric([d.model, d.name, str(position)], extra.get(f"{SPEC_PER_POS_KEY}{position}", 0.0))
        yield family
