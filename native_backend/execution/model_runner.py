"""Turns one `SchedulerOutput` into tensors, runs the model, samples: `execute`.

    chunks:      A: prefill 5 tokens (sample)   B: decode 1 token (sample)   C: chunk of 4 (no sample)
    input_ids:   [a0 a1 a2 a3 a4 | b0 | c0 c1 c2 c3]
    positions:   [ 0  1  2  3  4 | 17 | 8  9  10 11]       start_pos + row
    slots:       block_table[pos // block_size] * block_size + pos % block_size
    logits rows: the last `num_logits` rows of each sampling chunk: [a4, b0]

Speculative decoding: a chunk with drafts d_1 .. d_n (filled in by the executor's proposer,
execution.spec_decode) runs [last token, d_1 .. d_n] and its n + 1 logits rows are verified by
rejection sampling (`Sampler.verify`): it returns the accepted drafts plus one token, and
`RunnerOutput.drafts` says how many were given and accepted. Who made the drafts does not matter
here; a draft model's q (`draft_probs`) comes with them.

    chunk D: verify n=2:  input_ids [.. | d0 d1 d2 | ..]   logits rows [d0 d1 d2] -> e.g. [d1, x]

Pipeline parallelism (`link`, execution.parallel.stage_link): a stage after the first takes the
previous stage's (residual, delta) instead of embedding the tokens, and a stage before the last
sends its own on and returns an empty output: the last stage alone pools and samples.

The runner owns no request state beyond the sampler's per-request generators, dropped when the
scheduler reports a request finished. It binds the KV cache to the model once (each attention
layer takes its `KVLayer`); from then on a step passes only the step's tensors.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from native_backend.core.batch import DraftCounts, RunnerOutput, ScheduledChunk, SchedulerOutput, step_tokens
from native_backend.execution.pooler import Pooler
from native_backend.execution.sampler import Sampler, SamplingRow
from native_backend.model.attention.metadata import AttentionMetadata
from native_backend.model.kv_cache import KVCache


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (num_logit_rows,) int64: rows of the hidden states to project


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str | None = None,
                 sampler: Sampler | None = None, lora=None, link=None):
        self.model = model
        self.link = link  # a pipeline stage's StageLink; None: the whole model runs here
        self.kv_cache = kv_cache
        self.device = torch.device(device) if device is not None else kv_cache.device
        self.block_size = kv_cache.block_size
        self.sampler = sampler or Sampler()
        self.pooler = Pooler()  # pooling requests (embeddings): their vectors from the hidden states
        self.lora = lora  # lora.LoRAManager when LoRA is enabled: adapters per chunk (ScheduledChunk.lora_name)
        model.bind_kv_cache(kv_cache)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput, draft_probs: dict[str, torch.Tensor] | None = None) -> RunnerOutput:
        """Run one step; return the token(s) sampled for every chunk with `sample=True`, and the
        vector of every pooling request whose prompt ended.
        draft_probs: request_id -> q (n, vocab) of a draft model's drafts (absent: one-hot)."""
        self.sampler.forget(sched_out.finished_request_ids)
        self.pooler.forget(sched_out.finished_request_ids + sched_out.preempted_request_ids)
        output = RunnerOutput()
        if sched_out.is_empty:
            return output
        chunks, draft_probs = sched_out.chunks, draft_probs or {}
        inputs = self.prepare_inputs(chunks)
        hidden = self.forward(inputs, chunks)
        if hidden is None:
            return output  # a stage before the last: the next one has the hidden states
        if any(c.pooling is not None for c in chunks):
            self.pooler.pool(chunks, hidden, output)
        sampling_chunks = [c for c in chunks if c.sample]
        if not sampling_chunks:
            return output
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # (num_logit_rows, vocab)
        plain, verify, row = [], [], 0
        for chunk in sampling_chunks:  # logits rows: num_logit_rows per chunk, in chunk order
            (verify if chunk.draft_token_ids else plain).append((chunk, row))
            row += chunk.num_logit_rows
        self._sample(logits, plain, output)
        for chunk, row in verify:
            self._verify(chunk, logits[row : row + chunk.num_logit_rows], draft_probs.get(chunk.request_id), output)
        return output

    def _sample(self, logits: torch.Tensor, chunks: list[tuple[ScheduledChunk, int]], output: RunnerOutput) -> None:
        """One token for each chunk, batched; a request whose row fails lands in output.errors."""
        if not chunks:
            return
        rows = [_sampling_row(c) for c, _ in chunks]
        if len(chunks) < len(logits):  # verifications' rows in between: take the plain chunks' rows
            logits = logits.index_select(0, torch.tensor([r for _, r in chunks], device=logits.device))
        tokens, logprobs = self.sampler(logits, rows, errors=output.errors)
        for row, token, lp in zip(rows, tokens, logprobs):
            if row.request_id in output.errors:
                continue  # fails alone in Scheduler.update
            output.sampled_token_ids[row.request_id] = [token]
            if lp is not None:
                output.logprobs[row.request_id] = [lp]

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor, draft_probs, output: RunnerOutput) -> None:
        """One request's drafts through rejection sampling; its failure is its own."""
        try:
            tokens, logprobs = self.sampler.verify(logits, _sampling_row(chunk), chunk.draft_token_ids, draft_probs)
        except Exception as exc:  # noqa: BLE001 - this request's settings or drafts are the cause
            output.errors[chunk.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
            return
        output.sampled_token_ids[chunk.request_id] = tokens
        output.drafts[chunk.request_id] = DraftCounts(len(chunk.draft_token_ids), len(tokens) - 1)
        if logprobs[0] is not None:
            output.logprobs[chunk.request_id] = logprobs

    @torch.inference_mode()
    def compute_logits(self, sched_out: SchedulerOutput, all_tokens: bool = False) -> dict[str, torch.Tensor]:
        """Run one step (writing KV like `execute`) without sampling; request_id -> logits rows
        (num_logit_rows rows of each sampling chunk, or every token of every chunk with all_tokens).
        For tests and for speculative verification that wants the distributions."""
        inputs = self.prepare_inputs(sched_out.chunks)
        hidden = self.forward(inputs, sched_out.chunks)
        if hidden is None:
            return {}  # a stage before the last
        result, start = {}, 0
        for chunk in sched_out.chunks:
            end = start + len(step_tokens(chunk))
            if all_tokens:
                result[chunk.request_id] = self.model.compute_logits(hidden[start:end])
            elif chunk.sample:
                result[chunk.request_id] = self.model.compute_logits(hidden[end - chunk.num_logit_rows : end])
            start = end
        return result

    def forward(self, inputs: ModelInputs, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """The model over the step's tokens (with LoRA, each chunk's through its adapter):
        (num_tokens, hidden) after the final norm, or None on a pipeline stage before the last
        (which sends its (residual, delta) on)."""
        lora_step = nullcontext()
        if self.lora is not None:
            lora_step = self.lora.step([c.lora_name for c in chunks], [len(step_tokens(c)) for c in chunks])
        elif any(c.lora_name is not None for c in chunks):
            raise ValueError("a LoRA adapter was scheduled on an engine without enable_lora")
        link = self.link
        intermediate = link.recv(len(inputs.input_ids)) if link is not None and link.prev_rank is not None else None
        with lora_step:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata, intermediate)
        if link is not None and link.next_rank is not None:
            link.send(*hidden)
            return None
        return hidden

    def prepare_inputs(self, chunks: list[ScheduledChunk]) -> ModelInputs:
        """Flat tensors for the whole batch, built on the host and moved to the device once."""
        query_lens = [len(c.token_ids) + len(c.draft_token_ids) for c in chunks]
        context_lens = [c.start_pos + n for c, n in zip(chunks, query_lens)]
        for c, ctx in zip(chunks, context_lens):
            if len(c.block_table) * self.block_size < ctx:
                raise ValueError(f"request {c.request_id}: {len(c.block_table)} blocks cannot hold {ctx} tokens")
        md = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=[c.block_table for c in chunks],
            block_size=self.block_size,
            device=self.device,
        )
        input_ids = [t for c in chunks for t in step_tokens(c)]
        positions = [p for c, n in zip(chunks, query_lens) for p in range(c.start_pos, c.start_pos + n)]
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attn_metadata=md,
            logits_indices=_logits_indices(chunks, query_lens).to(self.device),
        )


def _logits_indices(chunks: list[ScheduledChunk], query_lens: list[int]) -> torch.Tensor:
    """Flat row ids of the last num_logit_rows tokens of each sampling chunk, in chunk order."""
    indices, end = [], 0
    for chunk, n in zip(chunks, query_lens):
        end += n
        if chunk.sample:
            indices.extend(range(end - chunk.num_logit_rows, end))
    return torch.tensor(indices, dtype=torch.long)


def _sampling_row(chunk: ScheduledChunk) -> SamplingRow:
    return SamplingRow(chunk.request_id, chunk.sampling, chunk.prompt_token_ids, chunk.output_token_ids,
                       chunk.token_bitmask)
