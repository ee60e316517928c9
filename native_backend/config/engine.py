"""How to build an engine, in plain validated parts (the shape of vLLM's configs):

    EngineConfig
      model:       ModelOptions        which checkpoint, dtype, device, threads, kernels
      cache:       CacheOptions        KV block size, dtype, budget, prefix caching
      scheduler:   SchedulerOptions    batch limits, context length
      parallel:    ParallelOptions     tensor-parallel size, collective timeout
      transfer:    KVTransferOptions   prefill/decode disaggregation: the KV connector's role and endpoint
      speculative: SpeculativeOptions | None
      kv_events:   KVEventsOptions | None   the prefix cache's changes, published as vLLM's KV events
      grammar:     GrammarOptions      bounds on constrained requests' grammars (the gateway's server.limits)

Each part checks itself once, in `__post_init__`, and raises ValueError naming the field; the
native plugin's settings are these fields by name (EngineConfig.build; tests/plugins hold the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from native_backend.config.formats import (DECODE_MATMULS, DTYPES, KV_CACHE_DTYPES, KV_SCALES, LM_HEADS,
                                           PREFILL_ATTENTIONS, PREFILL_MATMULS, WEIGHT_QUANTIZATIONS)

MAX_BLOCK_SIZE = 256  # tokens per KV block, at most
# CUDA: device memory the KV budget leaves free for activations, the CUDA context and the
# allocator's slack (the executor's KV plan; `kvgate plan` reserves it on top of its activations).
CUDA_RESERVE_BYTES = 512 << 20


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ValueError(f"{owner}.{name} must be positive, got {value}")


def _one_of(owner: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}: {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class ModelOptions:
    path: str  # a GGUF file or a Hugging Face directory (config.json + safetensors)
    dtype: str = "float32"  # weights and activations
    device: str = "cpu"  # cpu | cuda | cuda:N
    num_threads: int | None = None  # torch threads in the engine process; None: torch's default
    cpu_kernels: bool = True  # on CPU, kvgate's C kernels where they build
    tokenizer_cache_dir: str | None = None  # where a GGUF's tokenizer is unpacked once
    # Weights as stored: none (float, or an AWQ directory detected from its config.json), awq (an
    # AWQ directory required), gguf (a GGUF whose decoder linears are Q4_0 / Q4_1 runs them packed by
    # the int4 kernels; without it a GGUF is dequantized to dtype).
    quantization: str = "none"
    # CPU, float32 activations: prefill chunks' products in bf16 (auto: int4 linears on a CPU with AMX
    # or AVX512_BF16 where a start-up probe measures it faster) or fp32; decode keeps its kernels.
    prefill_matmul: str = "auto"
    # CPU, float32 activations: decode steps of many rows (DECODE_BF16_MIN_ROWS and up) multiply the same bf16
    # copies, the int4 model's LM head a bf16 copy of its own (auto: where prefill_matmul resolved to bf16).
    decode_matmul: str = "auto"
    # CPU, float32 activations: prefill chunks' attention products in bf16 with fp32 sums and softmax (auto:
    # where the prefill matmuls run in bf16 and the AVX512_BF16 kernel measures faster) or fp32.
    prefill_attention: str = "auto"
    # An int4 model's LM head on the CPU: an int8 copy (auto: where it measurably helps) or float.
    lm_head: str = "auto"

    def __post_init__(self):
        if not self.path:
            raise ValueError("model.path: a GGUF file or a Hugging Face directory is required")
        _one_of("model", "dtype", self.dtype, DTYPES)
        _one_of("model", "prefill_matmul", self.prefill_matmul, PREFILL_MATMULS)
        _one_of("model", "prefill_attention", self.prefill_attention, PREFILL_ATTENTIONS)
        _one_of("model", "decode_matmul", self.decode_matmul, DECODE_MATMULS)
        if self.decode_matmul == "bf16" and self.prefill_matmul == "fp32":
            raise ValueError("model.decode_matmul: bf16 multiplies prefill's bf16 copies of the weights; "
                             "it needs prefill_matmul auto or bf16, got fp32")
        _one_of("model", "lm_head", self.lm_head, LM_HEADS)
        if self.quantization not in WEIGHT_QUANTIZATIONS:  # GPTQ, FP8 weights, ...: no kernels for them yet
            raise ValueError(f"model.quantization: {self.quantization!r} is not supported by this engine: it runs "
                             "float, AWQ int4 (AutoAWQ GEMM) and GGUF Q4_0 / Q4_1 checkpoints; use "
                             f"{', '.join(WEIGHT_QUANTIZATIONS)}")
        if self.quantization == "gguf" and not self.path.endswith(".gguf"):
            raise ValueError(f"model.quantization: gguf needs a .gguf model file, got {self.path}")
        if not (self.device == "cpu" or self.device == "cuda" or
                (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"model.device: {self.device!r} is not cpu, cuda or cuda:N")
        _positive("model", num_threads=self.num_threads)


@dataclass(frozen=True)
class CacheOptions:
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_dtype: str = "auto"  # auto (= the model's dtype) | a float dtype | fp8_e4m3 | fp8_e5m2 | int8
    kv_cache_bytes: int | None = None  # KV-cache budget in bytes; None: memory_fraction decides
    memory_fraction: float = 0.9  # of device memory for weights + KV + activations (CUDA)
    cpu_kv_cache_bytes: int = 2 << 30  # default KV budget on CPU, where memory is shared
    enable_prefix_caching: bool = True
    kv_scales: str = "auto"  # fp8 only: auto (the checkpoint's, else calibrated) | calibrate | unit (1.0)
    # Seeds the prefix cache's chained block hashes (vLLM sha256_cbor; this is its PYTHONHASHSEED):
    # engines, ours or vLLM's, with the same seed and block_size give equal prefixes equal hashes.
    prefix_hash_seed: str = "0"

    def __post_init__(self):
        _positive("cache", block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes,
                  cpu_kv_cache_bytes=self.cpu_kv_cache_bytes)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"cache.block_size must be at most {MAX_BLOCK_SIZE}, got {self.block_size}")
        _one_of("cache", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("cache", "kv_scales", self.kv_scales, KV_SCALES)
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"cache.memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int = 32  # requests running at once
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill)
    max_model_len: int | None = None  # None: the model's own context length
    long_prefill_token_threshold: int = 0  # a prompt's most tokens in one step (vLLM's name); 0: the budget

    def __post_init__(self):
        _positive("scheduler", max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                  max_model_len=self.max_model_len)
        if self.long_prefill_token_threshold < 0:
            raise ValueError("scheduler.long_prefill_token_threshold must be 0 (off) or positive, "
                             f"got {self.long_prefill_token_threshold}")


@dataclass(frozen=True)
class ParallelOptions:
    """Tensor parallelism: the model's layers split across N ranks (N-1 worker processes beside
    the engine core's rank 0), one device each (CUDA: cuda:0..N-1 from the configured index).
    Pipeline parallelism: the decoder layers split into P stages, each stage tensor_parallel_size
    ranks (TP x PP ranks in all, rank = stage x TP + TP rank), with up to P batches in flight."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages; the last one samples
    # Each stage's number of decoder layers (P counts adding up to the model's layers); None: even,
    # the remainder one each to the stages before the last (vLLM's VLLM_PP_LAYER_PARTITION).
    pipeline_layer_partition: tuple[int, ...] | None = None
    # A collective (all-reduce, gather) that has not completed in this many seconds fails the step:
    # a stopped or hung rank then fails in-flight requests instead of stalling them forever.
    collective_timeout_s: float = 60.0
    # Across machines (vLLM's --nnodes / --master-addr / --master-port): the ranks spread evenly over
    # nnodes nodes (world / nnodes each, consecutive: TP inside a node, stages across); this engine is
    # node 0 and waits at master_addr:master_port for the headless nodes (`kvgate engine --headless`),
    # which must prove the shared secret (rendezvous_secret_file, else $KVGATE_RENDEZVOUS_SECRET).
    nnodes: int = 1
    master_addr: str = "127.0.0.1"  # the address node 0 listens on and the others connect to
    master_port: int = 29500
    rendezvous_secret_file: str | None = None

    def __post_init__(self):
        _positive("parallel", tensor_parallel_size=self.tensor_parallel_size,
                  pipeline_parallel_size=self.pipeline_parallel_size, collective_timeout_s=self.collective_timeout_s,
                  nnodes=self.nnodes)
        if self.world_size % self.nnodes:
            raise ValueError(f"parallel.nnodes {self.nnodes}: the {self.world_size} ranks (tensor_parallel_size x "
                             "pipeline_parallel_size) must spread evenly over the nodes")
        if self.nnodes > 1 and self.master_addr in ("0.0.0.0", "::", ""):
            raise ValueError(f"parallel.master_addr {self.master_addr!r}: name node 0's own address (the other nodes "
                             "dial it and its group's store listens there), not a wildcard")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"parallel.master_port {self.master_port}: not a TCP port")
        partition = self.pipeline_layer_partition
        if partition is not None:
            object.__setattr__(self, "pipeline_layer_partition", tuple(partition))  # YAML gives a list
            if len(partition) != self.pipeline_parallel_size:
                raise ValueError(f"parallel.pipeline_layer_partition {list(partition)}: one count per stage "
                                 f"({self.pipeline_parallel_size} stages)")

    @property
    def world_size(self) -> int:
        """Ranks in all: every stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


KV_ROLES = ("producer", "consumer", "both")


@dataclass(frozen=True)
class KVTransferOptions:
    """Prefill/decode disaggregation (vLLM's kv_transfer_config): what this engine's KV connector
    does. A producer computes prompts for remote decoders and keeps their blocks until a consumer
    has read them over TCP (or `kv_hold_timeout_s` frees them); a consumer loads a prompt's blocks
    from the producer named in a request's kv_transfer_params; both: either, per request."""

    kv_role: str | None = None  # None: no connector; producer | consumer | both
    # Where a producer serves its blocks (bound); 0.0.0.0 or :: serves every interface.
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0  # 0: a free port the system picks (the answer's remote_port says which)
    # The host consumers are told to connect to (remote_host); None: kv_transfer_host, or this
    # machine's loopback when that is a wildcard (a pod sets its own address here).
    kv_transfer_advertise_host: str | None = None
    kv_transfer_timeout_s: float = 30.0  # a consumer's read of one prompt's blocks, at most; then it recomputes
    kv_hold_timeout_s: float = 120.0  # a producer keeps unread blocks this long, then frees them
    # A producer serves this many reads at once (a thread each); a connection beyond is refused at
    # once (its consumer recomputes), so a flood of connections cannot pile up threads.
    kv_transfer_max_connections: int = 64
    # A consumer reads only from producers at these addresses: IPs, CIDR networks, DNS names (their
    # current addresses, e.g. a prefill pool's headless Service), or "*" for any (execution.kv_transfer.trust).
    kv_allowed_producers: tuple[str, ...] = ("127.0.0.0/8", "::1")
    # The environment variable holding the secret the engines share: each payload carries an
    # HMAC keyed by it. Unset or empty: a key only the engines one process started share.
    kv_transfer_key_env: str = "KVGATE_ENGINE_KEY"
    # A consumer gives up on a producer that has not connected and answered its read request
    # within this (a host that never answers must not hold a load thread for kv_transfer_timeout_s).
    kv_transfer_header_timeout_s: float = 2.0

    def __post_init__(self):
        object.__setattr__(self, "kv_allowed_producers", tuple(self.kv_allowed_producers))
        if self.kv_role is not None:
            _one_of("transfer", "kv_role", self.kv_role, KV_ROLES)
        if not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError(f"transfer.kv_transfer_port must be in 0..65535, got {self.kv_transfer_port}")
        _positive("transfer", kv_transfer_timeout_s=self.kv_transfer_timeout_s,
                  kv_hold_timeout_s=self.kv_hold_timeout_s,
                  kv_transfer_max_connections=self.kv_transfer_max_connections,
                  kv_transfer_header_timeout_s=self.kv_transfer_header_timeout_s)

    @property
    def produces(self) -> bool:
        return self.kv_role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("consumer", "both")

    @property
    def advertised_host(self) -> str:
        if self.kv_transfer_advertise_host:
            return self.kv_transfer_advertise_host
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.kv_transfer_host, self.kv_transfer_host)


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeOptions:
    """Speculative decoding: a proposer guesses tokens, the target checks them in one step.

    ngram: the continuation of the longest earlier match (prompt_lookup_min..max tokens) of the
    sequence's suffix. draft: a draft model proposes them, either the target's own first
    `draft_num_layers` layers with its final norm and head (no extra weights), or `draft_model`,
    another Llama-family checkpoint with the target's tokenizer."""

    method: str
    num_speculative_tokens: int = 4  # k: tokens proposed (and verified in one target step) per request
    prompt_lookup_min: int = 2  # ngram: shortest suffix that counts as a match, tokens
    prompt_lookup_max: int = 4  # ngram: longest suffix tried first, tokens
    draft_model: str | None = None  # draft: a GGUF file or HF directory; None: self-speculative
    draft_num_layers: int | None = None  # draft: the target's first n layers (self-speculative)
    # Load policy: no speculation while more requests than this decode in one step (it costs
    # compute that a full batch no longer has spare); None: always.
    max_batch_size: int | None = 4
    # A request whose drafts are accepted less often than this (moving average) stops
    # speculating for a while, then tries again.
    min_acceptance_rate: float = 0.2

    def __post_init__(self):
        _one_of("speculative", "method", self.method, SPECULATIVE_METHODS)
        _positive("speculative", num_speculative_tokens=self.num_speculative_tokens,
                  prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                  draft_num_layers=self.draft_num_layers, max_batch_size=self.max_batch_size)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative.num_speculative_tokens: {self.num_speculative_tokens} is above "
                             f"{MAX_SPECULATIVE_TOKENS} (a verification's rows must stay a short query)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(f"speculative.min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}")
        self._check_draft()

    def _check_draft(self) -> None:
        has_model, has_layers = self.draft_model is not None, self.draft_num_layers is not None
        if self.method == "ngram" and (has_model or has_layers):
            raise ValueError("speculative.draft_model / draft_num_layers: only for method 'draft'")
        if self.method == "draft" and has_model == has_layers:
            raise ValueError("speculative: method 'draft' needs exactly one of draft_model (another checkpoint) "
                             "or draft_num_layers (the target's first layers)")
        if has_model and not self.draft_model:
            raise ValueError("speculative.draft_model: a GGUF file or a Hugging Face directory is required")


ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsOptions:
    """KV events: which blocks the prefix cache stores and evicts, published like vLLM's
    `--kv-events-config` (ZMQ PUB of msgpack batches with sequence numbers; a ROUTER at
    `replay_endpoint` resends the last `buffer_steps` batches). An endpoint with `*` or `::`, a
    loopback one, an IP address of this machine (a pod's IP), or an ipc:// or inproc:// one, is
    bound; any other is connected to (a subscriber that binds). The default binds loopback: the
    events name every tenant's cached prefixes, so only processes on this machine hear them unless
    an address says otherwise."""

    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None  # None: no replay; a subscriber that misses a batch starts over
    topic: str = ""  # the first frame of every message
    buffer_steps: int = 10000  # batches kept for replay
    hwm: int = 100000  # ZMQ send high-water mark, messages (a slow subscriber loses the rest)
    # BlockStored's token_ids: the prompts' tokens themselves. Off: the field goes out empty (a
    # router needs only the hashes); vLLM always sends them.
    publish_token_ids: bool = False

    def __post_init__(self):
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(ZMQ_TRANSPORTS):
                raise ValueError(f"kv_events.{name}: {value!r} is not a ZMQ address "
                                 f"({', '.join(t + '...' for t in ZMQ_TRANSPORTS)})")
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint \
                and not self.endpoint.endswith(":*"):  # any free port: two different ones
            raise ValueError("kv_events.replay_endpoint: must differ from kv_events.endpoint")
        _positive("kv_events", buffer_steps=self.buffer_steps, hwm=self.hwm)


@dataclass(frozen=True)
class GrammarOptions:
    """Bounds on the grammars of constrained requests (core.grammars), so that a pathological
    constraint cannot hold the engine. A gateway sets them from its `server.limits`
    (max_grammar_bytes, grammar_compile_timeout_s, grammar_cache_size); these defaults are theirs."""

    max_bytes: int = 1 << 20  # largest constraint compiled (a schema, regex, grammar, a request's tool grammar)
    compile_timeout_s: float = 10.0  # a compile still running after this fails its request (a 400)
    cache_size: int = 128  # compiled grammars kept, most recently used
    # ... and at most this many bytes of them (each charged the memory its compile and first
    # mask took): 128 lexers of a hostile regex held ~230 MB each before the fuel limits.
    cache_bytes: int = 256 << 20

    def __post_init__(self):
        _positive("grammar", max_bytes=self.max_bytes, compile_timeout_s=self.compile_timeout_s,
                  cache_size=self.cache_size, cache_bytes=self.cache_bytes)


@dataclass(frozen=True)
class LoRAOptions:
    """Multi-LoRA (native_backend.model.lora) with vLLM's names: --enable-lora --max-loras (adapters in
    one batch) --max-lora-rank --max-cpu-loras (adapters kept loaded, LRU); `lora_modules`:
    name -> PEFT adapter directory, loaded at start (vLLM's --lora-modules name=path)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_modules: dict = field(default_factory=dict)

    def __post_init__(self):
        _positive("lora", max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("lora.max_cpu_loras: must be at least max_loras")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora.lora_modules: needs enable_lora")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


MAX_SPECULATIVE_TOKENS = 7  # 1 + k rows per request: the CPU kernels' short-query path takes up to 8


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    transfer: KVTransferOptions = field(default_factory=KVTransferOptions)
    speculative: SpeculativeOptions | None = None
    kv_events: KVEventsOptions | None = None
    grammar: GrammarOptions = field(default_factory=GrammarOptions)
    lora: LoRAOptions = field(default_factory=LoRAOptions)

    def __post_init__(self):
        if self.lora.enable_lora and self.speculative is not None:
            raise ValueError("lora: enable_lora with speculative decoding is not supported yet")
        split = self.parallel.tensor_parallel_size > 1 or self.parallel.pipeline_parallel_size > 1
        if self.lora.enable_lora and split:
            raise ValueError("lora: enable_lora under tensor or pipeline parallelism is not supported yet")

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage dtype with 'auto' resolved (the model's dtype)."""
        return self.model.dtype if self.cache.kv_cache_dtype == "auto" else self.cache.kv_cache_dtype

    @classmethod
    def build(cls, **settings) -> EngineConfig:
        """From flat setting names, each of which belongs to exactly one part (`FIELD_PARTS`);
        an unknown name raises instead of being dropped. `speculative` (a dict or
        SpeculativeOptions) and `kv_events` (a dict or KVEventsOptions) are the nested parts: each
        is absent unless asked for. `grammar` (a dict or GrammarOptions) defaults to GrammarOptions()."""
        parts: dict[str, dict] = {name: {} for name in PARTS}
        speculative = settings.pop("speculative", None)
        kv_events = settings.pop("kv_events", None)
        grammar = settings.pop("grammar", None) or GrammarOptions()
        for key, value in settings.items():
            if key not in FIELD_PARTS:
                raise TypeError(f"unknown engine setting {key!r}")
            parts[FIELD_PARTS[key]][key] = value
        spec = SpeculativeOptions(**speculative) if isinstance(speculative, dict) else speculative
        events = KVEventsOptions(**kv_events) if isinstance(kv_events, dict) else kv_events
        return cls(**{name: PARTS[name](**values) for name, values in parts.items()}, speculative=spec,
                   kv_events=events, grammar=GrammarOptions(**grammar) if isinstance(grammar, dict) else grammar)


PARTS = {"model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions, "parallel": ParallelOptions,
         "transfer": KVTransferOptions, "lora": LoRAOptions}
# Flat setting name -> the part it belongs to (names are unique across parts).
FIELD_PARTS = {f.name: part for part, options in PARTS.items() for f in fields(options)}
assert len(FIELD_PARTS) == sum(len(fields(options)) for options in PARTS.values()), "a setting name in two parts"
