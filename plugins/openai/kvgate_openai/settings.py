"""What a deployment's `settings:` may hold for `backend: openai`."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.capabilities import ENDPOINTS, FEATURES, Capabilities
from gateway.config import settings_error
from kvgate_openai import servers
from kvgate_openai.servers import ServerKind

MetricsPreset = Literal["auto", "vllm", "sglang", "trtllm", "kvgate", "none"]


class CapabilityOverrides(BaseModel):
    """`settings.capabilities`: each list given replaces the server kind's default list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoints: list[str] | None = Field(None, description=f"Endpoints the upstream serves: {', '.join(ENDPOINTS)}.")
    features: list[str] | None = Field(None, description=f"Request features it honours: {', '.join(FEATURES)}.")
    extras: list[str] | None = Field(None, description="Vendor request fields forwarded to it verbatim ('*': any).")

    @field_validator("endpoints", "features")
    @classmethod
    def _known(cls, names: list[str] | None, info) -> list[str] | None:
        known = ENDPOINTS if info.field_name == "endpoints" else FEATURES
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise ValueError(f"unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
        return names


class KVEventsSettings(BaseModel):
    """Where the upstream engine publishes its KV events (vLLM's or SGLang's --kv-events-config,
    ZMQ publisher) and how it hashes blocks, for the gateway's precise_prefix index."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="ZMQ address of its PUB socket as reachable from the gateway, e.g. "
                          "tcp://vllm-0:5557 (the engine binds tcp://*:5557).")
    replay_endpoint: str | None = Field(None, description="ZMQ address of its replay ROUTER; null: none.")
    topic: str = Field("", description="Topic prefix to receive.")
    block_size: int = Field(16, gt=0, description="The engine's KV block size, tokens.")
    hash_seed: str = Field("0", description="The engine's PYTHONHASHSEED (it must hash with "
                           "--prefix-caching-hash-algo sha256_cbor).")
    bind: bool = Field(False, description="The engine connects to the gateway: the gateway binds endpoint.")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{value!r} is not a ZMQ address (tcp://, ipc:// or inproc://)")
        return value


class OpenAISettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(description="The upstream's OpenAI API root, e.g. http://vllm:8000/v1.")
    api_key_env: str | None = Field(
        None, description="Name of the environment variable that holds the upstream's API key."
    )
    connect_s: float = Field(5.0, gt=0, description="Seconds to open a TCP connection.")
    first_byte_s: float = Field(
        60.0, gt=0, description="Seconds from sending a request to its first token (queue + prefill); "
        "for a non-streaming client, to the whole answer, which comes in one piece."
    )
    idle_s: float = Field(30.0, gt=0, description="Longest gap between two stream chunks, in seconds.")
    max_connections: int = Field(256, gt=0, description="Size of the shared connection pool.")
    keepalive_expiry_s: float = Field(
        4.0, ge=0, description="Seconds an idle pooled connection is kept for reuse; keep it below the "
        "upstream's keep-alive timeout (uvicorn's, behind vLLM and SGLang, is 5 s); 0: no reuse."
    )
    max_event_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest stream event (SSE line) accepted from the upstream, in bytes."
    )
    max_body_bytes: int = Field(
        64 * 1024 * 1024, gt=0, description="Largest non-streamed answer accepted from the upstream, in bytes."
    )
    max_response_headers: int = Field(100, gt=0, description="Most headers in an upstream's response head.")
    max_response_head_bytes: int = Field(
        64 * 1024, gt=0, description="Largest upstream response head (header names and values), in bytes.")
    max_scrape_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest metrics answer read from the upstream, in bytes; a larger "
        "one is not read (no reading: routing falls back on in-flight counts).")
    capacity: int = Field(0, ge=0, description="Concurrent requests the upstream can run; 0: unknown.")
    max_model_len: int | None = Field(
        None, gt=0, description="The upstream model's context length in tokens (prompt + output), shown "
        "in /v1/models as vLLM shows it; unknown when unset."
    )
    metrics: MetricsPreset = Field(
        "auto", description="Which Prometheus names carry the upstream's load; none: in-flight counts only."
    )
    metrics_url: str | None = Field(
        None, description="Where to scrape; default: the base_url's origin + /metrics "
        "(/prometheus/metrics for trtllm)."
    )
    metrics_poll_s: float = Field(1.0, gt=0, description="Seconds between two scrapes.")
    metrics_stale_s: float | None = Field(
        None, gt=0, description="A scrape older than this is ignored; default: 3 poll intervals."
    )
    unhealthy_after: int = Field(
        3, gt=0, description="Consecutive failed scrapes or connections before the deployment is unhealthy."
    )
    lora_adapters: bool = Field(
        False, description="vLLM: read the upstream's LoRA adapters every metrics poll (its /v1/models entries "
        "with a parent, and vllm:lora_requests_info): each becomes a model of this deployment's pool, its "
        "requests go only to upstreams that list it, and lora_affinity routes by their slots.")
    server: ServerKind = Field(
        "openai", description="What kind of server the upstream is: openai (OpenAI itself, or an unknown kind), "
        "vllm, sglang, trtllm, llamacpp (llama-server), llama_cpp_python or kvgate. It sets the default "
        "capabilities (kvgate_openai/servers.py) and how /tokenize is asked.")
    capabilities: CapabilityOverrides | None = Field(
        None, description="What the upstream serves, where it differs from its kind's defaults.")
    chat_max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = Field(
        "max_tokens", description="Name of the output limit on chat requests (OpenAI's reasoning "
        "models only accept max_completion_tokens)."
    )
    kv_events: KVEventsSettings | None = Field(
        None, description="The upstream engine's KV events, for precise_prefix routing; none when absent.")

    @field_validator("base_url", "metrics_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is None:
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("must be an http:// or https:// URL")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _declared(self):
        self.declared()  # the kind's defaults with the overrides must make sense together
        return self

    def declared(self) -> Capabilities:
        o = self.capabilities or CapabilityOverrides()
        return servers.capabilities(self.server, o.endpoints, o.features, o.extras)

    @property
    def origin(self) -> str:
        """scheme://host:port of base_url: where vLLM's /tokenize and llama.cpp's extras live."""
        parts = urlsplit(self.base_url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def tokenize_dialect(self) -> str | None:
        return servers.TOKENIZE_DIALECTS.get(self.server)

    @property
    def stale_after_s(self) -> float:
        return self.metrics_stale_s or 3 * self.metrics_poll_s

    def scrape_url(self) -> str | None:
        if self.metrics == "none":
            return None
        if self.metrics_url:
            return self.metrics_url
        parts = urlsplit(self.base_url)
        # trtllm-serve 1.2.x serves JSON iteration stats at /metrics, Prometheus text here.
        path = "/prometheus/metrics" if self.metrics == "trtllm" else "/metrics"
        return f"{parts.scheme}://{parts.netloc}{path}"


def parse_settings(settings: dict, **defaults) -> OpenAISettings:
    """Validate; errors read `settings.<field>: <message>` (the gateway adds the deployment path)."""
    try:
        return OpenAISettings.model_validate({**defaults, **settings})
    except ValidationError as exc:
        raise settings_error(exc) from None
