"""Pooling requests' vectors from a step's final hidden states (the model's last norm, before the LM head).

    chunk rows:   [h0 h1 h2 | h3 h4]        a prompt of 5 tokens in two chunks
    last:          -------------- h4         the row of the prompt's last token
    mean:         (h0 + .. + h4) / 5         a running float32 sum kept here between chunks

Either vector is L2-normalised, as vLLM's embedding models return it (its `normalize` default),
so a dot product of two is their cosine similarity. A preempted or ended request's running sum
is dropped (the scheduler re-prefills a preempted mean-pooling request from its first token).
"""

from __future__ import annotations

import torch

from native_backend.core.batch import RunnerOutput, ScheduledChunk, step_tokens


class Pooler:
    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}  # request_id -> (sum of rows, rows so far)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._sums.pop(request_id, None)

    def pool(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, output: RunnerOutput) -> None:
        """Each pooling chunk's rows of `hidden` (num_tokens, hidden_size), in chunk order; a
        request whose prompt ends here gets its vector in output.pooled, a failing one an error."""
        start = 0
        for chunk in chunks:
            end = start + len(step_tokens(chunk))
            if chunk.pooling is not None:
                try:
                    vector = self._pool_chunk(chunk, hidden[start:end])
                except ValueError as exc:  # this request's bookkeeping: it ends alone
                    self._sums.pop(chunk.request_id, None)
                    output.errors[chunk.request_id] = f"pooling failed: {exc}"
                else:
                    if vector is not None:
                        output.pooled[chunk.request_id] = vector
            start = end

    def _pool_chunk(self, chunk: ScheduledChunk, rows: torch.Tensor) -> list[float] | None:
        """The request's vector when this chunk ends its prompt, else None (a mean's sum kept)."""
        ends_prompt = chunk.start_pos + len(chunk.token_ids) == len(chunk.prompt_token_ids)
        if chunk.pooling == "last":
            return _normalized(rows[-1].float()) if ends_prompt else None
        if chunk.pooling != "mean":
            raise ValueError(f"unknown pooling {chunk.pooling!r}")
        total, count = self._sums.pop(chunk.request_id, (None, 0))
        if count != chunk.start_pos:  # a mean over part of the prompt would be silently wrong
            raise ValueError(f"mean pooling saw {count} tokens before a chunk at position {chunk.start_pos}")
        chunk_sum = rows.float().sum(dim=0)
        total = chunk_sum if total is None else total + chunk_sum
        count += rows.shape[0]
        if ends_prompt:
            return _normalized(total / count)
        self._sums[chunk.request_id] = (total, count)
        return None


def _normalized(vector: torch.Tensor) -> list[float]:
    return torch.nn.functional.normalize(vector, dim=-1).tolist()
