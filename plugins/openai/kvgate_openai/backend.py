"""The `openai` backend: any OpenAI-compatible server behind one shared connection pool.

Every choice becomes one streaming upstream request (stream=true, usage included), and every
upstream chunk becomes a token event the moment it arrives. Refusals before the first token are
raised as the matching gateway error; failures after it as BackendError or BackendTimeout, which
the gateway sends as one error event.

    generate ──POST──> upstream ──SSE──> SSEDecoder ──json──> chunk_event ──> TokenEvent
       │                                                                     (held back only
       └─ deadline: first_byte_s to the first token, then idle_s per chunk    at the finish, for
                                                                              the usage chunk)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import replace
from urllib.parse import urlsplit

import gateway
from gateway import fastjson
from gateway.backend import (
    TRANSFER_PARAMS, Backend, Capabilities, GenerationRequest, KVEventsSource, LoadSnapshot, TokenEvent, Usage)
from gateway.errors import APIError, BackendError, BackendTimeout, Overloaded, RateLimited
from gateway.idle import IdleWatch
from kvgate_openai import relay, upstream_errors, wire
from kvgate_openai.load import LoadTracker, poll_forever
from kvgate_openai.h1 import HeadLimits
from kvgate_openai.pool import ClientPool
from kvgate_openai.settings import OpenAISettings
from kvgate_openai.sse import EventTooLarge, SSEDecoder
from kvgate_openai.token_calls import TokenCalls
from kvgate_openai.transport import AnswerTooLarge, Response, StreamBroken, UpstreamUnreachable

log = logging.getLogger("kvgate.openai")

TRACE_HEADERS = ("traceparent", "tracestate")
DONE = b"[DONE]"
MAX_ERROR_BODY = 64 * 1024


class OpenAIBackend(TokenCalls, Backend):
    """Generation here; embeddings and tokenize in token_calls.TokenCalls."""

    def __init__(self, settings: OpenAISettings, name: str = "openai"):
        self.settings = settings
        self.name = name
        self.tracker = LoadTracker(settings)
        self._pool: ClientPool | None = None
        self._scrapes: ClientPool | None = None
        self._poller: asyncio.Task | None = None
        self._responses: dict[str, Response] = {}
        self._aborted: set[str] = set()
        self._scrub = upstream_errors.Scrubber(None)
        self._capabilities = settings.declared()
        # What this kind of server needs done to a body (llama-cpp-python says some things its own way).
        self._adapt_body = wire.for_llama_cpp_python if settings.server == "llama_cpp_python" else None

    def capabilities(self) -> Capabilities:
        """Its server kind's defaults, with the deployment's `settings.capabilities` over them."""
        return self._capabilities

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        key = self._api_key()
        self._scrub = upstream_errors.Scrubber(key)
        s = self.settings
        # Named, as aiohttp named itself before h1.py (some upstreams and their proxies log it).
        headers = {"content-type": "application/json", "user-agent": f"kvgate/{gateway.__version__}"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        # Reads are bounded by our own first-byte and idle deadlines (they differ); waiting for
        # a pooled connection counts towards the first byte.
        limits = HeadLimits(s.max_response_headers, s.max_response_head_bytes)
        self._pool = ClientPool(s.max_connections, s.keepalive_expiry_s, headers=headers, connect_s=s.connect_s,
                                head_limits=limits)
        url = s.scrape_url()
        if url:  # one scrape at a time, on a connection of its own
            self._scrapes = ClientPool(1, s.keepalive_expiry_s, headers=headers, connect_s=s.connect_s,
                                       head_limits=limits)
            self._poller = asyncio.create_task(poll_forever(self._scrapes, url, self.tracker, self.name))

    def kv_producer_address(self) -> tuple[str, int | None]:
        """Where decode engines read this deployment's prefills (gateway.dispatch.disagg): the
        upstream's host (a vLLM pod's side channel, or the kvgate engine pod's producer, listens
        there), on a port the gateway does not know."""
        return urlsplit(self.settings.base_url).hostname or "", None

    def _api_key(self) -> str | None:
        env = self.settings.api_key_env
        if env is None:
            return None
        key = os.environ.get(env)
        if not key:
            raise RuntimeError(f"deployment '{self.name}': environment variable {env} (settings.api_key_env) is not set")
        return key

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for pool in (self._pool, self._scrapes):
            if pool is not None:
                await pool.aclose()
        self._pool = self._scrapes = None

    def kv_events_source(self) -> KVEventsSource | None:
        """The upstream engine's KV events as `settings.kv_events` declares them (vLLM, SGLang)."""
        events = self.settings.kv_events
        return KVEventsSource(**events.model_dump()) if events is not None else None

    def load(self) -> LoadSnapshot:
        return self.tracker.snapshot()

    async def abort(self, request_id: str) -> None:
        """Close the upstream response: the upstream sees the disconnect and stops generating."""
        response = self._responses.get(request_id)
        if response is not None:
            self._aborted.add(request_id)
            await response.aclose()

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest):
        """One token event at a time (the plugin contract); the gateway reads `generate_batches`."""
        batches = self.generate_batches(request)
        try:
            async for batch in batches:
                for event in batch:
                    yield event
        finally:
            await batches.aclose()

    async def generate_batches(self, request: GenerationRequest):
        """The events of each upstream read in one list: the tokens of a burst pass the gateway's
        layers once, not once each (an upstream that writes faster than we read sends several
        chunks per read)."""
        path, body = wire.request_body(request, self.settings.chat_max_tokens_field)
        if self._adapt_body is not None:
            self._adapt_body(body)
        deadline = asyncio.get_running_loop().time() + self.settings.first_byte_s
        pool = self._claim()
        response = None
        idle = IdleWatch(self.settings.idle_s)  # the gaps between chunks, once the first token is in
        try:
            response = await self._send(pool, self.settings.base_url + path, body, request, deadline)
            self._responses[request.request_id] = response
            if request.stream or _is_event_stream(response):  # some servers stream regardless
                # Closed here, not left to the garbage collector: a dropped async generator is
                # closed through the loop's finalizer hook (an eventfd write, a wake-up and a task
                # per stream, between the last tokens and their write to the client).
                reader = (self._relayed(response, request, deadline, idle) if request.passthrough is not None
                          else self._events(response, request, path == wire.CHAT, deadline, idle))
                async with contextlib.aclosing(reader) as events:
                    async for batch in events:
                        yield batch
            else:
                yield [await self._whole(response, request, path == wire.CHAT, deadline)]
        finally:
            idle.close()
            await self._free(pool, request, response)

    async def post_once(self, url: str, body: dict, request) -> object:
        """One JSON call that generates nothing (embeddings, tokenize): sent as a generation is,
        on the same connections and deadline, its answer read whole; the same errors."""
        deadline = asyncio.get_running_loop().time() + self.settings.first_byte_s
        pool = self._claim()
        response = None
        try:
            response = await self._send(pool, url, body, request, deadline)
            self._responses[request.request_id] = response
            try:
                return await self._read_json(response, deadline)
            except StreamBroken as exc:
                raise self._broken(exc) from None
        finally:
            await self._free(pool, request, response)

    def _claim(self) -> ClientPool:
        """The connection pool, with this request counted in flight (until `_free`)."""
        pool = self._pool
        if pool is None:
            raise BackendError(f"The backend '{self.name}' is not started.")
        pool.take()
        self.tracker.inflight += 1
        return pool

    async def _free(self, pool: ClientPool, request, response: Response | None) -> None:
        pool.give_back()
        self.tracker.inflight -= 1
        self._responses.pop(request.request_id, None)
        self._aborted.discard(request.request_id)
        if response is not None:
            await response.aclose()

    async def _send(self, pool: ClientPool, url: str, body: dict, request, deadline: float) -> Response:
        headers = {k: v for k, v in request.trace_context.items() if k in TRACE_HEADERS}
        if isinstance(body, dict) and TRANSFER_PARAMS in body:
            # A disaggregated request's hops share one id, as vLLM's P/D proxy sends it: the
            # engines' logs (and NIXL's remote_request_id) name the same request.
            headers["x-request-id"] = request.request_id
        content = fastjson.dumps(body)
        try:
            async with asyncio.timeout_at(deadline):
                response = await pool.send("POST", url, content=content, headers=headers)
        except TimeoutError:
            if pool.saturated:  # it waited for a connection, not for the upstream
                raise Overloaded(f"All {self.settings.max_connections} connections to '{self.name}' are busy.") from None
            raise self._first_byte_timeout() from None
        except AnswerTooLarge as exc:
            raise self._over_limits(exc) from None
        except UpstreamUnreachable as exc:
            raise self._connection_failed(exc) from None
        self.tracker.succeeded()
        if response.status_code != 200:
            raise await self._refusal(response, deadline)
        return response

    async def _refusal(self, response: Response, deadline: float) -> APIError:
        try:
            async with asyncio.timeout_at(deadline):
                raw = await _read_some(response, MAX_ERROR_BODY)
        except (TimeoutError, StreamBroken):
            raw = b""
        finally:
            await response.aclose()
        try:
            body = fastjson.loads(raw)
        except ValueError:
            body = {"error": {"message": raw.decode(errors="replace").strip()}} if raw.strip() else None
        error = upstream_errors.for_status(response.status_code, body, response.headers, self.name, self._scrub)
        if isinstance(error, (RateLimited, Overloaded)):
            self.tracker.throttled(float(error.headers.get("retry-after-ms", 1000)) / 1000)
        if response.status_code in (401, 403):
            log.warning("deployment %s: the upstream rejected our credentials (HTTP %s)", self.name, response.status_code)
        return error

    async def _events(self, response: Response, request: GenerationRequest, chat: bool, deadline: float,
                      idle: IdleWatch):
        """Lists of token events, one per upstream read that held any; the finishing event waits
        for the usage chunk, and ends the last list."""
        decoder, chunks = SSEDecoder(self.settings.max_event_bytes), response.aiter_bytes()
        finish: TokenEvent | None = None
        usage: Usage | None = None
        sent = 0
        done = False
        # The client named no max_tokens and the bound was not sent (see wire): the upstream runs
        # to its own default, and the stream is cut here at the bound (a chunk is about a token).
        bound = request.sampling.max_tokens if request.sampling.max_tokens_default else None
        while not done:
            try:
                data = await self._next_chunk(chunks, deadline if not sent else None, idle)
            except (BackendError, BackendTimeout):
                if finish is not None:  # it said all it had to say, then misbehaved
                    break
                if request.request_id in self._aborted:
                    yield [TokenEvent(finish_reason="abort", usage=usage)]
                    return
                raise
            batch = []
            try:
                for payload in self._payloads(decoder, data):
                    if payload == DONE:
                        done = True
                        break
                    chunk = self._decode(payload, sent)
                    own = self._usage(chunk) if chunk.get("usage") else None  # most chunks carry none
                    if own is not None:
                        usage = own
                    event = wire.chunk_event(chunk, chat, own)
                    if event is None:
                        continue
                    if event.finish_reason:
                        finish = event
                        continue
                    sent += 1
                    batch.append(event)
                    if bound is not None and sent >= bound:
                        batch.append(TokenEvent(finish_reason="length", usage=usage or Usage(0, sent)))
                        yield batch  # closing the answer (the caller's finally) stops the upstream
                        return
            except APIError:
                if batch:  # the tokens before the error came first: they go out first
                    yield batch
                raise
            if done:
                if batch and not response.complete():  # the drain may wait: the text goes first
                    yield batch
                    batch = []
                await self._drain(chunks)
                batch.append(self._last(finish, usage, sent, request, ended_cleanly=True))
                yield batch
                return
            if batch:
                yield batch
            if data is None:
                break
        yield [self._last(finish, usage, sent, request, ended_cleanly=False)]

    async def _relayed(self, response: Response, request: GenerationRequest, deadline: float,
                       idle: IdleWatch):
        """A passed-through stream (relay.py): lists of its events as they came, one per upstream
        read, up to the event that ends the response."""
        decoder, chunks = SSEDecoder(self.settings.max_event_bytes), response.aiter_bytes()
        sent, failed = 0, False
        while True:
            try:
                data = await self._next_chunk(chunks, deadline if not sent else None, idle)
            except (BackendError, BackendTimeout):
                if request.request_id in self._aborted:
                    yield [TokenEvent(finish_reason="abort")]
                    return
                raise
            batch = []
            for payload in self._payloads(decoder, data):
                if payload == DONE:  # not in the Responses API, but harmless
                    continue
                try:
                    event = relay.stream_event(payload)
                except ValueError:
                    raise BackendError(f"The backend '{self.name}' sent a stream event that is not a "
                                       "typed JSON object.") from None
                batch.append(event)
                sent += 1
                failed = failed or relay.is_error(event)
                if event.finish_reason:
                    yield batch
                    await self._drain(chunks)
                    return
            if data is None and failed:  # it said why it stopped: that was its last word
                yield batch + [TokenEvent(finish_reason="stop")]
                return
            if batch:
                yield batch
            if data is None:
                raise BackendError(f"The backend '{self.name}' ended the stream before it finished.")

    def _usage(self, chunk: dict) -> Usage | None:
        try:
            return wire.usage_of(chunk)
        except ValueError as exc:
            log.warning("deployment %s: upstream usage refused: %s", self.name, exc)
            raise BackendError(f"The backend '{self.name}' sent an invalid usage: {exc}.") from None

    def _payloads(self, decoder: SSEDecoder, data: bytes | None) -> list[bytes]:
        try:
            return decoder.close() if data is None else decoder.feed(data)
        except EventTooLarge:
            log.warning("deployment %s: upstream stream event over %d bytes", self.name, decoder.max_event_bytes)
            raise BackendError(f"The backend '{self.name}' sent a stream event over "
                               f"{decoder.max_event_bytes} bytes.") from None

    async def _whole(self, response: Response, request: GenerationRequest, chat: bool,
                     deadline: float) -> TokenEvent:
        """The single event of a non-streamed answer, read whole within the first-byte deadline."""
        try:
            if request.passthrough is not None:  # relayed as it came (a Responses object has an "error" field)
                raw = await self._read_raw(response, deadline)
                return self._relayed_whole(raw)
            body = await self._read_json(response, deadline)
        except StreamBroken as exc:
            if request.request_id in self._aborted:
                return TokenEvent(finish_reason="abort")
            raise self._broken(exc) from None
        try:
            return wire.whole_event(body, chat)
        except ValueError as exc:  # a field we read and cannot trust (a usage count)
            raise BackendError(f"The backend '{self.name}' sent an answer that is not an OpenAI response: "
                               f"{exc}.") from None
        except (AttributeError, TypeError):
            raise BackendError(f"The backend '{self.name}' sent an answer that is not an OpenAI response.") from None

    def _relayed_whole(self, raw: bytes) -> TokenEvent:
        try:
            return relay.whole_event(fastjson.loads(raw), raw)
        except (ValueError, AttributeError, TypeError):
            raise BackendError(f"The backend '{self.name}' sent an answer that is not a response object.") from None

    async def _read_json(self, response: Response, deadline: float) -> object:
        """A whole answer as JSON, within the first-byte deadline and max_body_bytes; a body
        with an `error` is raised as its gateway error. StreamBroken passes through."""
        raw = await self._read_raw(response, deadline)
        try:
            body = fastjson.loads(raw)
            error = upstream_errors.for_stream_error(body, self.name, self._scrub) if (
                isinstance(body, dict) and "error" in body) else None
        except (ValueError, AttributeError, TypeError):
            raise BackendError(f"The backend '{self.name}' sent an answer that is not JSON.") from None
        if error is not None:
            raise error
        return body

    async def _read_raw(self, response: Response, deadline: float) -> bytes:
        """A whole answer's bytes, within the first-byte deadline and max_body_bytes."""
        limit = self.settings.max_body_bytes
        read = _read_some(response, limit + 1)
        try:
            if response.complete():  # usually so by now: no timer for a read that cannot wait
                raw = await read
            else:
                async with asyncio.timeout_at(deadline):
                    raw = await read
        except TimeoutError:
            raise self._first_byte_timeout() from None
        if len(raw) > limit:
            log.warning("deployment %s: upstream answer over %d bytes", self.name, limit)
            raise BackendError(f"The backend '{self.name}' sent an answer over {limit} bytes.")
        return raw

    def _broken(self, exc: Exception) -> BackendError:
        if isinstance(exc, AnswerTooLarge):
            return self._over_limits(exc)
        log.warning("deployment %s: upstream answer broke: %s", self.name, type(exc).__name__)
        return BackendError(f"The backend '{self.name}' dropped the connection.")

    def _over_limits(self, exc: AnswerTooLarge) -> BackendError:
        log.warning("deployment %s: upstream answer refused: %s", self.name, exc)
        return BackendError(f"The backend '{self.name}' sent an answer this gateway refuses: {exc}.")

    async def _drain(self, chunks) -> None:
        """Read the stream to its end after [DONE]: a response read to the end returns its
        connection to the pool; one closed early costs a new TCP connection per request."""
        try:
            async with asyncio.timeout(self.settings.idle_s):
                async for _ in chunks:
                    pass
        except (TimeoutError, StreamBroken):
            pass  # the connection is closed instead of reused; the answer is complete either way

    async def _next_chunk(self, chunks, deadline: float | None, idle: IdleWatch) -> bytes | None:
        """The next bytes from upstream, None at the end of the stream, within the first-byte
        deadline (until the first token) or the idle limit (after it)."""
        try:
            if deadline is None:
                return await idle.read(anext(chunks))
            async with asyncio.timeout_at(deadline):
                return await anext(chunks)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            if deadline is None:
                raise BackendTimeout(
                    f"The backend '{self.name}' sent nothing for {self.settings.idle_s:g} s mid-stream."
                ) from None
            raise self._first_byte_timeout() from None
        except AnswerTooLarge as exc:
            raise self._over_limits(exc) from None
        except StreamBroken as exc:
            log.warning("deployment %s: upstream stream broke: %s", self.name, exc)
            raise BackendError(f"The backend '{self.name}' dropped the stream.") from None

    def _decode(self, payload: bytes, sent: int) -> dict:
        try:
            chunk = fastjson.loads(payload)
        except ValueError:
            raise BackendError(f"The backend '{self.name}' sent a stream chunk that is not JSON.") from None
        if not isinstance(chunk, dict):
            raise BackendError(f"The backend '{self.name}' sent a stream chunk that is not an object.")
        if "error" in chunk or chunk.get("object") == "error":
            error = upstream_errors.for_stream_error(chunk, self.name, self._scrub)
            if sent and not isinstance(error, (BackendError, BackendTimeout)):
                # After the first token the client can only learn of it as a failed stream.
                error = BackendError(f"The backend '{self.name}' failed mid-stream: {error.message}")
            raise error
        return chunk

    def _last(self, finish, usage, sent, request, ended_cleanly: bool) -> TokenEvent:
        if finish is None:
            if request.request_id in self._aborted:
                return TokenEvent(finish_reason="abort", usage=usage)
            if not ended_cleanly:
                raise BackendError(f"The backend '{self.name}' ended the stream before it finished.")
            finish = TokenEvent(finish_reason="stop")  # [DONE] without a finish_reason
        return replace(finish, usage=usage or Usage(0, sent + (1 if finish.text else 0)))

    def _first_byte_timeout(self) -> BackendTimeout:
        return BackendTimeout(
            f"The backend '{self.name}' sent no token within {self.settings.first_byte_s:g} s."
        )

    def _connection_failed(self, exc: Exception) -> BackendError:
        self.tracker.failed()
        log.warning("deployment %s: cannot reach the upstream: %s", self.name, exc)
        return BackendError(f"The backend '{self.name}' cannot be reached.")


def _is_event_stream(response: Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


async def _read_some(response: Response, limit: int) -> bytes:
    """At most `limit` bytes of the body (the rest is never read)."""
    parts, size = [], 0
    async for part in response.aiter_bytes():
        parts.append(part)
        size += len(part)
        if size >= limit:
            break
    return b"".join(parts)[:limit]
