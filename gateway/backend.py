"""The Backend protocol: the one seam between the gateway and every engine.

A backend plugin's backend class subclasses `Backend`. The gateway calls `generate` once per
choice of a request and reads the token events it yields; it calls `load()` on every routing
decision, so `load()` must be cheap (a cached snapshot, no I/O). Everything crossing this seam is
plain data: the dataclasses below, and the exceptions in `gateway.errors`.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, runtime_checkable

# Capabilities is re-exported: a plugin imports the whole seam from this module.
from gateway.capabilities import DEFAULT_CAPABILITIES, PLAIN_CHAT, Capabilities, Needs  # noqa: F401
from gateway.config import RequestLimits
from gateway.errors import InvalidRequestError


# vLLM's prefill/decode field (in requests and in answers): where a decode engine loads a
# prompt's KV from. Only the gateway sets it (gateway.dispatch.disagg; clients' are dropped by the schemas).
TRANSFER_PARAMS = "kv_transfer_params"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Defaults follow the OpenAI API."""

    max_tokens: int | None = None  # None: up to the model's context
    # True when the client named no max_tokens and `max_tokens` is the server's bound
    # (server.limits.max_tokens): a backend lowers it to what the context (and its cache) leave
    # for this prompt, vLLM's default, instead of refusing the request as too long.
    max_tokens_default: bool = False
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, never emitted in the output
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; k >= 0: logprob of the token plus k alternatives


@dataclass
class GenerationRequest:
    """One choice of one client request, as a backend sees it.

    Exactly one of `prompt` (text or token ids) and `messages` (chat) is set. Chat requests are
    templated by the backend, since only it knows the model's chat template.

    Messages are OpenAI chat messages as plain dicts, validated: `role` (system, user, assistant,
    tool), `content` (text; None on an assistant message that only calls tools), and where set
    `name`, `tool_calls` (assistant: [{id, type: "function", function: {name, arguments}}]) and
    `tool_call_id` (tool). The tool fields below are OpenAI's shapes, validated too. A request
    only reaches a backend whose capabilities cover `needs` (tools, response_format kinds,
    every `extra` field), so a backend never has to refuse one for lacking a feature it did not
    declare.
    """

    request_id: str
    model: str  # the model name the backend serves (the deployment's upstream name); a LoRA adapter: needs.adapter
    sampling: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    priority: int = 0  # lower runs earlier (vLLM's convention); SLA classes map onto it
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent/tracestate
    user: str | None = None
    # Whether the client streams. A backend may answer a non-streaming request in one event
    # (a remote server asked once, without SSE); it may also stream it anyway.
    stream: bool = True
    tools: list[dict] | None = None  # [{type: "function", function: {name, description?, parameters?, strict?}}]
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {type: "function", function: {name}}
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None  # {type: "json_object"} | {type: "json_schema", json_schema: {...}}
    reasoning_effort: str | None = None
    # Vendor fields the client sent and the gateway does not interpret (chat_template_kwargs,
    # structured_outputs, ...), forwarded verbatim by backends that declared them in `extras`.
    extra: dict[str, Any] = field(default_factory=dict)
    needs: Needs = PLAIN_CHAT  # what routing matched against the deployments' capabilities
    # A body in another API's shape that the backend declared it serves itself (`needs.endpoint`,
    # e.g. "responses"): sent as it is, with `model` set. `messages` then holds the same
    # conversation translated onto chat, for the books; the answer comes back in `TokenEvent.raw`.
    passthrough: dict | None = None
    # The client wants usage in every chunk (vLLM's stream_options.continuous_usage_stats): a
    # backend that can count as it goes sets `usage` on every event, not only on the last.
    continuous_usage: bool = False


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    token_id: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one generated token and its top alternatives."""

    token: str
    logprob: float
    token_id: int | None = None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of one tool call, as OpenAI streams them: the first fragment of call `index`
    carries its `id` and `name`, later ones only more `arguments` text (a JSON string, in pieces).
    A backend that has the whole call at once sends one fragment with everything."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """A step of output: new text, the token ids behind it, and, on the last event, why it ended.

    `finish_reason` is None until the last event, then one of "stop", "length", "abort",
    "tool_calls" (the model called tools: `tool_calls` fragments came before or with it),
    "content_filter". `usage` is set on the last event (the totals); it may be set on earlier ones
    too: the counts so far (the gateway's continuous usage stats show them). `reasoning` is the
    model's reasoning text (vLLM's and SGLang's `reasoning_content`), `refusal` a refusal message,
    both in pieces.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""
    refusal: str = ""
    # For a `passthrough` request: the upstream's answer as it came (SSE events, or the whole
    # JSON body), relayed to the client unchanged. `text`, `finish_reason` and `usage` still say
    # what it holds, for metrics and limits.
    raw: bytes = b""
    # On the last event, optionally: the backend's own milestones of this request as unix times
    # in seconds ("arrived", "scheduled", "first_token", "finished") and counters
    # ("prefill_chunks", "preemptions", "cached_tokens"; with speculative decoding "spec_drafts",
    # "spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate", ...). The gateway turns
    # them into spans.
    timings: dict[str, float] | None = None
    # On the last event of a prefill hop (gateway.dispatch.disagg: `extra` carried vLLM's
    # kv_transfer_params with do_remote_decode): what the engine returned for the decode side to
    # load the prompt's KV from it. The gateway hands it to the decode hop unread.
    kv_transfer_params: dict | None = None


def _plain_defaults(cls) -> dict:
    """Each field's default; a field with none (or a factory) has no place in token_event."""
    out = {}
    for f in fields(cls):
        if f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no plain default: token_event cannot fill it")
        out[f.name] = f.default
    return out


_EVENT_DEFAULTS = _plain_defaults(TokenEvent)


def token_event(text: str = "", token_ids: tuple[int, ...] = (), logprobs: tuple = (),
                finish_reason: str | None = None, usage: Usage | None = None, tool_calls: tuple = (),
                reasoning: str = "", refusal: str = "") -> TokenEvent:
    """TokenEvent(...) of these fields (the others at their defaults) for a third of the cost,
    for code that makes one per token: a frozen dataclass's __init__ sets each of its 11 fields
    through object.__setattr__, this fills the new instance's __dict__ in one update."""
    event = object.__new__(TokenEvent)
    event.__dict__.update(_EVENT_DEFAULTS, text=text, token_ids=token_ids, logprobs=logprobs,
                          finish_reason=finish_reason, usage=usage, tool_calls=tool_calls, reasoning=reasoning,
                          refusal=refusal)
    return event


@dataclass(frozen=True)
class LoRAState:
    """A backend's LoRA adapters now: every adapter it can run (name -> its directory, /v1/models'
    `root`), `max_loras` adapters at once in a batch, and the adapters of its running and waiting
    requests (vLLM's `vllm:lora_requests_info` labels: what `lora_affinity` routes by)."""

    max_loras: int = 0
    adapters: dict[str, str] = field(default_factory=dict)
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadSnapshot:
    """A cheap view of how busy a backend is, used for routing and shedding."""

    waiting: int = 0  # requests queued inside the backend
    running: int = 0  # requests being generated
    kv_cache_usage: float = 0.0  # 0..1 fraction of KV-cache blocks in use
    capacity: int = 0  # concurrent requests it can run; 0 means unknown
    healthy: bool = True  # False once the backend knows it cannot serve (engine died, restarting)
    extra: dict[str, float] = field(default_factory=dict)  # engine counters (prefix hits, ...)
    # What does not change while it runs, as text (the KV cache's block_size, cache_dtype,
    # num_gpu_blocks): exported as labels of info-style metrics. /v1/models shows "root" (the
    # model served: a file, a directory or an upstream's name), "max_model_len" (the context
    # length in tokens, prompt and output) and "weights" (how they are stored) when given.
    info: dict[str, str] = field(default_factory=dict)
    problem: str | None = None  # why it is not healthy, for operators (status page, readiness body)
    # True when it cannot recover by itself (an engine in a crash loop): the gateway's liveness
    # probe then fails, so the orchestrator restarts the whole process.
    fatal: bool = False
    # Which serving process this is: a backend that replaces a dead one (an engine restart) counts
    # up, and the gateway's breaker then forgets the failures charged to the process that is gone.
    incarnation: int = 0
    # Its LoRA adapters, for a backend that serves them (None: it serves none; an empty
    # LoRAState: it could, none is loaded). The gateway names them as models of the deployment's pool.
    lora: LoRAState | None = None


@dataclass(frozen=True)
class KVEventsSource:
    """Where a deployment's engine publishes its KV events (vLLM's format: ZMQ PUB, msgpack
    batches with sequence numbers) and how it hashes blocks, so the gateway can hash prompts the
    same way. `bind`: the engine connects to the gateway, whose subscriber then binds `endpoint`."""

    endpoint: str  # ZMQ address the gateway subscribes to, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str | None = None  # ZMQ ROUTER resending buffered batches; None: none
    topic: str = ""  # prefix of the topics to receive
    block_size: int = 16  # tokens per KV block, as the engine counts them
    hash_seed: str = "0"  # the engine's prefix-hash seed (vLLM: PYTHONHASHSEED, sha256_cbor)
    bind: bool = False


@dataclass
class EmbeddingRequest:
    """One /v1/embeddings request: each input is text or token ids; the answer has one vector
    of floats per input, in order (the gateway encodes them as the client asked)."""

    request_id: str
    model: str
    inputs: list[str | list[int]]
    dimensions: int | None = None  # cut each vector to this size (Matryoshka models), where supported
    user: str | None = None
    priority: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # vendor fields, as for GenerationRequest
    needs: Needs = Needs("embeddings")
    stream: bool = False


@dataclass(frozen=True)
class EmbeddingResult:
    embeddings: list[list[float]]
    prompt_tokens: int


@dataclass
class TokenizeRequest:
    """POST /tokenize in vLLM's two forms: `prompt` (text), or `messages` (chat, templated with
    the model's chat template). `add_special_tokens` None means the form's default (true for a
    prompt, false for messages, whose template adds them)."""

    request_id: str
    model: str
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict] | None = None  # offered to the chat template, as in a chat request
    priority: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    needs: Needs = Needs("tokenize")
    stream: bool = False


@dataclass(frozen=True)
class TokenizeResult:
    tokens: list[int]
    max_model_len: int | None = None  # None: the backend does not know it
    token_strs: list[str] | None = None


@dataclass
class DetokenizeRequest:
    request_id: str
    model: str
    tokens: list[int]
    priority: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)
    needs: Needs = Needs("tokenize")
    stream: bool = False


@runtime_checkable
class Backend(Protocol):
    """What every backend plugin provides: a plugin's backend class subclasses this one.

    Five members every backend defines: `start`, `stop`, `generate`, `abort` and `load`. The rest
    are optional: each has a default here, which a backend overrides when it does more. The
    gateway calls every member directly (never looks one up by name), so a backend that does not
    subclass `Backend` is refused when its deployment is built.

    `generate` raises an exception from `gateway.errors` *before the first event* when it refuses
    a request (bad input, context too long, overloaded), and may raise `BackendError` later when it
    fails mid-stream. Cancelling the iteration (client went away) must free the request's
    resources; the gateway also calls `abort(request_id)`. The optional members embed, tokenize
    and detokenize raise the same errors as `generate`.
    """

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> LoadSnapshot:
        """Called on every routing decision: cheap (a cached snapshot, no I/O)."""
        ...

    # ---------------------------------------------------------------- optional, with defaults

    def capabilities(self) -> Capabilities:
        """The endpoints, request features and vendor fields this backend serves
        (gateway.capabilities); the gateway sends it only requests those cover. One that declares
        "responses" serves OpenAI's Responses API itself: `generate` then gets requests with
        `passthrough` (the client's body) and answers with events whose `raw` is that API's own
        answer, with text, finish_reason and usage filled in for the books; requests to other
        backends are translated onto chat (gateway.translate), as are all Messages requests.
        Default: chat and completions with logprobs and n."""
        return DEFAULT_CAPABILITIES

    def use_limits(self, limits: RequestLimits) -> None:
        """Called once, after the backend is built and before `start`, for a backend that enforces
        some of `server.limits` itself (the native engine bounds the grammars it compiles).
        Default: nothing to enforce."""

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """For a backend that declares the "embeddings" endpoint."""
        raise InvalidRequestError("This deployment does not serve /v1/embeddings.")

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        """For a backend that declares the "tokenize" endpoint (with `detokenize`)."""
        raise InvalidRequestError("This deployment does not serve /tokenize.")

    async def detokenize(self, request: DetokenizeRequest) -> str:
        """For a backend that declares the "tokenize" endpoint (with `tokenize`)."""
        raise InvalidRequestError("This deployment does not serve /detokenize.")

    def kv_events_source(self) -> KVEventsSource | None:
        """Where this backend's engine publishes KV events, for the `precise_prefix` policy to
        index its cached blocks. Default None: it publishes none."""
        return None

    # Optional members whose presence is the declaration: None here, a method in a backend that
    # has one (the gateway tests `is not None`, and calls it).

    # generate_batches(request) -> AsyncIterator[list[TokenEvent]]: the same events as `generate`,
    # in non-empty lists of those that became ready together (one network read of an upstream
    # stream); the gateway then reads that instead and passes each list through its layers once
    # (every layer costs Python calls per item it passes on); see `batched_events`.
    generate_batches: Callable[[GenerationRequest], AsyncIterator[list[TokenEvent]]] | None = None

    # prompt_token_ids(request) -> list[int] | None: the prompt's token ids from a tokenizer in the
    # gateway process, for `precise_prefix` to score it: cheap and synchronous (it runs while
    # routing); None or an exception means "cannot tell", and routing falls back.
    prompt_token_ids: Callable[[GenerationRequest], list[int] | None] | None = None

    # async release_kv(params: dict): free a prefill hop's KV early (prefill/decode
    # disaggregation, gateway.dispatch.disagg). `params` is the `kv_transfer_params` the prefill
    # hop answered; called at most once per hop, not awaited by the request, when no decode engine
    # will read those blocks (the decode hop has its first token, or ended without one). Cheap;
    # leaves a read in progress alone; ignores params it does not know. Without it the engine
    # frees them on its own timeout.
    release_kv: Callable[[dict], Awaitable[None]] | None = None

    # async reset_prefix_cache(): vLLM's POST /reset_prefix_cache, for a backend with a prefix
    # cache: forget the cached prefixes (and tell KV-event subscribers); an APIError when the
    # engine cannot be reached.
    reset_prefix_cache: Callable[[], Awaitable[None]] | None = None

    # async load_lora_adapter(name, path) / unload_lora_adapter(name): vLLM's POST
    # /v1/load_lora_adapter and /v1/unload_lora_adapter for a backend whose `load().lora` is not
    # None; an APIError (InvalidRequestError naming the adapter) when it refuses.
    load_lora_adapter: Callable[[str, str], Awaitable[None]] | None = None
    unload_lora_adapter: Callable[[str], Awaitable[None]] | None = None


def batched_events(backend: Backend, request: GenerationRequest) -> tuple[AsyncIterator, bool]:
    """(the backend's event iterator for `request`, whether it yields lists of events)."""
    if backend.generate_batches is not None:
        return backend.generate_batches(request), True
    return backend.generate(request), False
