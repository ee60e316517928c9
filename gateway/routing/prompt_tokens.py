"""The prompt as the engines read it (token ids), for routing by what they cache (precise_prefix).

The policy's `choose` is synchronous (it runs inside `ModelPool.take`), so the prompt is turned
into token ids before it, in an async step (`PromptTokens.prepare`), never stalling the event loop:

    a token-id prompt                 the ids as sent
    a tokenizer in this process       backend.prompt_token_ids(request) (native: the engine's
      (backend.prompt_token_ids)      tokenizer and chat template): inline up to INLINE_CHARS,
                                      past that on this module's threads, waited for timeout_s
    a tokenizer behind the backend    backend.tokenize(...): vLLM's POST /tokenize (chat: messages
      (backend.tokenize: vLLM, SGLang) and tools through the server's own template), within timeout_s

The ids go into a small LRU keyed by a hash of the prompt, where `choose` finds them, as do a
disaggregated request's prefill hop, the other choices of an n > 1 request and a retried take.
Requests with the same prompt arriving together share one tokenization (the first one's; the
others wait for it). Any failure (a timeout, an error, an answer that is not token ids) leaves the
prompt without ids: the policy then routes by approximate affinity. A deployment whose /tokenize
failed is not asked again for FAILURE_BACKOFF_S, so a server without /tokenize costs one timeout,
not one per request; those back-offs are dropped once over (deployments come and go).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import time
from collections import OrderedDict

from gateway.backend import GenerationRequest, TokenizeRequest
from gateway.capabilities import Needs
from gateway.errors import APIError, request_fault

log = logging.getLogger("kvgate.routing")

# Prompts up to this many characters are tokenized inline, at most ~0.3 ms of the loop's time
# (bench/route_tokenize.py); a longer one (up to 15-25 ms at max_prompt_chars) goes to a thread.
INLINE_CHARS = 1024
THREADS = 2  # tokenizing threads per model: a burst of long prompts queues here, not on the loop
FAILURE_BACKOFF_S = 30.0
# A request's vendor fields that change what its prompt renders to (vLLM's chat request and
# /tokenize take them both): sent along to /tokenize, and part of the prompt's key.
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message")
TOKENIZE = Needs("tokenize")


def prompt_key(request) -> bytes | None:
    """A digest of what tokenizing the request reads (text prompt, or messages with tools);
    None for a token-id prompt or a request that has no prompt."""
    messages = getattr(request, "messages", None)
    prompt = getattr(request, "prompt", None)
    template = _template_fields(request)
    if messages is not None:
        material = json.dumps([messages, getattr(request, "tools", None), getattr(request, "tool_choice", None),
                               template], sort_keys=True, default=str)
    elif isinstance(prompt, str):
        material = json.dumps(template, sort_keys=True, default=str) + prompt if template else prompt
    else:
        return None
    return hashlib.blake2b(material.encode(), digest_size=16).digest()


def _template_fields(request) -> dict:
    extra = getattr(request, "extra", None) or {}
    return {k: extra[k] for k in TEMPLATE_FIELDS if k in extra}


def _token_id_prompt(request) -> list[int] | None:
    prompt = getattr(request, "prompt", None)
    return prompt if isinstance(prompt, list) and getattr(request, "messages", None) is None else None


class PromptTokens:
    """Recent prompts' token ids (LRU), and the async step that fills it."""

    def __init__(self, max_chars: int, timeout_s: float, kept: int):
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.kept = kept
        self._ids: OrderedDict[bytes, list[int]] = OrderedDict()
        self._backoff: dict[str, float] = {}  # deployment -> monotonic time its /tokenize may be asked again
        self._pending: dict[bytes, asyncio.Future] = {}  # prompt key -> done when its tokenization ends
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False  # a reload replaced the policy: late requests get no threads
        self.remote_failures = 0
        self.local_timeouts = 0  # long prompts the threads did not tokenize within timeout_s

    @property
    def failures(self) -> int:
        """Prompts not turned into ids in time for routing (routed by affinity)."""
        return self.remote_failures + self.local_timeouts

    def ids(self, request, deployments) -> list[int] | None:
        """The request's prompt ids if known now: a token-id prompt, a prepared one, or a short one
        a local tokenizer turns into ids inline; None otherwise."""
        ids = _token_id_prompt(request)
        if ids is not None:
            return self._local_now(request, deployments, ids)
        key = prompt_key(request)
        if key is None:
            return None
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
            return ids
        if prompt_chars(request) <= INLINE_CHARS:
            ids = self._local_now(request, deployments, None)
            if ids:
                self._keep(key, ids)
        return ids

    async def prepare(self, request, deployments) -> None:
        """Tokenize the request's prompt (if it has text, is not known yet and is not too long)
        with the first of `deployments` that can, and keep the ids for `ids`."""
        key = prompt_key(request)
        if key is None or key in self._ids:
            return
        chars = prompt_chars(request)
        if chars > self.max_chars:
            return
        shared = self._pending.get(key)
        if shared is not None:  # another request is tokenizing this prompt: its ids serve this one too
            await asyncio.shield(shared)  # this request's cancellation must not end the other's wait
            return
        self._pending[key] = shared = asyncio.get_running_loop().create_future()
        try:
            ids = await self._tokenized(request, deployments, chars > INLINE_CHARS, key)
            if ids:
                self._keep(key, ids)
        finally:  # ids or none, even when this request was cancelled: the others go on to choose
            del self._pending[key]
            shared.set_result(None)

    def close(self) -> None:
        """Stop the threads; prompts queued for them get no ids (their requests go on)."""
        self._closed = True
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def _keep(self, key: bytes, ids: list[int]) -> None:
        self._ids[key] = ids
        if len(self._ids) > self.kept:
            self._ids.popitem(last=False)

    def _local_now(self, request, deployments, default):
        """backend.prompt_token_ids of the first deployment that has one (inline); `default`
        when none has, None when it fails (the request's own errors surface in generate)."""
        local = next((d.backend.prompt_token_ids for d in deployments if d.backend.prompt_token_ids is not None), None)
        if local is None:
            return default
        try:
            return local(request)
        except Exception:  # noqa: BLE001 - advisory
            return None

    async def _tokenized(self, request, deployments, long: bool, key: bytes) -> list[int] | None:
        local = next((d for d in deployments if d.backend.prompt_token_ids is not None), None)
        if local is not None:
            if not long:
                return self._local_now(request, [local], None)
            return await self._on_thread(local.backend.prompt_token_ids, request)
        now = time.monotonic()
        remote = [d for d in deployments if d.capabilities.serves(TOKENIZE) and self._backoff.get(d.name, 0.0) <= now]
        if not remote:
            return None
        return await self._asked(remote[int.from_bytes(key[:4], "big") % len(remote)], request)  # spread by prompt

    async def _on_thread(self, tokenize, request) -> list[int] | None:
        if self._closed:
            return None
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="kvgate-route-tokenize")
        job = self._threads.submit(tokenize, request)
        try:
            # Bounded as a backend's /tokenize is: a burst of long prompts queued behind busy
            # threads, or a tokenizer that hangs, costs a request timeout_s, then affinity.
            # (A job still queued is cancelled; one running finishes on its thread, unread.)
            return await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except TimeoutError:
            self.local_timeouts += 1
            if self.local_timeouts == 1 or self.local_timeouts % 1000 == 0:
                log.warning("precise_prefix: %d long prompts were not tokenized within %g s; "
                            "routed by prefix affinity", self.local_timeouts, self.timeout_s)
            return None
        except asyncio.CancelledError:
            if job.cancelled() and not asyncio.current_task().cancelling():
                return None  # `close` dropped it from the queue: this request itself goes on
            raise
        except Exception:  # noqa: BLE001 - advisory
            return None

    async def _asked(self, d, request) -> list[int] | None:
        """The prompt's ids from the deployment's server (/tokenize), or None (and a back-off)."""
        template = _template_fields(request)
        ask = TokenizeRequest(request_id=f"{request.request_id}-route", model=d.upstream_model,
                              prompt=request.prompt if request.messages is None else None,
                              messages=request.messages, tools=request.tools,
                              add_special_tokens=template.pop("add_special_tokens", None),
                              add_generation_prompt=template.pop("add_generation_prompt", True),
                              continue_final_message=template.pop("continue_final_message", False),
                              trace_context=dict(request.trace_context), extra=template)
        try:
            answer = await asyncio.wait_for(d.backend.tokenize(ask), self.timeout_s)
            ids = answer.tokens
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ValueError("the answer is not a list of token ids")
            return ids
        except Exception as exc:  # noqa: BLE001 - advisory: any failure routes by affinity
            if isinstance(exc, APIError) and request_fault(exc):
                return None  # the prompt itself was refused (its generation will say why): not the server's fault
            self.remote_failures += 1
            now = time.monotonic()
            self._backoff = {name: until for name, until in self._backoff.items() if until > now}
            self._backoff[d.name] = now + FAILURE_BACKOFF_S
            log.warning("precise_prefix: /tokenize on deployment %s failed (%s); routing by prefix affinity "
                        "without asking it for %g s", d.name, _why(exc), FAILURE_BACKOFF_S)
            return None


def _why(exc: Exception) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer in time"
    return str(exc) or type(exc).__name__


def prompt_chars(request: GenerationRequest) -> int:
    """The prompt's size in characters (token ids count one each): what the short-prompt
    threshold compares, known without a tokenizer."""
    if request.messages is not None:
        return sum(_content_chars(m.get("content")) for m in request.messages)
    return len(request.prompt or "")


def _content_chars(content) -> int:
    if isinstance(content, list):  # content parts
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return len(content or "")
