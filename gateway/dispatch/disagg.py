"""Prefill/decode disaggregation, driven by the gateway (issue 30).

A model whose deployments have roles (`role: prefill | decode`) serves each choice in two hops,
as vLLM's P/D proxy does, once the decode pool has admitted it:

0. admission: the request takes a slot on a decode deployment (waiting in the pool's queue if
   it must) before any prefill: a request the decode pool sheds (queue full, class shed, nothing
   up) makes no prefill hop, so no prefill engine holds its blocks for a decode that never comes
   (a vLLM engine's held blocks cannot be freed from outside; they would wait for
   VLLM_NIXL_ABORT_REQUEST_TIMEOUT, ours for kv_hold_timeout_s);
1. prefill: the request with max_tokens 1, not streamed, carrying `kv_transfer_params:
   {do_remote_decode: true, ...}`, on a prefill deployment chosen by the model's policy (load,
   or prefix affinity); one that fails hands the hop to another prefill deployment;
2. decode: the request as the client sent it, plus the `kv_transfer_params` the prefill
   answered, on the admitted decode deployment, failed over before its first token as any
   request is (another decode engine reads the same blocks, or recomputes them);
3. release: once the decode hop has its first token (its engine read the blocks, found them in
   its own cache, or recomputed them), or ended without one (every decode deployment failed,
   the client left, a fallback model took the request), no engine will read the prefill's
   blocks: the prefill deployment is told to free them now (`release_kv`, a backend's optional
   method: ours frees them at once; vLLM's NIXL connector has no such call and frees them after
   VLLM_NIXL_ABORT_REQUEST_TIMEOUT) rather than after its hold timeout.

The client sees one response; both hops carry its request id and are spans of its trace. The
decode pool serves the request colocated (the prompt computed there, counted by reason) when
the prompt is short (`disaggregation.min_prompt_chars`), when the body is passed through in
another API's shape (the gateway does not add fields to it), when no prefill deployment could
take the hop, or when the prefill answered no params (it stopped before its token limit).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass, replace

from gateway.backend import TRANSFER_PARAMS, GenerationRequest, TokenEvent
from gateway.dispatch.choices import (OpenChoice, admit, give_back, holds_probe, open_choice, open_on, scores, traced,
                                      with_failover)
from gateway.errors import APIError, request_fault
from gateway.pools.registry import Deployment, ModelPool
from gateway.routing.prompt_tokens import prompt_chars

log = logging.getLogger("kvgate.disagg")

# The prefill hop's params, as vLLM's proxy sends them: "compute the prompt, keep its blocks for a
# remote decode". The engine answers with where the decode side reads them.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
NOT_ON_PREFILL = ("min_tokens", "min_completion_tokens")  # they would run it past its one token
TRANSFER_SCOPE = "kv_transfer"  # a key scope: the caller is a gateway that drives P/D through this one
_releasing: set[asyncio.Task] = set()  # releases under way (a task nobody references may be collected)


@dataclass(eq=False)
class HeldPrefill:
    """A prefill hop's answer: the params of its held KV, and the deployment that holds it."""

    deployment: Deployment
    params: dict
    released: bool = False


def opener(pool: ModelPool):
    """How each choice of a request to `pool` is opened (choices.open_choices' `opener`)."""
    return open_disaggregated if pool.config.disaggregated else open_choice


async def open_disaggregated(registry, pool: ModelPool, index: int, request: GenerationRequest, ticket,
                             recorder) -> OpenChoice:
    """The choice admitted to the decode pool, its prefill hop, then its decode hop opened up to
    the first token."""
    admitted = await admit(pool, request, ticket, recorder)  # a shed request makes no prefill hop
    probe = holds_probe(admitted)
    try:
        held = await prefill_hop(pool, index, request, recorder)
    except BaseException:  # the request's fault (a 400), or the client left: the decode slot goes back
        give_back(pool, admitted, probe)
        raise
    params = held.params if held is not None else None
    metrics, model = recorder.metrics, recorder.model

    async def attempt(current: ModelPool, deployment: Deployment, sent: GenerationRequest, span, attempts: int):
        if current is not pool:  # a fallback model: other engines, nothing of this prompt to load
            sent = with_transfer(sent, None)
            release_unread(held, request.request_id)
        _mark_hop(span, "decode", params is not None)
        started = time.monotonic()
        try:
            choice = await open_on(current, deployment, index, sent)
        except APIError:
            metrics.pd_hops.labels(model, "decode", "failed").inc()
            raise
        metrics.pd_hops.labels(model, "decode", "ok").inc()
        metrics.pd_hop_seconds.labels(model, "decode").observe(time.monotonic() - started)
        choice.attempts, choice.span, choice.recorder = attempts, span, recorder
        return choice

    try:
        return await with_failover(registry, pool, with_transfer(request, params), ticket, recorder, attempt,
                                   admitted=admitted)
    finally:  # its first token came after its read (or its recompute), or it never will come
        release_unread(held, request.request_id)


def release_unread(held: HeldPrefill | None, request_id: str) -> None:
    """Tell `held`'s prefill deployment, once and without waiting, that no decode engine will
    read its blocks. A backend without `release_kv` (vLLM: its connector frees them after
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT) keeps them until its own timeout."""
    if held is None or held.released:
        return
    held.released = True
    release = held.deployment.backend.release_kv
    if release is not None:
        task = asyncio.get_running_loop().create_task(_release(held, release, request_id))
        _releasing.add(task)
        task.add_done_callback(_releasing.discard)


async def _release(held: HeldPrefill, release, request_id: str) -> None:
    try:
        await release(held.params)
    except Exception:  # noqa: BLE001 - the hold still ends on the engine's own timeout
        log.warning("request %s: releasing its prefill's KV on %s failed", request_id, held.deployment.name,
                    exc_info=True)


async def prefill_hop(pool: ModelPool, index: int, request: GenerationRequest, recorder) -> HeldPrefill | None:
    """The params a prefill deployment answered for `request`, and that deployment, trying each
    prefill deployment once; None (counted) when the decode pool is to compute the prompt itself.
    An error the request caused (a 400) ends it: the decode hop would say the same."""
    skip = colocated_reason(pool, request)
    if skip is not None:
        _count_colocated(recorder, skip)
        return None
    hop = prefill_request(request)
    tried: set[str] = set()
    while (deployment := pool.take(hop, exclude=frozenset(tried), role="prefill")) is not None:
        tried.add(deployment.name)
        try:
            last = await _prefill_on(pool, deployment, index, hop, recorder, len(tried))
        except APIError as exc:
            recorder.metrics.pd_hops.labels(recorder.model, "prefill", "failed").inc()
            if request_fault(exc):
                raise
            log.warning("request %s: prefill on %s failed (%s); trying another prefill deployment",
                        request.request_id, deployment.name, exc.code)
            continue
        recorder.metrics.pd_hops.labels(recorder.model, "prefill", "ok").inc()
        params = last.kv_transfer_params if last is not None else None
        if params is None:
            _count_colocated(recorder, "no_params")
            return None
        if not known_producer(pool, params):  # a decode engine would connect wherever it says
            log.warning("request %s: prefill on %s answered remote_host %r, remote_port %r, which is none of "
                        "model %s's prefill deployments; the decode computes the prompt", request.request_id,
                        deployment.name, params.get("remote_host"), params.get("remote_port"), pool.name)
            _count_colocated(recorder, "unknown_producer")
            return None
        return HeldPrefill(deployment, params)
    _count_colocated(recorder, "no_prefill")
    return None


async def _prefill_on(pool: ModelPool, deployment: Deployment, index: int, hop: GenerationRequest, recorder,
                      number: int) -> TokenEvent | None:
    """The prefill hop on `deployment` (its slot already claimed), read to its last event."""
    recorder.routed(pool, deployment, scores(pool, "prefill") if recorder.trace is not None else None, hop="prefill")
    span = recorder.attempt(deployment, deployment.upstream_model, number)
    _mark_hop(span, "prefill", True)
    started = time.monotonic()
    try:
        choice = await open_on(pool, deployment, index, traced(hop, recorder, span))
    except BaseException as exc:
        pool.release(deployment)
        error = exc if isinstance(exc, APIError) else None
        recorder.attempt_failed(span, deployment, error, retried=error is not None and not request_fault(error))
        raise
    choice.span, choice.recorder = span, recorder
    try:
        async for _ in choice.stream():
            pass
    finally:
        await choice.close()  # its slot, and its span
    recorder.metrics.pd_hop_seconds.labels(recorder.model, "prefill").observe(time.monotonic() - started)
    return choice.last_event


def engine_hop(parsed, key, body):
    """`parsed` (the parse dropped its transfer fields) carrying the body's `kv_transfer_params`
    again when the caller's key has the `kv_transfer` scope: a gateway in front of this one (a
    Kubernetes engine pod's) sending one of its hops. They go to the backend as the gateway's own
    hops do, past the capability check; the engine validates them (it reads only blocks that its
    producer holds for this very request, or recomputes)."""
    params = body.get(TRANSFER_PARAMS) if isinstance(body, dict) else None
    if not isinstance(params, dict) or not trusted(key):
        return parsed
    return replace(parsed, extra={**(parsed.extra or {}), TRANSFER_PARAMS: params})


def known_producer(pool: ModelPool, params: dict) -> bool:
    """Whether `params` (a prefill's answer) name no producer, or one of `pool`'s prefill
    deployments as its backend says where decode engines reach it (`kv_producer_address`:
    host, and port where the deployment knows it). A deployment that cannot say is no match."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if host is None and port is None:
        return True
    for deployment in pool.deployments:
        address = getattr(deployment.backend, "kv_producer_address", None) if deployment.role == "prefill" else None
        known = address() if address is not None else None
        if known is not None and _same_host(known[0], host) and known[1] in (None, port):
            return True
    return False


def _same_host(known: str, named) -> bool:
    if not isinstance(named, str):
        return False
    try:
        return ipaddress.ip_address(known.strip("[]")) == ipaddress.ip_address(named.strip("[]"))
    except ValueError:  # a DNS name: the same name
        return known.lower().rstrip(".") == named.lower().rstrip(".")


def trusted(key) -> bool:
    """Whether `key` may send and receive transfer params (scope kv_transfer)."""
    return key is not None and TRANSFER_SCOPE in key.scopes


def answered_params(choices) -> dict | None:
    """The transfer params a prefill hop's backend answered (vLLM returns them top-level)."""
    last = choices[0].last_event if len(choices) == 1 else None
    return last.kv_transfer_params if last is not None else None


def colocated_reason(pool: ModelPool, request: GenerationRequest) -> str | None:
    """Why `request` skips the prefill hop, or None when it takes it."""
    if request.passthrough is not None:
        return "passthrough"
    if prompt_chars(request) < pool.config.disaggregation.min_prompt_chars:
        return "short_prompt"
    return None


def prefill_request(request: GenerationRequest) -> GenerationRequest:
    """The prefill hop: one token, in one piece, asking the engine to keep the prompt's KV."""
    extra = {k: v for k, v in request.extra.items() if k not in NOT_ON_PREFILL}
    extra[TRANSFER_PARAMS] = dict(PREFILL_PARAMS)
    sampling = replace(request.sampling, max_tokens=1, max_tokens_default=False, logprobs=None)
    return replace(request, sampling=sampling, stream=False, continuous_usage=False, extra=extra)


def with_transfer(request: GenerationRequest, params: dict | None) -> GenerationRequest:
    """`request` carrying the prefill's `params` (None: carrying none)."""
    extra = {k: v for k, v in request.extra.items() if k != TRANSFER_PARAMS}
    if params is not None:
        extra[TRANSFER_PARAMS] = params
    return replace(request, extra=extra)


def _count_colocated(recorder, reason: str) -> None:
    recorder.metrics.pd_colocated.labels(recorder.model, reason).inc()


def _mark_hop(span, hop: str, with_kv: bool) -> None:
    if span is not None:
        span.set_attribute("kvgate.pd.hop", hop)
        if hop == "decode":
            span.set_attribute("kvgate.pd.remote_kv", with_kv)
