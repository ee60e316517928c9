"""The gateway's YAML config, validated into typed models.

Unknown keys are rejected, and every error names the path of the bad field and, when the YAML
node is known, its file and line: `models[0].deployments[1].backend: field required (x.yaml:12)`.
Each subsystem is handed its own sub-config, never the root.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestLimits(StrictModel):
    """Bounds on what one request may ask for; requests over them get a 400 (413 for the body)."""

    max_body_bytes: int = Field(1_048_576, gt=0, description="Largest request body, in bytes.")
    max_tokens: int = Field(4096, gt=0, description="Largest max_tokens a request may ask for.")
    max_n: int = Field(8, gt=0, description="Largest n (choices per request).")
    max_stop: int = Field(4, ge=0, description="Most stop strings per request.")
    max_top_logprobs: int = Field(20, ge=0, description="Largest top_logprobs / logprobs.")
    max_messages: int = Field(256, gt=0, description="Most chat messages per request.")
    max_input_items: int = Field(1024, gt=0, description="Most Responses input items, or Anthropic content "
                                 "blocks across a request's messages (each becomes part of a chat message).")
    max_tool_calls: int = Field(256, gt=0, description="Most tool calls in one request's conversation (chat "
                                "tool_calls, Responses function_call items, Anthropic tool_use blocks).")
    # A request's total work: what one body can make the backends do.
    max_prompts: int = Field(32, gt=0, description="Most prompts in one completions request.")
    max_choices: int = Field(64, gt=0, description="Most choices per request: n x the number of prompts.")
    max_prompt_tokens: int = Field(65536, gt=0, description="Most token ids across the token-id prompts of "
                                   "one request (text is bounded by max_body_bytes; each prompt by the context).")
    max_stop_token_ids: int = Field(64, ge=0, description="Most stop_token_ids per request.")
    max_stop_chars: int = Field(256, gt=0, description="Longest stop string, in characters.")
    max_json_depth: int = Field(32, gt=0, description="Deepest nesting of arrays and objects in a body.")
    # Tools, structured outputs, vendor fields and embeddings: what they may add to one request.
    max_tools: int = Field(128, ge=0, description="Most tools (functions) in one request.")
    max_tool_bytes: int = Field(32768, gt=0, description="Largest tool definition (name, description and "
                                "parameters schema), in bytes of JSON.")
    max_schema_bytes: int = Field(65536, gt=0, description="Largest JSON schema (response_format, a tool's "
                                  "parameters), in bytes of JSON.")
    max_schema_depth: int = Field(16, gt=0, description="Deepest nesting of objects and arrays inside one JSON "
                                  "schema.")
    max_extra_fields: int = Field(16, ge=0, description="Most vendor fields (forwarded verbatim to deployments "
                                  "that accept them) in one request.")
    max_extra_bytes: int = Field(65536, gt=0, description="Largest vendor field value, in bytes of JSON.")
    # Grammars of structured outputs and tool calls, where a backend compiles them itself (native):
    # a pathological constraint cannot hold its engine. Read when the deployment is built.
    max_grammar_bytes: int = Field(1_048_576, gt=0, description="Largest output constraint an engine compiles: "
                                   "a JSON schema, regex, choice list or grammar, or the grammar made from a "
                                   "request's tools (all of their parameter schemas), in bytes.")
    grammar_compile_timeout_s: float = Field(10.0, gt=0, description="Seconds a constraint may take to compile; "
                                             "then its request is a 400 naming the parameter.")
    grammar_cache_size: int = Field(128, gt=0, description="Compiled constraints an engine keeps (the most "
                                    "recently used): the same schema again does not compile again.")
    max_embedding_inputs: int = Field(256, gt=0, description="Most inputs in one embeddings request.")
    max_embedding_input_chars: int = Field(65536, gt=0, description="Longest text input of an embeddings or "
                                           "tokenize request, in characters.")


def check_networks(cidrs: list[str] | None) -> list[str] | None:
    """Each entry a network such as 10.0.0.0/8 (a bare address is a /32 or /128)."""
    for cidr in cidrs or ():
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ValueError(f"'{cidr}' is not a network (e.g. 10.0.0.0/8)") from None
    return cidrs


class ConnectionLimits(StrictModel):
    """What one client connection may hold (per gateway process): slow clients are cut off."""

    head_timeout_s: float = Field(10.0, gt=0, description="Seconds a request's head (request line and "
                                  "headers) may take to arrive, from its first byte; then a 408 and the "
                                  "connection closes.")
    body_timeout_s: float = Field(60.0, gt=0, description="Seconds a request's body may take to arrive, "
                                  "from the end of its head; then the connection closes (with a 408).")
    max_connections: int = Field(4096, gt=0, description="Open client connections at most, per process; "
                                 "one more is closed at once.")


class ServerConfig(StrictModel):
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0: any free port).")
    limits: RequestLimits = RequestLimits()
    connections: ConnectionLimits = ConnectionLimits()
    trusted_proxies: list[str] = Field(
        default_factory=list, description="Networks (CIDRs) of proxies whose X-Forwarded-Proto is believed "
        "(a TLS-terminating ingress): the status page's session cookie is then Secure.")

    _networks = field_validator("trusted_proxies")(classmethod(lambda cls, cidrs: check_networks(cidrs)))
    log_level: str = Field("info", description="uvicorn/gateway log level.")
    readiness: Literal["all", "any"] = Field(
        "all", description="/health/ready is 200 when every deployment is up (all), or when every "
        "model has at least one (any: for gateways in front of many engine replicas).")
    shutdown_timeout_s: float = Field(
        30.0, gt=0, description="On SIGTERM, seconds in-flight requests get to finish before they are cut.")


HOSTNAME = re.compile(r"^(?=.{1,254}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)*\.?$")


class DiscoveryConfig(StrictModel):
    """A set of endpoints found at run time: every A/AAAA record of `dns` is one member (a
    Kubernetes headless Service lists one per ready pod). Each member gets the deployment's
    settings with `base_url` = scheme://address:port + path."""

    dns: str = Field(description="DNS name to resolve, e.g. engines.llm.svc.cluster.local. (a trailing dot "
                     "skips the search domains).")
    port: int = Field(ge=1, le=65535, description="TCP port of every member.")
    scheme: Literal["http", "https"] = Field(
        "http", description="URL scheme of the members (https: their certificates must name their IP addresses, "
        "which is what the gateway connects to).")
    path: str = Field("/v1", description="Appended to scheme://address:port to make each member's base_url.")
    refresh_s: float = Field(5.0, ge=0.05, description="Seconds between two resolutions.")
    timeout_s: float = Field(2.0, gt=0, description="Seconds a resolution, and a member's health check, may take.")
    health_path: str | None = Field(
        "/health", description="GET here must answer 2xx before a new member is routable (kvgate engines: "
        "/health/ready); null: routable once its backend has started.")
    resolver: str | None = Field(
        None, description="DNS server as host:port (tests, a non-default resolver); default: /etc/resolv.conf.")
    allowed_cidrs: list[str] | None = Field(
        None, description="Networks a member's address must be in (members are sent the deployment's key). "
        "Default: any address but loopback, link-local (169.254.0.0/16: cloud metadata), unspecified and "
        "multicast ones.")
    max_members: int = Field(64, gt=0, description="Most members; a larger answer is cut (lowest addresses "
                             "kept), with a warning and the metric kvgate_discovery_addresses_dropped.")
    remember_s: float = Field(60.0, ge=0, description="Seconds a member is remembered after it left DNS and "
                              "drained: one back within them keeps its circuit breaker's state.")

    _networks = field_validator("allowed_cidrs")(classmethod(lambda cls, cidrs: check_networks(cidrs)))

    @field_validator("dns")
    @classmethod
    def _hostname(cls, name: str) -> str:
        if not HOSTNAME.match(name):
            raise ValueError(f"'{name}' is not a DNS name")
        return name

    @field_validator("path", "health_path")
    @classmethod
    def _url_path(cls, path: str | None) -> str | None:
        if path and not path.startswith("/"):
            raise ValueError("must start with /")
        return path.rstrip("/") if path else path

    @field_validator("resolver")
    @classmethod
    def _host_port(cls, resolver: str | None) -> str | None:
        if resolver is not None:
            resolver_address(resolver)
        return resolver


def resolver_address(resolver: str) -> tuple[str, int]:
    """'127.0.0.1:53', '[::1]:5353' -> (ip, port); ValueError with the reason otherwise."""
    host, sep, port = resolver.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"'{resolver}' is not an IP address and port (host:port, [v6]:port)") from None
    if not sep or not 1 <= number <= 65535:
        raise ValueError(f"'{resolver}': the port must be 1..65535")
    return host, number


class DeploymentConfig(StrictModel):
    """One backend instance that can serve a model, or with `discovery`, one per DNS address."""

    name: str = Field(description="Unique within its model; shown in logs and metrics. Discovered members "
                      "are named name@address.")
    backend: str = Field(description="Backend kind registered by a plugin (e.g. echo, native).")
    upstream_model: str | None = Field(
        None, description="Model name the backend knows; defaults to the model's name."
    )
    weight: float = Field(1.0, gt=0, description="Relative share for weighted policies.")
    settings: dict[str, Any] = Field(
        default_factory=dict, description="Backend-specific settings, validated by its plugin."
    )
    discovery: DiscoveryConfig | None = Field(
        None, description="Find this deployment's endpoints in DNS at run time instead of settings.base_url.")
    role: Literal["colocated", "prefill", "decode"] = Field(
        "colocated", description="Prefill/decode disaggregation: prefill deployments compute prompts' KV and hand "
        "it to decode deployments, which generate (see disaggregation); colocated ones do both.")

    @field_validator("name")
    @classmethod
    def _no_member_marker(cls, name: str) -> str:
        if "@" in name:
            raise ValueError("'@' is reserved for discovered members (name@address)")
        return name

    @model_validator(mode="after")
    def _discovery_sets_the_endpoint(self):
        if self.discovery is not None and "base_url" in self.settings:
            raise ValueError("settings.base_url: discovery sets each member's base_url; remove it")
        return self


class QueueConfig(StrictModel):
    """The pool's bounded admission queue (requests wait here while every deployment is busy)."""

    max_size: int = Field(64, ge=0, description="Most requests waiting in the gateway for this pool.")
    max_in_flight_per_deployment: int = Field(
        0, ge=0, description="Requests the gateway sends one deployment at once; 0: no gateway cap."
    )


class SaturationConfig(StrictModel):
    """When a deployment counts as saturated (Inference Extension defaults: queue 5, KV 0.8)."""

    max_waiting: int = Field(5, ge=0, description="Requests queued inside the backend.")
    max_kv_cache_usage: float = Field(0.8, gt=0, le=1, description="Fraction of KV-cache blocks in use.")


class TimeoutConfig(StrictModel):
    first_token_s: float = Field(60.0, gt=0, description="Seconds to wait for a backend's first token.")
    idle_s: float = Field(60.0, gt=0, description="Seconds allowed between two tokens of a stream.")


class DisaggregationConfig(StrictModel):
    """How a model with prefill and decode deployments (`role`) splits a request between them."""

    min_prompt_chars: int = Field(
        0, ge=0, description="Prompts shorter than this (characters of prompt text or message contents; token "
        "ids count one each) skip the prefill hop: the decode pool serves them colocated.")


class BreakerConfig(StrictModel):
    failures: int = Field(5, ge=1, description="Consecutive failures that take a deployment out.")
    cooldown_s: float = Field(10.0, gt=0, description="Seconds out before one probe request is let in.")


class ResponseCacheConfig(StrictModel):
    """An exact cache of this model's answers (opt in): a repeated deterministic request is answered
    from it without a backend."""

    ttl_s: float = Field(300.0, gt=0, description="Seconds an answer is kept.")
    max_bytes: int = Field(64 * 2**20, gt=0, description="memory: the most the entries take (least recently used "
                           "go first); both stores: an entry larger than this is not kept.")
    store: Literal["memory", "redis"] = Field("memory", description="redis: auth.limits_store's Redis, shared "
                                              "by replicas (eviction by Redis's own maxmemory-policy).")
    scope: Literal["key", "team", "shared"] = Field(
        "key", description="Who shares entries: each key alone, the keys of a team, or every caller.")
    tools: bool = Field(False, description="Also cache requests that offer tools (a tool call may have side effects "
                        "the client wants each time).")
    count_hits: bool = Field(False, description="Charge a hit's tokens to the key's tokens_per_minute and budgets "
                             "(default: a hit costs 0 tokens; it still counts as a request).")


class ModelConfig(StrictModel):
    name: str = Field(description="The model name clients send.")
    aliases: list[str] = Field(default_factory=list, description="Other names for this model.")
    policy: str = Field("least_loaded", description="Routing policy (a registered name).")
    policy_options: dict[str, Any] = Field(default_factory=dict, description="Options for the policy.")
    fallback: str | None = Field(None, description="Model to try when every deployment fails.")
    queue: QueueConfig = QueueConfig()
    saturation: SaturationConfig = SaturationConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    breaker: BreakerConfig = BreakerConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    cache: ResponseCacheConfig | None = Field(None, description="An exact response cache (off by default).")
    deployments: list[DeploymentConfig] = Field(min_length=1)

    @field_validator("deployments")
    @classmethod
    def _unique_deployment_names(cls, deployments: list[DeploymentConfig]):
        seen: set[str] = set()
        for d in deployments:
            if d.name in seen:
                raise ValueError(f"duplicate deployment name '{d.name}'")
            seen.add(d.name)
        return deployments

    @field_validator("deployments")
    @classmethod
    def _roles_pair_up(cls, deployments: list[DeploymentConfig]):
        """Prefill deployments need decode deployments to hand their KV to, and the reverse; a
        colocated deployment beside them would be neither (one model, one way of serving)."""
        roles = {d.role for d in deployments}
        if roles == {"colocated"}:
            return deployments
        if "colocated" in roles:
            raise ValueError("a model's deployments are either all colocated or each prefill or decode "
                             "(set role on every deployment)")
        missing = {"prefill", "decode"} - roles
        if missing:
            raise ValueError(f"a model with role {next(iter(roles - missing))} deployments needs a "
                             f"{missing.pop()} deployment too")
        return deployments

    @model_validator(mode="after")
    def _precise_prefix_can_follow(self):
        """precise_prefix reads each deployment's KV events from one endpoint its settings name;
        a deployment discovered in DNS (a chart's engines[] group) is many pods, each publishing
        its own, which the gateway does not subscribe to: the policy would silently route by
        prefix affinity forever. Said here rather than found in a routing trace."""
        if self.policy != "precise_prefix":
            return self
        for d in self.deployments:
            if d.discovery is not None:
                raise ValueError(
                    f"policy precise_prefix: deployment '{d.name}' is discovered in DNS (discovery.dns, e.g. a "
                    "chart's engines[] group); the gateway does not subscribe to discovered pods' KV events, "
                    "so precise_prefix could only route by prefix affinity there: use policy prefix_affinity")
        return self

    @property
    def disaggregated(self) -> bool:
        return any(d.role != "colocated" for d in self.deployments)


class SlaClass(StrictModel):
    name: str
    priority: int = Field(description="Lower runs earlier, in the gateway queue and in the engine.")
    max_queue_wait_s: float = Field(30.0, gt=0, description="Seconds a request may wait for admission.")
    ttft_target_s: float | None = Field(None, gt=0, description="Time-to-first-token target, seconds.")
    tpot_target_s: float | None = Field(None, gt=0, description="Time per output token target, seconds.")
    sheddable: bool = Field(False, description="Refused first when the pool is saturated.")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256, description="Keep this class's prompts apart in engines' prefix caches "
        "(vLLM's cache_salt): per_key, a salt of each key's own, or a fixed string that the class's keys share. "
        "A key's own cache_salt wins over its class's.")


DEFAULT_SLA_CLASSES = (
    SlaClass(name="interactive", priority=0, max_queue_wait_s=10.0),
    SlaClass(name="standard", priority=5, max_queue_wait_s=30.0),
    SlaClass(name="batch", priority=10, max_queue_wait_s=120.0, sheddable=True),
)


class ApiKeyConfig(StrictModel):
    """One client key. The secret comes from `key_env` (an env var) or `key` (keep such a file
    out of version control); it is never logged."""

    name: str = Field(description="Shown in logs and metrics instead of the key.")
    team: str | None = Field(None, description="The team the key belongs to: team budgets count every key of it.")
    key: str | None = Field(None, min_length=8, repr=False)
    key_env: str | None = Field(None, description="Environment variable holding the key.")
    models: list[str] = Field(default_factory=lambda: ["*"], description="Allowed models; '*' for all.")
    sla_class: str | None = Field(None, description="Default SLA class of this key's requests.")
    sla_classes: list[str] = Field(
        default_factory=list,
        description="SLA classes this key may ask for with x-sla-class ('*': any). Default: none but its "
        "own default class (sla_class, else default_sla_class): a key opts in to the others. Another class "
        "is refused with 403, never lowered silently.")
    requests_per_minute: int | None = Field(None, gt=0)
    scopes: list[Literal["metrics", "kv_transfer"]] = Field(
        default_factory=list, description="metrics: may also read /metrics, /status and /status.json for "
        "every model (a monitoring key); other keys see only their models there, and no /metrics. "
        "kv_transfer: its requests' kv_transfer_params reach the backend and the answer's come back (the key "
        "of a gateway whose prefill/decode hops this server's engine serves); everyone else's are dropped.")
    tokens_per_minute: int | None = Field(None, gt=0, description="Prompt + completion tokens.")
    max_concurrency: int | None = Field(None, gt=0, description="Requests in flight at once.")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256, description="Keep this key's prompts apart from other tenants' in "
        "engines' prefix caches (vLLM's cache_salt), whatever its clients send: per_key, a salt of its own "
        "derived from the key; or a fixed string, shared by the keys that name it (a team). Its deployments must "
        "accept cache_salt (vllm, kvgate, native): elsewhere its requests are refused rather than sent unsalted.")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.key is None) == (self.key_env is None):
            raise ValueError("give exactly one of key and key_env")
        return self


class LimitsStoreConfig(StrictModel):
    """Where per-key limits are counted: in this process, or in a Redis shared by every replica."""

    kind: Literal["memory", "redis"] = Field(
        "memory", description="memory: each gateway counts alone; redis: all gateways share one budget per key.")
    url_env: str | None = Field(None, description="Environment variable holding the Redis URL (redis://host:6379/0).")
    password_env: str | None = Field(None, description="Environment variable holding the Redis password, "
                                     "for a URL without one (the chart's Redis: the URL is not secret, this is).")
    key_prefix: str = Field("kvgate", description="Prefix of the Redis keys (gateways sharing budgets share it).")
    timeout_s: float = Field(0.5, gt=0, description="Seconds a Redis call may take before the gateway "
                             "falls back to local limits.")

    @model_validator(mode="after")
    def _redis_needs_url(self):
        if self.kind == "redis" and not self.url_env:
            raise ValueError("url_env is required when kind is redis")
        return self


class ModelPrice(StrictModel):
    """What a model's tokens cost, for budgets in money (any currency: budgets say `unit: money`)."""

    input_per_million: float = Field(0.0, ge=0, description="Price of a million prompt tokens.")
    output_per_million: float = Field(0.0, ge=0, description="Price of a million completion tokens.")
    cached_input_per_million: float | None = Field(
        None, ge=0, description="Price of a million prompt tokens read from a prefix cache (default: input's).")


class TokenWeights(StrictModel):
    """Weights of `unit: weighted_tokens` (Envoy AI Gateway's costExpression, as weights)."""

    input: float = Field(1.0, ge=0, description="Per prompt token not served from a prefix cache.")
    output: float = Field(1.0, ge=0, description="Per completion token.")
    cached_input: float | None = Field(None, ge=0, description="Per cached prompt token (default: input's).")


class BudgetConfig(StrictModel):
    """One budget: a limit on cumulative use in a window, for a key, a team, or each key/team ('*')."""

    name: str = Field(description="Named in refusals, headers, metrics and /key/info.")
    key: str | None = Field(None, description="The key it applies to ('*': each key on its own).")
    team: str | None = Field(None, description="The team it applies to ('*': each team on its own).")
    models: list[str] | None = Field(None, description="Only requests of these models count (default: all).")
    unit: Literal["tokens", "input_tokens", "output_tokens", "weighted_tokens", "money"] = Field(
        "tokens", description="tokens: prompt + completion; money: from budgets.prices.")
    weights: TokenWeights = TokenWeights()
    limit: float = Field(gt=0, description="The most the window may use, in `unit`.")
    window: Literal["day", "month", "rolling"] = Field(
        "month", description="day / month: calendar windows in UTC starting at reset_at (month: on day 1); "
        "rolling: the last period_s seconds.")
    reset_at: str = Field("00:00", pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$",
                          description="UTC time of day a calendar window starts (HH:MM).")
    period_s: float | None = Field(None, gt=0, description="Length of a rolling window, seconds.")
    soft_limit: float | None = Field(0.8, gt=0, le=1, description="Fraction of the limit past which answers carry "
                                     "x-kvgate-budget-warning and kvgate_budget_soft_limit_total counts.")
    shadow: bool = Field(False, description="Count and warn, never refuse (to roll a budget out safely).")

    @model_validator(mode="after")
    def _one_subject(self):
        if (self.key is None) == (self.team is None):
            raise ValueError("give exactly one of key and team")
        if (self.window == "rolling") != (self.period_s is not None):
            raise ValueError("period_s is for window: rolling, and required there")
        return self


class BudgetsConfig(StrictModel):
    """Cumulative budgets per key and team; counted where `store` says (default: auth.limits_store)."""

    limits: list[BudgetConfig] = Field(default_factory=list, description="The budgets; a request passes when "
                                       "every one that applies to it has room.")
    prices: dict[str, ModelPrice] = Field(default_factory=dict, description="Per model name: its token prices.")
    store: LimitsStoreConfig | None = Field(None, description="Where spend is counted (default: the limits store).")
    on_store_down: Literal["open", "closed"] = Field(
        "open", description="Redis unreachable: open admits, counting on this replica alone; closed refuses (503).")
    reservation_ttl_s: float = Field(3600.0, gt=0, description="A reservation a replica never settled (it died) "
                                     "stops counting after this many seconds.")
    usage_log: str | None = Field(None, description="A file to append one JSON line per settled request to.")

    @field_validator("limits")
    @classmethod
    def _unique_names(cls, budgets: list[BudgetConfig]):
        names = [b.name for b in budgets]
        if len(set(names)) != len(names):
            raise ValueError("two budgets share a name")
        return budgets


class AuthConfig(StrictModel):
    keys: list[ApiKeyConfig] = Field(default_factory=list)
    limits_store: LimitsStoreConfig = LimitsStoreConfig()
    keys_file_env: str | None = Field(
        None, description="Environment variable naming a YAML file with more keys (a list like `keys`)."
    )
    keys_file_poll_s: float = Field(5.0, gt=0, description="Seconds between two looks at the keys file: a "
                                    "change reloads the keys alone (a bad entry is left out and reported).")
    admin_key_env: str | None = Field(None, description="Environment variable holding the admin key.")


class TracingConfig(StrictModel):
    exporter: Literal["none", "console", "otlp_http", "otlp_grpc"] = Field(
        "none", description="Where spans go; none costs nothing on the hot path.")
    endpoint: str | None = Field(None, description="OTLP endpoint; for otlp_http include /v1/traces.")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra OTLP headers (e.g. auth).")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Fraction of new traces kept (parent-based).")
    service_name: str = "kvgate"


class TelemetryConfig(StrictModel):
    tracing: TracingConfig = TracingConfig()


class GatewayConfig(StrictModel):
    server: ServerConfig = ServerConfig()
    sla_classes: list[SlaClass] = Field(default_factory=lambda: list(DEFAULT_SLA_CLASSES))
    default_sla_class: str = Field("standard", description="Class of requests that name none.")
    auth: AuthConfig = AuthConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    budgets: BudgetsConfig = BudgetsConfig()
    models: list[ModelConfig] = Field(min_length=1)
    plugins: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-plugin sections, handed to each plugin as-is."
    )

    @model_validator(mode="after")
    def _unique_model_names(self):
        seen: set[str] = set()
        for model in self.models:
            for name in [model.name, *model.aliases]:
                if name in seen:
                    raise ValueError(f"model name or alias '{name}' is used twice")
                seen.add(name)
        return self

    @model_validator(mode="after")
    def _references_exist(self):
        classes = {c.name for c in self.sla_classes}
        if len(classes) != len(self.sla_classes):
            raise ValueError("sla_classes: two classes share a name")
        if self.default_sla_class not in classes:
            raise ValueError(f"default_sla_class: unknown class '{self.default_sla_class}'")
        names = {n for m in self.models for n in [m.name, *m.aliases]}
        for i, m in enumerate(self.models):
            if m.fallback is not None and (m.fallback not in names or m.fallback in [m.name, *m.aliases]):
                raise ValueError(f"models[{i}].fallback: '{m.fallback}' is not another model")
        for i, k in enumerate(self.auth.keys):
            check_key_classes(f"auth.keys[{i}]", k, classes, self.default_sla_class)
        self._budgets_name_models(names)
        for i, m in enumerate(self.models):
            if m.cache is not None and m.cache.store == "redis" and self.auth.limits_store.url_env is None:
                raise ValueError(f"models[{i}].cache.store: redis is auth.limits_store's Redis: set its kind and url_env")
        return self

    def _budgets_name_models(self, names: set[str]) -> None:
        """A budget names models the gateway serves, and one in money has a price for each."""
        pools = {n: m.name for m in self.models for n in [m.name, *m.aliases]}
        for name in self.budgets.prices:
            if name not in pools:
                raise ValueError(f"budgets.prices.{name}: not a model of this gateway")
        for i, b in enumerate(self.budgets.limits):
            for name in b.models or []:
                if name not in names:
                    raise ValueError(f"budgets.limits[{i}].models: '{name}' is not a model of this gateway")
            unpriced = [pools[n] for n in (b.models or pools) if pools[n] not in self.budgets.prices]
            if b.unit == "money" and unpriced:
                raise ValueError(f"budgets.limits[{i}]: unit money needs budgets.prices.{unpriced[0]}")

    def sla_class(self, name: str) -> SlaClass | None:
        return next((c for c in self.sla_classes if c.name == name), None)


def check_key_classes(where: str, key: ApiKeyConfig, classes: set[str], default_class: str) -> None:
    """A key's default class must exist and be one it may use (its requests without the header
    get it); every class it may use must exist."""
    for name in key.sla_classes:
        if name != "*" and name not in classes:
            raise ValueError(f"{where}.sla_classes: unknown class '{name}'")
    if key.sla_class is not None and key.sla_class not in classes:
        raise ValueError(f"{where}.sla_class: unknown class '{key.sla_class}'")
    default = key.sla_class or default_class
    if key.sla_classes and "*" not in key.sla_classes and default not in key.sla_classes:
        raise ValueError(f"{where}.sla_classes: the key's default class '{default}' is not among them "
                         "(set sla_class to one of them)")


class ConfigError(Exception):
    """A config that cannot be used; `problems` holds one line per bad field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"invalid config {source}:\n  " + "\n  ".join(problems))


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read file: {exc.strerror}"]) from None
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<config>") -> GatewayConfig:
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, ["the top level must be a mapping (server:, models:, plugins:)"])
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _describe_errors(exc, root_node, source)) from None


def _describe_errors(exc: ValidationError, root_node, source: str) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = format_path(loc) or "(top level)"
        message = problem_message(err)
        line = _line_of(root_node, loc)
        where = f" ({source}:{line})" if line else ""
        problems.append(f"{path}: {message}{where}")
    return problems


def problem_message(err: dict) -> str:
    """One pydantic error's message in check-config's words."""
    return "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")


def settings_error(exc: ValidationError, loc: Callable[[tuple], tuple] = tuple) -> ValueError:
    """A plugin's settings refused: the first problem, as `settings.<path>: <message>` (the path
    through `loc`, which may drop levels the YAML does not have), in check-config's words. A
    check of the settings as a whole names the key it is about at the start of its message."""
    err = exc.errors()[0]
    path, message = format_path(loc(tuple(err["loc"]))), problem_message(err)
    if path:
        return ValueError(f"settings.{path}: {message}")
    return ValueError(f"settings.{message}" if re.match(r"^\w+: ", message) else f"settings: {message}")


def format_path(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_of(node, loc) -> int | None:
    """1-based line of the deepest YAML node along `loc` that exists."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        node = _child(node, part)
        if node is None:
            break
        line = node.start_mark.line + 1
    return line


def _child(node, part):
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == part:
                return key if isinstance(value, yaml.ScalarNode) and value.value == "" else value
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]
    return None
