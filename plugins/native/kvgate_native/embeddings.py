"""/v1/embeddings on the native engine: each input a pooling request of the engine process.

    inputs ──tokenize (plugin threads)──> [ids, ids, ...] ──one EngineRequest(pooling=...) each──>
    engine: prefilled in the budget of ordinary steps, mixed with the decodes in flight; nothing
    sampled; KV freed on the step that ran the last token ──> one L2-normalised vector each

The vector is the model's final hidden state (after its last norm, what the LM head reads),
pooled over the input's tokens: the last token's (`last`, the default: a causal model's last
position is the only one that has read the whole input, as in vLLM's decoder-based embedding
models) or the mean of all of them (`mean`). A deployment pools one way (`embeddings.pooling`).

An input the engine refuses (too long, a token id outside the vocabulary) is a 400 naming its
path (`input[2]`); its siblings are aborted at once, and the engine goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.backend import EmbeddingRequest
from gateway.errors import BackendError, InvalidRequestError, RequestFailed
from kvgate_native.engine_errors import api_error
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.process.protocol import EngineDeadError


class EmbeddingSettings(BaseModel):
    """`settings.embeddings` of a native deployment."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Declare /v1/embeddings (the model's card in /v1/models lists it).")
    pooling: Literal["last", "mean"] = Field("last", description="last: the last token's final hidden state; "
                                             "mean: the mean over the input's tokens. L2-normalised either way.")


def check_embedding_request(request: EmbeddingRequest, settings: EmbeddingSettings, deployment: str) -> None:
    """What the engine cannot honour, refused before any work."""
    if not settings.enabled:  # the gateway routes none here; a direct caller gets the same answer
        raise InvalidRequestError(f"Deployment '{deployment}' does not serve embeddings (embeddings.enabled: false).",
                                  param="model", code="unsupported_endpoint")
    if request.dimensions is not None:
        # Cutting a vector short keeps its meaning only for a model trained for it (Matryoshka);
        # a decoder's hidden state is not one, so the number is refused, not silently honoured.
        raise InvalidRequestError(f"'dimensions' is not supported by deployment '{deployment}': its model was not "
                                  "trained for shortened (Matryoshka) embeddings; leave it out for the full vector.",
                                  param="dimensions", code="unsupported_parameter")


async def pooled_vectors(client, request: EmbeddingRequest, ids: list[list[int]], pooling: str,
                         deployment: str) -> list[list[float]]:
    """One vector per input, in order. The first input that fails ends the call (its siblings are
    aborted in the engine); so does the caller's cancellation."""
    tasks = [asyncio.ensure_future(_pooled(client, request, i, input_ids, pooling, deployment, len(ids)))
             for i, input_ids in enumerate(ids)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # the siblings of a failed input: their generate() aborts them in the engine
            task.add_done_callback(_quietly)


async def _pooled(client, request: EmbeddingRequest, index: int, ids: list[int], pooling: str, deployment: str,
                  count: int) -> list[float]:
    engine_request = EngineRequest(request_id=f"{request.request_id}-{index}", prompt_token_ids=ids,
                                   priority=request.priority, trace_context=dict(request.trace_context),
                                   pooling=pooling)
    where = input_path(index, count)
    try:
        async with contextlib.aclosing(client.generate(engine_request)) as outputs:
            async for out in outputs:
                if out.embedding is not None:
                    return out.embedding
    except EngineError as exc:
        raise api_error(exc, param=where) from None
    except EngineDeadError as exc:
        raise BackendError(f"The engine of deployment '{deployment}' is not running: {exc}") from None
    raise RequestFailed(f"The engine ended {where} without its embedding.")


def input_path(index: int, count: int) -> str:
    return "input" if count == 1 else f"input[{index}]"


def _quietly(task: asyncio.Task) -> None:
    """A sibling's own failure, once the call already failed: its error was not the answer."""
    if not task.cancelled():
        task.exception()
