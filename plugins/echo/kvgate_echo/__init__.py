"""kvgate-echo: a deterministic backend plugin.

Its reply is a function of the prompt and the seed alone: the prompt's words, starting at
`seed % len(words)` and cycling, one word per token. It can be slowed down and made to fail in
chosen ways, which makes it the fixture for gateway tests and the backend of the overhead
benchmark. It also embeds (a unit vector per input, from a hash of its words) and tokenizes
(one token per word, `token_id(word)`; detokenize maps ids it has seen back to their words,
others to `t<id>`, the word a token-id prompt reads as). It is also the template for a third-party backend: one module, one `@hookimpl`, one
entry point in the `kvgate` group (see this folder's pyproject.toml).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.backend import (
    Backend, Capabilities, DetokenizeRequest, EmbeddingRequest, EmbeddingResult, GenerationRequest, LoadSnapshot,
    TokenEvent, TokenizeRequest, TokenizeResult, TokenLogprob, Usage)
from gateway.config import settings_error
from gateway.errors import BackendError, ContextLengthExceeded, InvalidRequestError
from gateway.hookspecs import hookimpl

WORD = re.compile(r"\S+")
ECHO_CAPABILITIES = Capabilities(endpoints=frozenset({"chat", "completions", "embeddings", "tokenize"}),
                                 features=frozenset({"logprobs", "n"}))
EMBEDDING_SIZE = 16
BOS_ID = 1  # what add_special_tokens adds at the start, as a model's BOS token
SEEN_WORDS = 65536  # ids detokenize remembers (the oldest are forgotten)


class EchoSettings(BaseModel):
    """What a deployment's `settings:` may hold for `backend: echo`."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_second: float = Field(0.0, ge=0, description="0 means as fast as possible.")
    first_token_delay_s: float = Field(0.0, ge=0, description="Extra wait before the first token.")
    default_max_tokens: int = Field(16, gt=0, description="Tokens to send when the request sets none.")
    max_context: int = Field(4096, gt=0, description="Prompt + max_tokens limit, in tokens (words).")
    max_concurrency: int = Field(0, ge=0, description="Reported capacity; 0 means unknown.")
    fail_after_tokens: int | None = Field(None, ge=0, description="Raise after this many tokens.")
    stall_after_tokens: int | None = Field(None, ge=0, description="Hang after this many tokens.")
    refuse_at_start: bool = Field(False, description="start() raises: a backend that cannot start.")


class EchoBackend(Backend):
    def __init__(self, settings: EchoSettings, name: str = "echo"):
        self.settings = settings
        self.name = name
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self.started = False
        self.aborted_ids: list[str] = []  # every id ever aborted, for tests and debugging
        self.info = {"max_model_len": str(settings.max_context)}  # /v1/models shows it
        self._words: dict[int, str] = {}  # token id -> word, for detokenize

    def capabilities(self) -> Capabilities:
        return ECHO_CAPABILITIES

    async def start(self) -> None:
        if self.settings.refuse_at_start:
            raise RuntimeError(f"echo deployment '{self.name}' refuses to start (refuse_at_start)")
        self.started = True

    async def stop(self) -> None:
        self.started = False

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)
        self.aborted_ids.append(request_id)

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(
            running=len(self._running),
            capacity=self.settings.max_concurrency,
            kv_cache_usage=_usage(len(self._running), self.settings.max_concurrency),
            info=self.info,
        )

    async def generate(self, request: GenerationRequest):
        words = prompt_words(request)
        max_tokens = self._check_lengths(request, len(words))
        self._running.add(request.request_id)
        try:
            async with contextlib.aclosing(self._stream(request, words, max_tokens)) as events:
                async for event in events:  # closed here when the gateway stops early, not by the GC
                    yield event
        finally:
            self._running.discard(request.request_id)
            self._aborted.discard(request.request_id)

    def _check_lengths(self, request: GenerationRequest, prompt_len: int) -> int:
        s = request.sampling
        if s.max_tokens is None or s.max_tokens_default:  # the client named none: ours, in its bound and context
            max_tokens = min(s.max_tokens or self.settings.default_max_tokens, self.settings.default_max_tokens,
                             max(1, self.settings.max_context - prompt_len))
        else:
            max_tokens = s.max_tokens
        if prompt_len + max_tokens > self.settings.max_context:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.settings.max_context} tokens; "
                f"the prompt has {prompt_len} and max_tokens is {max_tokens}.",
                param="max_tokens",
            )
        if prompt_len == 0:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        return max_tokens

    async def _stream(self, request: GenerationRequest, words: list[str], max_tokens: int):
        if self.settings.first_token_delay_s:
            await asyncio.sleep(self.settings.first_token_delay_s)
        pieces, finish_reason = reply_pieces(words, request.sampling.seed or 0, max_tokens, request.sampling.stop)
        marks = {"arrived": time.time()}  # milestones on the last event, as engines report them
        marks["scheduled"] = marks["arrived"]
        for i, (word, piece) in enumerate(pieces):
            await self._pace(i)
            if request.request_id in self._aborted:
                return
            marks.setdefault("first_token", time.time())
            last = i + 1 == len(pieces)
            yield TokenEvent(
                text=piece,
                token_ids=(token_id(word),),
                logprobs=_logprobs(request, word),
                finish_reason=finish_reason if last else None,
                usage=Usage(len(words), i + 1) if last or request.continuous_usage else None,
                timings={**marks, "finished": time.time(), "prefill_chunks": 1.0} if last else None,
            )
        if not pieces:  # a stop string matched at the very start: nothing to send
            yield TokenEvent(finish_reason=finish_reason, usage=Usage(len(words), 0))

    async def _pace(self, index: int) -> None:
        s = self.settings
        if s.fail_after_tokens is not None and index >= s.fail_after_tokens:
            raise BackendError(f"echo deployment '{self.name}' failed after {index} tokens (fault injection)")
        if s.stall_after_tokens is not None and index >= s.stall_after_tokens:
            await asyncio.Event().wait()  # hang until cancelled
        if s.tokens_per_second:
            await asyncio.sleep(1.0 / s.tokens_per_second)
        elif index and index % 64 == 0:
            await asyncio.sleep(0)  # let other requests run between long bursts


    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        words = [_input_words(item) for item in request.inputs]
        size = request.dimensions or EMBEDDING_SIZE
        return EmbeddingResult([unit_vector(w, size) for w in words], sum(map(len, words)))

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        if request.messages is not None:
            words = [w for m in request.messages for w in WORD.findall(_content_text(m.get("content")))]
        else:
            words = WORD.findall(request.prompt or "")
        tokens = [self._remember(w) for w in words]
        if request.add_special_tokens:
            tokens, words = [BOS_ID] + tokens, ["<s>"] + words
        return TokenizeResult(tokens, self.settings.max_context, words if request.return_token_strs else None)

    async def detokenize(self, request: DetokenizeRequest) -> str:
        return " ".join(self._words.get(t) or ("<s>" if t == BOS_ID else f"t{t}") for t in request.tokens)

    def _remember(self, word: str) -> int:
        tid = token_id(word)
        self._words[tid] = word
        if len(self._words) > SEEN_WORDS:
            del self._words[next(iter(self._words))]
        return tid


def unit_vector(words: list[str], size: int) -> list[float]:
    """A deterministic unit vector for a list of words."""
    digest = hashlib.blake2b(" ".join(words).encode(), digest_size=64).digest()
    raw = [digest[i % 64] - 127.5 + i / size for i in range(size)]
    norm = sum(x * x for x in raw) ** 0.5
    return [x / norm for x in raw]


def _input_words(item: str | list[int]) -> list[str]:
    return [f"t{t}" for t in item] if isinstance(item, list) else WORD.findall(item)


def prompt_words(request: GenerationRequest) -> list[str]:
    if request.messages is not None:
        users = [m for m in request.messages if m.get("role") == "user"]
        text = _content_text(users[-1].get("content")) if users else ""
    elif isinstance(request.prompt, list):
        text = " ".join(f"t{t}" for t in request.prompt)
    else:
        text = request.prompt or ""
    return WORD.findall(text)


def _content_text(content) -> str:
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def token_id(word: str) -> int:
    """A stable id per word, so token ids are a function of the text too."""
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % 50_000


def reply_pieces(words: list[str], seed: int, max_tokens: int, stops) -> tuple[list, str]:
    """The whole reply as (word, text piece) pairs, cut before the first stop string.

    The reply is known up front, so a stop string is cut exactly and never emitted, even when it
    spans several tokens.
    """
    start = seed % len(words)
    chosen = [words[(start + i) % len(words)] for i in range(max_tokens)]
    pieces = [(w, w if i == 0 else " " + w) for i, w in enumerate(chosen)]
    text = "".join(p for _, p in pieces)
    cut = min((text.find(s) for s in stops if s and s in text), default=None)
    if cut is None:
        return pieces, "length"
    kept, used = [], 0
    for word, piece in pieces:
        if used + len(piece) > cut:
            if cut > used:
                kept.append((word, piece[: cut - used]))
            break
        kept.append((word, piece))
        used += len(piece)
    return kept, "stop"


def _logprobs(request: GenerationRequest, word: str) -> tuple[TokenLogprob, ...]:
    if request.sampling.logprobs is None:
        return ()
    return (TokenLogprob(token=word, logprob=-0.125, token_id=token_id(word)),)


def _usage(running: int, capacity: int) -> float:
    return min(1.0, running / capacity) if capacity else 0.0


def make_echo_backend(settings: dict, deployment: str) -> EchoBackend:
    try:
        return EchoBackend(EchoSettings.model_validate(settings), name=deployment)
    except ValidationError as exc:
        raise settings_error(exc) from None


@hookimpl
def register_backends(register, config):
    register("echo", make_echo_backend)
