"""The native engine behind the gateway's Backend protocol.

The engine core runs in its own process (`native_backend.process.client.AsyncEngineClient`), so HTTP
serving never waits on a forward pass; a supervisor restarts it when it dies or hangs
(`supervisor.py`). This side tokenizes (the model's own chat template), turns engine outputs
into token events, maps engine refusals onto OpenAI errors, and reports load from the engine's
periodic stats. It never imports torch: the engine process loads the model and unpacks the
tokenizer once; this side then reads the unpacked tokenizer.

The deployment's settings are settings.py's (`NativeSettings`); the conversions between the
gateway's requests and the engine's, both ways, are mapping.py's; this module holds the backend
and its factory.

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

from pydantic import ValidationError

from gateway.backend import (
    TRANSFER_PARAMS, Backend, Capabilities, DetokenizeRequest, EmbeddingRequest, EmbeddingResult, GenerationRequest,
    KVEventsSource, LoadSnapshot, LoRAState, TokenizeRequest, TokenizeResult)
from gateway.config import settings_error
from gateway.errors import BackendError, ContextLengthExceeded, InvalidRequestError, Overloaded
from kvgate_native.embeddings import check_embedding_request, input_path, pooled_vectors
from kvgate_native.engine_errors import api_error
from kvgate_native.lora_resolver import DirectoryResolver
from kvgate_native.mapping import (
    MAX_CHARS_PER_TOKEN, cache_salt, checked_token_ids, engine_info, engine_sampling, flat_stats, hidden_markers,
    request_grammar, skip_special_tokens, text_chars, token_event, with_tool_calls)
from kvgate_native.settings import NativeSettings
from kvgate_native.supervisor import UP, EngineSupervisor
from kvgate_native.tool_parsers import ToolParser, tool_parser
from kvgate_native.tools import chat_prompt_ids, uses_tools
from native_backend.config.engine import GrammarOptions
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.execution.kv_transfer.trust import share_local_key
from native_backend.process.client import AsyncEngineClient
from native_backend.process.kv_publisher import binds as publisher_binds
from native_backend.process.protocol import EngineDeadError, LoRARefused
from native_backend.text.tokenizer import Tokenizer

log = logging.getLogger("kvgate.native")
TOKENIZE_THREADS = 2

ENGINE_FACTORY = "native_backend.process.factory:make_engine_core"
NATIVE_CAPABILITIES = Capabilities(endpoints=frozenset({"chat", "completions", "tokenize"}),
                                   features=frozenset({"logprobs", "n", "json_object", "json_schema", "tools"}),
                                   extras=frozenset({"structured_outputs", "skip_special_tokens", "cache_salt"}))
EMBEDDING_CAPABILITIES = dataclasses.replace(NATIVE_CAPABILITIES,
                                             endpoints=NATIVE_CAPABILITIES.endpoints | {"embeddings"})


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
        directory = settings.lora_resolver_dir
        self.lora_resolver = DirectoryResolver(directory) if directory and self.config.lora.enable_lora else None
        self._resolving: dict[str, asyncio.Lock] = {}  # an adapter being loaded on its first request
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
        extra = flat_stats(stats)
        extra["engine_restarts"] = float(sup.restarts)
        return LoadSnapshot(
            waiting=int(stats.get("num_waiting", 0)),
            running=int(stats.get("num_running", 0)),
            kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
            capacity=self.settings.max_num_seqs,
            healthy=up,
            extra=extra,
            info={**engine_info(stats), "root": self.config.model.path},
            problem=None if sup.state == UP else _problem(sup),
            fatal=sup.crash_looped,
            incarnation=sup.incarnation,
            lora=self._lora_state(stats.get("lora")),
        )

    def _lora_state(self, engine: dict | None) -> LoRAState | None:
        """The adapters this deployment serves (as loaded through it: a load shows at once, not
        at the next stats) and those of the engine's running and waiting requests."""
        lora = self.config.lora
        if not lora.enable_lora:
            return None
        engine = engine or {}
        found = self.lora_resolver.adapters() if self.lora_resolver is not None else {}
        return LoRAState(max_loras=lora.max_loras, adapters={**found, **lora.lora_modules},
                         running=tuple(engine.get("running", ())), waiting=tuple(engine.get("waiting", ())))

    async def _resolve_lora(self, name: str) -> None:
        """An adapter of lora_resolver_dir not loaded yet is loaded now (once, however many of its
        requests arrive together); one the engine refuses fails its requests with the reason."""
        if name in self.config.lora.lora_modules or self.lora_resolver is None:
            return
        path = self.lora_resolver.adapters().get(name)
        if path is None:
            return  # not in the directory (any more): the engine says it is not loaded
        async with self._resolving.setdefault(name, asyncio.Lock()):
            if name not in self.config.lora.lora_modules:
                await self.load_lora_adapter(name, path)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """vLLM's /v1/load_lora_adapter on this engine; kept in the engine's config, so a restarted
        engine serves it too. The engine's refusal (it names the adapter) is a 400 on lora_path."""
        await self._lora_call(self.client.load_lora, name, path)
        self._set_adapters({**self.config.lora.lora_modules, name: path})

    async def unload_lora_adapter(self, name: str) -> None:
        await self._lora_call(self.client.unload_lora, name)
        self._set_adapters({n: p for n, p in self.config.lora.lora_modules.items() if n != name})

    async def _lora_call(self, call, *args) -> None:
        if not self.config.lora.enable_lora:
            raise InvalidRequestError(f"Deployment '{self.name}' runs without enable_lora.", param="lora_name")
        if not self.supervisor.up:
            raise Overloaded(f"The engine of deployment '{self.name}' is {self.supervisor.state}.", retry_after_s=5)
        try:
            await call(*args)
        except LoRARefused as exc:
            raise InvalidRequestError(f"Deployment '{self.name}': {exc}", param="lora_path" if len(args) > 1
                                      else "lora_name") from None
        except EngineDeadError as exc:
            raise BackendError(f"The engine of deployment '{self.name}' is not running: {exc}") from None

    def _set_adapters(self, modules: dict[str, str]) -> None:
        lora = dataclasses.replace(self.config.lora, lora_modules=modules)
        self.config = dataclasses.replace(self.config, lora=lora)

    async def generate(self, request: GenerationRequest):
        client = self.client
        if not self.supervisor.up:
            raise Overloaded(f"The engine of deployment '{self.name}' is {self.supervisor.state}.", retry_after_s=5)
        if request.needs.adapter is not None:
            await self._resolve_lora(request.needs.adapter)
        skip_special = skip_special_tokens(request)
        parser = hidden = None
        if uses_tools(request.tools, request.tool_choice):
            parser = self.tool_parser(max_calls=1 if request.parallel_tool_calls is False else None)
            hidden = hidden_markers(parser, self._ready_tokenizer()) if skip_special else None
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=await self._tokenized(request),
            sampling=engine_sampling(request),
            priority=request.priority,
            trace_context=dict(request.trace_context),
            grammar=request_grammar(request, self.tool_parser),
            kv_transfer_params=request.extra.get(TRANSFER_PARAMS),
            skip_special_tokens=skip_special,
            kept_special_tokens=hidden.markers if hidden else (),
            cache_salt=cache_salt(request),
            lora_name=request.needs.adapter,
        )
        want_logprobs = request.sampling.logprobs is not None
        try:
            async with contextlib.aclosing(client.generate(engine_request)) as outputs:
                async for out in outputs:
                    event = token_event(out, want_logprobs, request.continuous_usage)
                    yield event if parser is None else with_tool_calls(event, parser, hidden)
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
            ids = checked_token_ids(request.tokens, tokenizer.vocab_size)
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
                return checked_token_ids(request.prompt, tokenizer.vocab_size)
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
        chars = text_chars(request.messages) if request.messages is not None else (
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
                ids.append(checked_token_ids(item, tokenizer.vocab_size) if isinstance(item, list)
                           else tokenizer.encode(item))
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param=input_path(i, len(inputs))) from None
            if not ids[-1]:
                raise InvalidRequestError("The input has no tokens.", param=input_path(i, len(inputs)))
        return ids


def _local_address(endpoint: str) -> str:
    """A ZMQ address a process on this machine connects to: tcp://*:p and tcp://0.0.0.0:p become
    tcp://127.0.0.1:p, tcp://[::]:p becomes tcp://[::1]:p; others are kept."""
    for wildcard, loopback in (("tcp://*:", "tcp://127.0.0.1:"), ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
                               ("tcp://[::]:", "tcp://[::1]:")):
        if endpoint.startswith(wildcard):
            return loopback + endpoint[len(wildcard):]
    return endpoint


def _is_awq_checkpoint(path: str) -> bool:
    """An HF directory whose config.json says AWQ (read here without the engine: json alone)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            quant = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return str(quant.get("quant_method", "")).lower() == "awq"


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
