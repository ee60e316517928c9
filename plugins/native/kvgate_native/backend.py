"""The native engine behind the gateway's Backend protocol.

The engine core runs in its own process (`native_backend.process.client.AsyncEngineClient`), so HTTP
serving never waits on a forward pass; a supervisor restarts it when it dies or hangs
(`supervisor.py`). This side tokenizes (the model's own chat template), turns engine outputs
into token events, maps engine refusals onto OpenAI errors, and reports load from the engine's
periodic stats. It never imports torch: the engine process loads the model and unpacks the
tokenizer once; this side then reads the unpacked tokenizer.

Whose fault: a request the engine refuses or drops alone (bad values, tokens outside the
vocabulary, a template that fails on its messages) is the client's error (4xx, or
`RequestFailed`), never charged to the deployment; only a dead or hung engine is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.backend import (
    TRANSFER_PARAMS, Backend, Capabilities, DetokenizeRequest, EmbeddingRequest, EmbeddingResult, GenerationRequest,
    KVEventsSource, LoadSnapshot, TokenEvent, TokenizeRequest, TokenizeResult, TokenLogprob, TopLogprob, Usage)
from gateway.config import settings_error
from gateway.errors import BackendError, ContextLengthExceeded, InvalidRequestError, Overloaded
from kvgate_native.constraints import grammar_spec
from kvgate_native.embeddings import EmbeddingSettings, check_embedding_request, input_path, pooled_vectors
from kvgate_native.engine_errors import api_error
from kvgate_native.tool_parsers import DEFAULT as DEFAULT_TOOL_PARSER, ToolParser, tool_parser
from kvgate_native.tool_parsers.base import HiddenMarkers
from kvgate_native.tools import chat_prompt_ids, uses_tools
from kvgate_native.supervisor import UP, EngineSupervisor, SupervisionSettings
from native_backend.config.architectures import architecture_on_disk, check_architecture
from native_backend.config.cache_dir import tokenizer_cache_dir
from native_backend.config.engine import (
    SPECULATIVE_METHODS, EngineConfig, GrammarOptions, KVEventsOptions, SpeculativeOptions)
from native_backend.config.formats import DTYPES, KV_CACHE_DTYPES
from native_backend.core.interface import EngineError, EngineRequest, RequestOutput
from native_backend.core.sampling_params import SamplingParams as EngineSampling
from native_backend.execution.kv_transfer.trust import share_local_key
from native_backend.execution.parallel.validate import (check_model_on_disk, check_pipeline_on_disk,
                                                       check_speculative_method)
from native_backend.process.client import AsyncEngineClient
from native_backend.process.kv_publisher import binds as publisher_binds
from native_backend.process.protocol import EngineDeadError
from native_backend.config.default_model import default_gguf_path
from native_backend.text.tokenizer import Tokenizer

log = logging.getLogger("kvgate.native")
TOKENIZE_THREADS = 2

ENGINE_FACTORY = "native_backend.process.factory:make_engine_core"
NATIVE_CAPABILITIES = Capabilities(endpoints=frozenset({"chat", "completions", "tokenize"}),
                                   features=frozenset({"logprobs", "n", "json_object", "json_schema", "tools"}),
                                   extras=frozenset({"structured_outputs", "skip_special_tokens", "cache_salt"}))
EMBEDDING_CAPABILITIES = dataclasses.replace(NATIVE_CAPABILITIES,
                                             endpoints=NATIVE_CAPABILITIES.endpoints | {"embeddings"})


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
                          "one, or ipc:// is bound, any other connected to (a subscriber that binds). The "
                          "gateway subscribes to it. Default: loopback, so only this machine hears the events.")
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


# Settings that are the plugin's, not the engine's: which model it names, how it runs the engine process.
PLUGIN_ONLY = {"model", "startup_timeout_s", "supervision", "embeddings", "tool_call_parser"}


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
        return EngineConfig.build(**self.model_dump(exclude=PLUGIN_ONLY | {"speculative", "kv_events"}),
                                  path=self.model_path, tokenizer_cache_dir=str(tokenizer_cache_dir()),
                                  speculative=self.speculative.options() if self.speculative is not None else None,
                                  kv_events=self.kv_events.options() if self.kv_events is not None else None)


class NativeBackend(Backend):
    def __init__(self, settings: NativeSettings, name: str = "native"):
        self.settings = settings
        self.name = name
        self.config = settings.engine_config()
        if self.config.transfer.kv_role is not None:
            share_local_key()  # before the engine starts: engines of this process read each other's blocks
        self.supervisor = EngineSupervisor(self._new_client, name, settings.supervision)
        self.tokenizer: Tokenizer | None = None
        self._context_tokens: int | None = None  # the engine's context, once its stats said it
        self.tool_parser: type[ToolParser] = tool_parser(settings.tool_call_parser)
        # Tokenizing and chat templates run here, never on the event loop: the largest prompt the
        # limits allow takes tens of milliseconds of CPU, a stall of every stream the gateway
        # serves. A few threads of its own: a burst of long prompts queues here, and does not
        # hold the loop's default executor (DNS lookups, file reads) hostage.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=TOKENIZE_THREADS, thread_name_prefix=f"kvgate-tokenize-{name}")

    def capabilities(self) -> Capabilities:
        """Chat and completions with logprobs and n, structured outputs (response_format
        json_object / json_schema, vLLM's structured_outputs: grammar-constrained sampling in the
        engine), tools (the tool_call_parser's format: prompt, parser, and `required` and named
        functions enforced by its grammar: kvgate_native/tools.py, tool_parsers/), /tokenize with
        the engine's tokenizer and chat template, and /v1/embeddings unless `embeddings.enabled` is false."""
        return EMBEDDING_CAPABILITIES if self.settings.embeddings.enabled else NATIVE_CAPABILITIES

    def use_limits(self, limits) -> None:
        """The gateway's server.limits (gateway.config.RequestLimits), before start: the engine
        bounds the grammars of constrained requests with them (size, compile time, cache)."""
        grammar = GrammarOptions(max_bytes=limits.max_grammar_bytes, compile_timeout_s=limits.grammar_compile_timeout_s,
                                 cache_size=limits.grammar_cache_size)
        self.config = dataclasses.replace(self.config, grammar=grammar)

    def _new_client(self, on_exit) -> AsyncEngineClient:
        return AsyncEngineClient(ENGINE_FACTORY, (self.config,), startup_timeout_s=self.settings.startup_timeout_s,
                                 watchdog_s=self.settings.supervision.watchdog_s, on_exit=on_exit,
                                 process_name=f"kvgate-engine-{self.name}")

    @property
    def client(self) -> AsyncEngineClient:
        """The engine process serving now (a new one after each restart)."""
        return self.supervisor.client

    async def start(self) -> None:
        if not os.path.exists(self.config.model.path):
            raise RuntimeError(f"native deployment '{self.name}': model file {self.config.model.path} does not exist")
        draft = self.config.speculative.draft_model if self.config.speculative is not None else None
        if draft is not None and not os.path.exists(draft):
            raise RuntimeError(f"native deployment '{self.name}': speculative.draft_model {draft} does not exist")
        if self.settings.quantization == "awq" and not _is_awq_checkpoint(self.config.model.path):
            raise RuntimeError(f"native deployment '{self.name}': quantization awq, but {self.config.model.path} "
                               "is not an AWQ checkpoint (no quantization_config with quant_method awq in config.json)")
        await self.supervisor.start()  # loads the model and unpacks the tokenizer into the cache
        log.info("native deployment '%s': %s", self.name, self.client.description)
        self.tokenizer = await asyncio.to_thread(
            Tokenizer.from_pretrained, self.config.model.path, cache_dir=self.config.model.tokenizer_cache_dir
        )

    async def stop(self) -> None:
        await self.supervisor.stop()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def abort(self, request_id: str) -> None:
        if self.client is not None:
            self.client.abort(request_id)

    async def release_kv(self, params: dict) -> None:
        """A prefill hop's blocks no decode engine will read (gateway.dispatch.disagg): `params` is what
        this engine answered; it frees them now rather than after kv_hold_timeout_s. Params of
        another engine process (this one restarted since) or already read: nothing happens."""
        engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
        if self.supervisor.up and isinstance(engine_id, str) and isinstance(request_id, str):
            self.client.release_kv(engine_id, request_id)

    def load(self) -> LoadSnapshot:
        sup = self.supervisor
        up = sup.up
        stats = dataclasses.asdict(self.client.stats()) if up else {}
        self._context_tokens = stats.get("max_model_len") or self._context_tokens
        extra = _flat_stats(stats)
        extra["engine_restarts"] = float(sup.restarts)
        return LoadSnapshot(
            waiting=int(stats.get("num_waiting", 0)),
            running=int(stats.get("num_running", 0)),
            kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
            capacity=self.settings.max_num_seqs,
            healthy=up,
            extra=extra,
            info={**_engine_info(stats), "root": self.config.model.path},
            problem=None if sup.state == UP else _problem(sup),
            fatal=sup.crash_looped,
            incarnation=sup.incarnation,
        )

    async def generate(self, request: GenerationRequest):
        client = self.client
        if not self.supervisor.up:
            raise Overloaded(f"The engine of deployment '{self.name}' is {self.supervisor.state}.", retry_after_s=5)
        skip_special = _skip_special_tokens(request)
        parser = hidden = None
        if uses_tools(request.tools, request.tool_choice):
            parser = self.tool_parser(max_calls=1 if request.parallel_tool_calls is False else None)
            hidden = hidden_markers(parser, self._ready_tokenizer()) if skip_special else None
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=await self._tokenized(request),
            sampling=_engine_sampling(request),
            priority=request.priority,
            trace_context=dict(request.trace_context),
            grammar=_constraint(request, self.tool_parser),
            kv_transfer_params=request.extra.get(TRANSFER_PARAMS),
            skip_special_tokens=skip_special,
            kept_special_tokens=hidden.markers if hidden else (),
            cache_salt=_cache_salt(request),
        )
        want_logprobs = request.sampling.logprobs is not None
        try:
            async with contextlib.aclosing(client.generate(engine_request)) as outputs:
                async for out in outputs:
                    event = _token_event(out, want_logprobs, request.continuous_usage)
                    yield event if parser is None else _with_tool_calls(event, parser, hidden)
        except EngineError as exc:
            raise api_error(exc) from None
        except EngineDeadError as exc:
            raise BackendError(f"The engine of deployment '{self.name}' is not running: {exc}") from None

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """/v1/embeddings: each input (tokenized on the tokenizing threads) prefilled by the engine
        as a pooling request, all of them at once (embeddings.py)."""
        check_embedding_request(request, self.settings.embeddings, self.name)
        if not self.supervisor.up:
            raise Overloaded(f"The engine of deployment '{self.name}' is {self.supervisor.state}.", retry_after_s=5)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._tokenize_pool, self._embedding_ids, request.inputs)
        vectors = await pooled_vectors(self.client, request, ids, self.settings.embeddings.pooling, self.name)
        return EmbeddingResult(vectors, sum(map(len, ids)))

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        """/tokenize: the ids generation would read (the same template, the same special-token
        rules), on the tokenizing threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._tokenize_now, request)

    def _tokenize_now(self, request: TokenizeRequest) -> TokenizeResult:
        if request.continue_final_message:
            raise InvalidRequestError(f"Deployment '{self.name}' (native) cannot continue a final message yet.",
                                      param="continue_final_message")
        tokenizer = self._ready_tokenizer()
        chat = request.messages is not None
        try:
            if chat:  # the tools counted as a chat request with tool_choice auto counts them
                ids = chat_prompt_ids(tokenizer, request.messages, request.tools, "auto",
                                      add_generation_prompt=request.add_generation_prompt, parser=self.tool_parser)
                if request.add_special_tokens and tokenizer.bos_token_id is not None:
                    ids = [tokenizer.bos_token_id] + ids  # on top of the template's, as vLLM does
            else:
                ids = tokenizer.encode(request.prompt or "", add_special_tokens=request.add_special_tokens is not False)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages" if chat else "prompt") from None
        strs = [tokenizer.token_text(t) for t in ids] if request.return_token_strs else None
        return TokenizeResult(ids, self.settings.max_model_len, strs)

    async def detokenize(self, request: DetokenizeRequest) -> str:
        tokenizer = self._ready_tokenizer()
        try:
            ids = _checked_token_ids(request.tokens, tokenizer.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="tokens") from None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: tokenizer.decode(ids, skip_special_tokens=False))

    async def reset_prefix_cache(self) -> None:
        """The engine forgets every cached prefix (POST /admin/reset_prefix_cache) and says so
        on its KV-event stream (AllBlocksCleared)."""
        if not self.supervisor.up:
            raise Overloaded(f"The engine of deployment '{self.name}' is {self.supervisor.state}.", retry_after_s=5)
        try:
            self.client.reset_prefix_cache()
        except EngineDeadError as exc:
            raise BackendError(f"The engine of deployment '{self.name}' is not running: {exc}") from None

    def kv_events_source(self) -> KVEventsSource | None:
        """Where this deployment's engine publishes its KV events, as the gateway reaches it (a
        wildcard bind address becomes loopback: the engine runs on this machine)."""
        events = self.config.kv_events
        if events is None:
            return None
        return KVEventsSource(
            endpoint=_local_address(events.endpoint),
            replay_endpoint=_local_address(events.replay_endpoint) if events.replay_endpoint else None,
            topic=events.topic, block_size=self.config.cache.block_size,
            hash_seed=self.config.cache.prefix_hash_seed, bind=not publisher_binds(events.endpoint))

    def kv_producer_address(self) -> tuple[str, int | None] | None:
        """Where decode engines read this deployment's prefills (gateway.dispatch.disagg): the host
        its answers name (the engine's advertised_host), and kv_transfer_port unless the system
        picks it (0: any port of that host)."""
        transfer = self.config.transfer
        if transfer.kv_role not in ("producer", "both"):
            return None
        return transfer.advertised_host, transfer.kv_transfer_port or None

    def prompt_token_ids(self, request: GenerationRequest) -> list[int] | None:
        """The prompt's token ids for routing (the same template as generation); None before the
        tokenizer is loaded."""
        return self._prompt_ids(request) if self.tokenizer is not None else None

    def _ready_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise Overloaded(f"Deployment '{self.name}' is still starting.", retry_after_s=5)
        return self.tokenizer

    async def _tokenized(self, request: GenerationRequest) -> list[int]:
        """The request's prompt token ids, computed on the tokenizing threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._prompt_ids, request)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self._ready_tokenizer()
        param = "messages" if request.messages is not None else "prompt"
        self._check_characters(request, param)
        try:
            if request.messages is not None:
                return chat_prompt_ids(tokenizer, request.messages, request.tools, request.tool_choice,
                                       parser=self.tool_parser)
            if isinstance(request.prompt, list):
                return _checked_token_ids(request.prompt, tokenizer.vocab_size)
            return tokenizer.encode(request.prompt or "")
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=param) from None
        except Exception as exc:  # noqa: BLE001 - whatever the text did to the tokenizer, it is this request's
            log.warning("native deployment '%s': tokenizing a request failed: %s: %s", self.name, type(exc).__name__, exc)
            raise InvalidRequestError(f"The {param} could not be tokenized.", param=param) from None

    def _check_characters(self, request: GenerationRequest, param: str) -> None:
        """Refuse a text far over the context before tokenizing it: a 1 MB prompt took 1.4-2.5 s
        of a tokenizing thread that generation shares, only to be refused by its token count.
        No tokenizer makes fewer than one token of MAX_CHARS_PER_TOKEN characters of real text."""
        context = self.settings.max_model_len or self._context_tokens
        if not context:
            return
        chars = _text_chars(request.messages) if request.messages is not None else (
            len(request.prompt) if isinstance(request.prompt, str) else 0)
        if chars > MAX_CHARS_PER_TOKEN * context:
            raise ContextLengthExceeded(
                f"The {param} hold {chars} characters, over {MAX_CHARS_PER_TOKEN} for each of this model's "
                f"{context} tokens of context: refused before tokenizing.", param=param)

    def _embedding_ids(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """Each embedding input's ids: text tokenized as a completion prompt is, token arrays
        checked against the vocabulary; a failure is a 400 naming the input (`input[2]`)."""
        tokenizer = self._ready_tokenizer()
        ids = []
        for i, item in enumerate(inputs):
            try:
                ids.append(_checked_token_ids(item, tokenizer.vocab_size) if isinstance(item, list)
                           else tokenizer.encode(item))
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param=input_path(i, len(inputs))) from None
            if not ids[-1]:
                raise InvalidRequestError("The input has no tokens.", param=input_path(i, len(inputs)))
        return ids


MAX_CHARS_PER_TOKEN = 8  # issue 40 item 10's bound: a prompt over 8 characters per token of context


def _text_chars(value) -> int:
    """Characters in every string of a chat's messages (contents, parts, tool calls), iteratively:
    the body parser already bounded its depth and size."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _local_address(endpoint: str) -> str:
    """A ZMQ address a process on this machine connects to: tcp://*:p and tcp://0.0.0.0:p become
    tcp://127.0.0.1:p, tcp://[::]:p becomes tcp://[::1]:p; others are kept."""
    for wildcard, loopback in (("tcp://*:", "tcp://127.0.0.1:"), ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
                               ("tcp://[::]:", "tcp://[::1]:")):
        if endpoint.startswith(wildcard):
            return loopback + endpoint[len(wildcard):]
    return endpoint


def _flat_stats(stats: dict) -> dict[str, float]:
    """Engine stats as LoadSnapshot.extra floats; a per-position tuple becomes name_pos_<j> keys."""
    extra = {}
    for key, value in stats.items():
        if isinstance(value, (tuple, list)):
            extra.update({f"{key}_pos_{j}": float(v) for j, v in enumerate(value)})
        elif isinstance(value, (int, float)):  # text (the KV cache's dtype) goes to LoadSnapshot.info
            extra[key] = float(value)
    return extra


def _is_awq_checkpoint(path: str) -> bool:
    """An HF directory whose config.json says AWQ (read here without the engine: json alone)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            quant = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return str(quant.get("quant_method", "")).lower() == "awq"


def _checked_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return list(ids)


def _constraint(request: GenerationRequest, parser: type[ToolParser]):
    """The output's grammar: the tool calls' (tool_choice required or named, in the parser's
    format) or the request's response_format / structured_outputs; never both."""
    tools = parser.grammar(request.tools, request.tool_choice, request.parallel_tool_calls)
    constraint = grammar_spec(request)
    if tools is not None and constraint is not None:
        raise InvalidRequestError("tool_choice 'required' or a named function already constrains the output; "
                                  "it cannot be combined with response_format or structured_outputs.",
                                  param="tool_choice")
    return tools or constraint


def _with_tool_calls(event: TokenEvent, parser: ToolParser,
                     hidden: HiddenMarkers | None = None) -> TokenEvent:
    """The event's text split into content and tool-call fragments, the markers kept only for the
    parser (`hidden`) out of the content; a request that called tools and stopped ends with
    finish_reason tool_calls."""
    text, deltas = parser.push(event.text)
    finish_reason = event.finish_reason
    if finish_reason is not None:
        tail, more = parser.finish()
        text, deltas = text + tail, deltas + more
        if finish_reason == "stop" and parser.num_calls:
            finish_reason = "tool_calls"
    if hidden is not None:
        text = hidden.push(text) + (hidden.finish() if finish_reason is not None else "")
    return dataclasses.replace(event, text=text, tool_calls=tuple(deltas), finish_reason=finish_reason)


def hidden_markers(parser: ToolParser, tokenizer: Tokenizer) -> HiddenMarkers | None:
    """The parser's markers that are special tokens of this model: kept in the engine's text for
    the parser, out of the content; None where it reads none of them (SmolLM2: all are text)."""
    markers = tuple(m for m in getattr(parser, "special_markers", ()) if tokenizer.special_token_id(m) is not None)
    return HiddenMarkers(markers) if markers else None


def _skip_special_tokens(request: GenerationRequest) -> bool:
    """vLLM's skip_special_tokens extension (default true); the gateway checked it is a boolean."""
    value = request.extra.get("skip_special_tokens", True)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"skip_special_tokens must be a boolean, got {value!r}.", param="skip_special_tokens")
    return value


def _cache_salt(request: GenerationRequest) -> str | None:
    """vLLM's cache_salt (a non-empty string; absent or null: none), for the engine's first block hash."""
    value = request.extra.get("cache_salt")
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {json.dumps(value)}.", param="cache_salt")
    return value


def _engine_sampling(request: GenerationRequest) -> EngineSampling:
    """The gateway's sampling parameters as the engine's, field for field: the two types have the
    same fields (tests/plugins/test_native_settings.py), so nothing is dropped on the way."""
    return EngineSampling(**dataclasses.asdict(request.sampling))


def _token_event(out: RequestOutput, want_logprobs: bool, every_usage: bool = False) -> TokenEvent:
    """One engine output as a token event; usage on the last (or, with `every_usage`, on each:
    the counts so far)."""
    usage = None
    if out.finished or every_usage:
        usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
    logprobs = ()
    if want_logprobs and out.logprobs:
        logprobs = tuple(
            TokenLogprob(
                token=lp.token, logprob=lp.sampled.logprob, token_id=lp.sampled.token_id,
                top=tuple(TopLogprob(text, logprob, tid) for text, (tid, logprob) in zip(lp.top_tokens, lp.sampled.top)),
            )
            for lp in out.logprobs
        )
    return TokenEvent(
        text=out.new_text, token_ids=tuple(out.new_token_ids), logprobs=logprobs,
        finish_reason=out.finish_reason, usage=usage, timings=out.timings,
        kv_transfer_params=out.kv_transfer_params,
    )


def _engine_info(stats: dict) -> dict[str, str]:
    """What does not change while it runs: the KV cache's configuration, the weights' format
    (`weights`, e.g. "int4 AWQ g64"), the CPU kernels' path (`cpu_kernels`: "avx512", "avx2";
    absent where none runs), prompt chunks' paths (`prefill`: "matmuls bf16, attention bf16") and
    the context length (`max_model_len`): /v1/models shows the last four."""
    info = _cache_info(stats)
    for key in ("weights", "cpu_kernels", "prefill"):
        if stats.get(key):
            info[key] = stats[key]
    if stats.get("max_model_len"):
        info["max_model_len"] = str(stats["max_model_len"])
    return info


def _cache_info(stats: dict) -> dict[str, str]:
    """The KV cache's configuration under vLLM's label names (`vllm:cache_config_info`)."""
    if not stats.get("kv_cache_dtype"):
        return {}
    return {"block_size": str(stats["block_size"]), "cache_dtype": stats["kv_cache_dtype"],
            "num_gpu_blocks": str(stats["kv_blocks_total"])}


def _problem(sup: EngineSupervisor) -> str:
    if sup.crash_looped:
        return f"engine crash loop, stays down (last death: {sup.last_cause})"
    cause = f" (last death: {sup.last_cause})" if sup.last_cause else ""
    return f"engine {sup.state}{cause}"


def make_native_backend(settings: dict, deployment: str) -> NativeBackend:
    try:
        return NativeBackend(NativeSettings.model_validate(settings), name=deployment)
    except ValidationError as exc:
        raise settings_error(exc) from None
