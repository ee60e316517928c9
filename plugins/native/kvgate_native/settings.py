"""The native deployment's settings: what `settings:` of a `backend: native` deployment may hold,
validated (unknown keys refused, each error with its path) and turned into the engine's own
`EngineConfig`. The backend (backend.py) is built from a validated `NativeSettings`.
"""

from __future__ import annotations

import json
import os

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvgate_native.embeddings import EmbeddingSettings
from kvgate_native.tool_parsers import DEFAULT as DEFAULT_TOOL_PARSER, tool_parser
from kvgate_native.supervisor import SupervisionSettings
from native_backend.config.architectures import architecture_on_disk, check_architecture
from native_backend.config.cache_dir import tokenizer_cache_dir
from native_backend.config.engine import SPECULATIVE_METHODS, EngineConfig, KVEventsOptions, SpeculativeOptions
from native_backend.config.formats import DTYPES, KV_CACHE_DTYPES
from native_backend.execution.parallel.validate import (
    check_model_on_disk, check_pipeline_on_disk, check_speculative_method)
from native_backend.config.default_model import default_gguf_path


class SpeculativeSettings(BaseModel):
    """`settings.speculative` of a native deployment (SpeculativeOptions, field by field)."""

    model_config = ConfigDict(extra="forbid")

    # Each the SpeculativeOptions field of that name; the values are checked once, by it.
    method: str = Field(description=f"{' or '.join(SPECULATIVE_METHODS)}: prompt lookup, or a draft model.")
    num_speculative_tokens: int = Field(4, description="Tokens proposed and verified per step (k).")
    prompt_lookup_min: int = Field(2, description="ngram: shortest suffix match, tokens.")
    prompt_lookup_max: int = Field(4, description="ngram: longest suffix match, tokens.")
    draft_model: str | None = Field(None, description="draft: GGUF file or HF directory with the target's "
                                    "tokenizer, e.g. an AWQ int4 copy of the target from `kvgate quantize` "
                                    "('default' is SmolLM2-135M-Instruct).")
    draft_num_layers: int | None = Field(None, description="draft: the target's first n layers "
                                         "(self-speculative, no extra weights).")
    max_batch_size: int | None = Field(4, description="No speculation while more requests than this "
                                       "decode in one step; null: always.")
    min_acceptance_rate: float = Field(0.2, description="A request accepting fewer drafts than this "
                                       "(moving average) pauses speculation for a while.")

    @model_validator(mode="after")
    def _valid_for_the_engine(self):
        self.options()  # the engine's own checks (method vs draft fields, ranges), as a settings error
        return self

    def options(self) -> SpeculativeOptions:
        values = self.model_dump()
        if values["draft_model"] == "default":
            values["draft_model"] = default_gguf_path()
        return SpeculativeOptions(**values)


class KVEventsSettings(BaseModel):
    """`settings.kv_events` of a native deployment (KVEventsOptions, field by field; vLLM's
    --kv-events-config): the engine publishes which prefix-cache blocks it stores and evicts."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field("tcp://127.0.0.1:5557", description="ZMQ PUB address: one with * or ::, a loopback "
                          "one, an IP address of this machine (a pod's IP) or ipc:// is bound, any other "
                          "connected to (a subscriber that binds). The gateway subscribes to it. Default: "
                          "loopback, so only this machine hears the events.")
    replay_endpoint: str | None = Field(None, description="ZMQ ROUTER address (bound) that resends the last "
                                        "buffer_steps batches from a sequence number on; null: no replay.")
    topic: str = Field("", description="First frame of every message (llm-d uses kv@<pod>@<model>).")
    buffer_steps: int = Field(10000, description="Batches kept for replay.")
    hwm: int = Field(100000, description="ZMQ send high-water mark, messages.")
    publish_token_ids: bool = Field(False, description="BlockStored carries the blocks' token ids (the "
                                    "prompts themselves, as vLLM always sends them); off: an empty list.")

    @model_validator(mode="after")
    def _valid_for_the_engine(self):
        self.options()
        return self

    def options(self) -> KVEventsOptions:
        return KVEventsOptions(**self.model_dump())


class LoRAModule(BaseModel):
    """One static adapter in vLLM's JSON form of --lora-modules."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The name requests give as `model`.")
    path: str = Field(min_length=1, description="The PEFT adapter's directory.")
    base_model_name: str | None = Field(None, description="Accepted as vLLM does; the deployment's model is the base.")


def lora_modules(modules: list) -> dict[str, str]:
    """name -> path from 'name=path' strings and {name, path} objects; ValueError on a bad or
    repeated name."""
    found: dict[str, str] = {}
    for i, module in enumerate(modules):
        if isinstance(module, str):
            name, sep, path = module.partition("=")
            if not (sep and name and path):
                raise ValueError(f"lora_modules[{i}]: expected 'name=path', got {module!r}")
        else:
            name, path = module.name, module.path
        if name in found:
            raise ValueError(f"lora_modules[{i}]: adapter name '{name}' given twice")
        found[name] = path
    return found


# Settings that are the plugin's, not the engine's: which model it names, how it runs the engine process.
PLUGIN_ONLY = {"model", "startup_timeout_s", "supervision", "embeddings", "tool_call_parser", "lora_resolver_dir"}


class NativeSettings(BaseModel):
    """What a deployment's `settings:` may hold for `backend: native`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("default", description="GGUF file or HF directory; 'default' is SmolLM2-135M-Instruct.")
    # The engine's settings, each the EngineConfig field of that name (one mapping: engine_config);
    # their values are checked once, by the engine's own parts (config/engine.py).
    dtype: str = Field("float32", description=f"Weights and activations: {', '.join(DTYPES)}.")
    kv_cache_dtype: str = Field(
        "auto", description="KV-cache storage: auto (the model's dtype), a float dtype, fp8 (per-layer scales) "
        f"or int8 (a scale per token and KV head); one of {', '.join(KV_CACHE_DTYPES)}.")
    kv_scales: str = Field(
        "auto", description="fp8 KV only: per-layer K/V scales from the checkpoint when it has them, else from a "
        "calibration pass at start (auto); always calibrated (calibrate); or 1.0 (unit, with a warning).")
    device: str = Field("cpu", description="cpu, cuda or cuda:N.")
    block_size: int = Field(16, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(32, description="Requests running at once.")
    max_num_batched_tokens: int = Field(512, description="Token budget of one step.")
    long_prefill_token_threshold: int = Field(
        0, description="A prompt's most tokens in one step, so short prompts are admitted beside a long one's "
        "chunks (vLLM's name); 0: the whole step budget.")
    max_model_len: int | None = Field(None, description="Context limit; default: the model's.")
    kv_cache_bytes: int | None = Field(None, description="KV-cache budget in bytes.")
    memory_fraction: float = Field(0.9, description="Of GPU memory, when on CUDA.")
    enable_prefix_caching: bool = True
    num_threads: int | None = Field(None, description="torch threads in the engine process.")
    cpu_kernels: bool = Field(True, description="On CPU, kvgate's C kernels (decode attention, small-batch "
                              "linears) where they build; false: torch alone.")
    tensor_parallel_size: int = Field(1, description="Ranks (GPUs on cuda) one engine shards the model "
                                      "across; the model's heads, KV heads, MLP and vocabulary must split, "
                                      "int4 linears in whole int32 words and groups (refused by this "
                                      "check and at start, naming the sizes that would).")
    pipeline_parallel_size: int = Field(1, description="Pipeline stages one engine splits the decoder layers "
                                        "into (tensor_parallel_size ranks each; GPUs on cuda); the last stage "
                                        "samples, and up to this many batches run at once, one per stage.")
    pipeline_layer_partition: tuple[int, ...] | None = Field(
        None, description="Each stage's number of decoder layers (adding up to the model's); default: even, "
        "the remainder one each to the stages before the last.")
    collective_timeout_s: float = Field(60.0, description="Tensor parallelism: seconds after which an "
                                        "all-reduce a rank does not join fails the step (a hung or stopped worker).")
    nnodes: int = Field(1, description="Machines the engine spans (vLLM's --nnodes): the tensor x pipeline ranks "
                        "spread evenly, TP inside a node, stages across; this deployment's engine is node 0, the "
                        "others run `kvgate engine --headless --node-rank n`.")
    master_addr: str = Field("127.0.0.1", description="nnodes > 1: the address node 0's engine listens on for the "
                             "other nodes (its rendezvous; the other nodes' --master-addr). Loopback by default.")
    master_port: int = Field(29500, description="nnodes > 1: the rendezvous port (the other nodes' --master-port).")
    rendezvous_secret_file: str | None = Field(
        None, description="nnodes > 1: a file holding the secret every node proves before it joins (16 bytes or "
        "more); default: $KVGATE_RENDEZVOUS_SECRET. A peer without it is refused and logged.")
    quantization: str = Field("none", description="Weight quantization of the checkpoint: none (served as it is "
                              "stored; an AWQ checkpoint is detected from its config.json, a GGUF is dequantized "
                              "to dtype), awq (an AWQ int4 directory is required, e.g. from `kvgate quantize`) or "
                              "gguf (a GGUF whose decoder linears are Q4_0 / Q4_1 runs them as stored, int4).")
    prefill_matmul: str = Field("auto", description="CPU: the matrix products of prompt chunks (64 rows or more) "
                                "in bf16 from a bf16 copy of each linear (2 bytes a weight), fp32 accumulation, "
                                "or in fp32; auto: bf16 for int4 linears on a CPU with AMX or AVX512_BF16 where a "
                                "start-up probe measures it faster (auto | fp32 | bf16).")
    decode_matmul: str = Field("auto", description="CPU: decode steps of 16 rows or more (many sequences) "
                               "multiply the same bf16 copies, and an int4 model's LM head a bf16 copy of its own "
                               "(2 bytes a vocabulary x hidden weight), fp32 accumulation; fewer rows keep the "
                               "int4 / fp32 kernels; auto: where prefill_matmul resolved to bf16 (auto | fp32 | bf16).")
    prefill_attention: str = Field("auto", description="CPU: the attention of prompt chunks (more than 8 new "
                                   "tokens) with bf16 products, fp32 sums and softmax, or in fp32; auto: bf16 where "
                                   "the prefill matmuls run in bf16, the CPU has AVX512_BF16 and a start-up probe "
                                   "measures it faster (auto | fp32 | bf16). Decode keeps its kernels.")
    lm_head: str = Field("auto", description="CPU, int4 models: logits from an int8 copy of the LM head (a scale "
                         "per vocabulary row) or from the float head; auto: int8 where it measurably helps "
                         "(auto | int8 | float).")
    speculative: SpeculativeSettings | None = Field(None, description="Speculative decoding; off when absent.")
    prefix_hash_seed: str = Field("0", description="Seed of the prefix cache's chained block hashes (vLLM's "
                                  "sha256_cbor with PYTHONHASHSEED=this): equal prefixes get equal hashes on "
                                  "every engine with the same seed and block_size.")
    kv_events: KVEventsSettings | None = Field(None, description="Publish KV events (blocks stored/evicted) "
                                               "in vLLM's format over ZMQ; off when absent.")
    kv_role: Literal["producer", "consumer", "both"] | None = Field(
        None, description="Prefill/decode disaggregation (vLLM's kv_role): producer computes prompts and serves "
        "their KV blocks to decode engines over TCP; consumer reads them before decoding; both: either, per "
        "request. Off when absent. Under tensor parallelism the decode engine needs the prefill engine's "
        "tensor_parallel_size (else it recomputes the prompt).")
    kv_transfer_host: str = Field("127.0.0.1", description="Producer: the address its KV block server binds "
                                  "(0.0.0.0 or :: for every interface).")
    kv_transfer_port: int = Field(0, description="Producer: the KV block server's port; 0: one the system picks.")
    kv_transfer_advertise_host: str | None = Field(
        None, description="Producer: the host decode engines are told to read from (remote_host); default: "
        "kv_transfer_host, or loopback when that is a wildcard.")
    kv_transfer_timeout_s: float = Field(30.0, description="Consumer: seconds a read of a prompt's blocks may go "
                                         "without progress; then the prompt is recomputed (counted).")
    kv_hold_timeout_s: float = Field(120.0, description="Producer: seconds a finished prefill's blocks wait for "
                                     "a decode engine to read them before they are freed.")
    kv_transfer_max_connections: int = Field(64, description="Producer: reads of KV blocks served at once (a "
                                             "thread each); a connection beyond is refused at once and its decode "
                                             "engine recomputes the prompt (counted).")
    kv_allowed_producers: list[str] = Field(
        ["127.0.0.0/8", "::1"], description="Consumer: the producers it reads KV blocks from: IP addresses, "
        "CIDR networks, DNS names (their current addresses, e.g. the prefill pool's headless Service), or \"*\" "
        "for any. A request naming another host is recomputed, nothing is connected to.")
    kv_transfer_key_env: str = Field(
        "KVGATE_ENGINE_KEY", description="Environment variable holding the secret the engines share: each KV "
        "payload carries an HMAC keyed by it, and a consumer recomputes a payload whose HMAC differs. Unset or "
        "empty: a key shared by the engines this gateway process started.")
    kv_transfer_header_timeout_s: float = Field(
        2.0, gt=0, description="Consumer: seconds a producer has to accept the connection and answer the read "
        "request; then the prompt is recomputed.")
    enable_lora: bool = Field(False, description="Serve LoRA adapters of this model (vLLM's --enable-lora): a "
                              "request whose `model` names an adapter runs with it.")
    max_loras: int = Field(1, description="LoRA adapters that may run in one batch; a request whose adapter has "
                           "no free slot waits.")
    max_lora_rank: int = Field(16, description="Largest adapter rank accepted.")
    max_cpu_loras: int | None = Field(None, description="Adapters kept read in RAM (LRU; one dropped is read "
                                      "again when asked for); default: max_loras.")
    lora_modules: list[str | LoRAModule] = Field(
        [], description="Adapters served from the start, vLLM's --lora-modules forms: 'name=path' or "
        "{name, path}; more are loaded with POST /v1/load_lora_adapter.")
    lora_resolver_dir: str | None = Field(
        None, description="With enable_lora: a directory whose subdirectories are PEFT adapters, each served "
        "under its directory's name from its first request on (vLLM's filesystem LoRA resolver).")
    # The plugin's own: how it runs the engine process.
    startup_timeout_s: float = Field(600, gt=0, description="Seconds to load the model.")
    supervision: SupervisionSettings = Field(default_factory=SupervisionSettings,
                                             description="Watchdog and restarts of the engine process.")
    embeddings: EmbeddingSettings = Field(default_factory=EmbeddingSettings,
                                          description="/v1/embeddings from the model's pooled hidden states.")
    tool_call_parser: str = Field(DEFAULT_TOOL_PARSER, description="The format of the model's tool calls (vLLM's "
                                  "--tool-call-parser): hermes, llama3_json, mistral, pythonic, or one a package "
                                  "registers in the kvgate.tool_parsers entry-point group. It parses the output, "
                                  "constrains tool_choice required / named, and words the tools' system prompt.")

    @field_validator("tool_call_parser")
    @classmethod
    def _a_known_parser(cls, name: str) -> str:
        tool_parser(name)  # ValueError naming the known ones
        return name

    @model_validator(mode="after")
    def _valid_for_the_engine(self):
        """The engine's own checks, once (EngineConfig's parts), as a settings error; then what
        only the model on disk can tell: whether the engine runs its architecture, and whether
        tensor parallelism splits it."""
        self.engine_config()
        if self.lora_resolver_dir and not self.enable_lora:
            raise ValueError("lora_resolver_dir: needs enable_lora")
        check_speculative_method(self.tensor_parallel_size, self.speculative.method if self.speculative else None,
                                 self.pipeline_parallel_size)
        self._check_the_architecture()
        if self.tensor_parallel_size > 1:
            self._check_the_split()
        if self.pipeline_parallel_size > 1 and os.path.exists(self.model_path):
            check_pipeline_on_disk(self.engine_config())  # the stages, and what PP does not combine with yet
        return self

    @property
    def model_path(self) -> str:
        return default_gguf_path() if self.model == "default" else self.model

    def _check_the_architecture(self) -> None:
        """A model file of an architecture the engine does not build is refused here, naming the
        ones it does (config.architectures: its first metadata entries, no torch). A model that is
        not there (yet) is start()'s error, one that cannot be read the engine's."""
        try:
            architecture = architecture_on_disk(self.model_path)
        except (OSError, ValueError):
            return
        check_architecture(architecture)

    def _check_the_split(self) -> None:
        """The engine's own rule for the model as it is on disk (heads, KV heads, MLP, vocabulary;
        packed int4 linears in whole int32 words and whole groups), so that check-config refuses
        the sizes start-up would, naming the ones that work. Torch-free; a model that is not there
        (yet) is start()'s error, one that cannot be read the engine's."""
        if not os.path.exists(self.model_path):
            return
        try:
            check_model_on_disk(self.model_path, self.tensor_parallel_size, self.quantization)
        except (OSError, KeyError, TypeError):  # an unreadable config.json / GGUF: the engine says what is wrong
            return

    def engine_config(self) -> EngineConfig:
        """Every setting but the plugin's own is the engine field of that name (EngineConfig.build
        puts each in its part); the model's path and the tokenizer cache are filled in here."""
        nested = {"speculative", "kv_events", "lora_modules"}
        return EngineConfig.build(**self.model_dump(exclude=PLUGIN_ONLY | nested),
                                  lora_modules=lora_modules(self.lora_modules),
                                  path=self.model_path, tokenizer_cache_dir=str(tokenizer_cache_dir()),
                                  speculative=self.speculative.options() if self.speculative is not None else None,
                                  kv_events=self.kv_events.options() if self.kv_events is not None else None)
