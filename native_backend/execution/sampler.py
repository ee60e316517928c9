"""Batched sampling with per-row settings.

One row of logits per sampled position. The order of operations, per row:

    raw logits ──> grammar mask (constrained rows only, in place: tokens the grammar forbids -> -inf;
        │           numpy on the CPU, a Triton kernel on CUDA: execution.token_mask)
        │
        ├─ logprobs (log_softmax after the mask, before penalties: what the API reports)
        │
        ├─ repetition penalty (HF: over prompt + output; divide positive logits, multiply negative)
        ├─ presence / frequency penalties (OpenAI: over output only; subtract)
        ├─ greedy rows: argmax, done
        ├─ temperature, then top-k, top-p, min-p masks
        └─ draw: argmax(probs / Exponential(1) noise)  (== a categorical draw)

Seeded requests draw their noise from their own `torch.Generator`, created on first sight and
kept across steps, so a seed gives the same tokens whatever else shares the batch. Unseeded rows
share the sampler's generator.

Speculative verification (`verify`): one request's k + 1 rows, each the target's distribution
after the drafts before it (penalties see those drafts as output), go through the same steps
and then `spec_decode.rejection`. A seeded request draws one vocab-sized noise row per position,
and its generator is rewound to the first position not emitted, so it draws exactly what it
would have drawn without speculation.

One request's settings must not fail the others' tokens. The engine refuses bad values when a
request arrives (`SamplingParams.check`); should a batch still raise, each row is sampled on
its own and only the rows that raise again fail (reported in `errors`, token FAILED).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from native_backend.core.batch import SampledLogprobs
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.spec_decode.rejection import accepted_prefix, rejection_sample
from native_backend.execution.token_mask import apply_token_bitmasks


@dataclass
class SamplingRow:
    """What the sampler needs about the request behind one row of logits."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    token_bitmask: np.ndarray | None = None  # constrained decoding: the tokens allowed next


# A token the grammar forbids has logprob -inf; the API reports OpenAI's floor instead (JSON has no -inf).
MIN_LOGPROB = -9999.0

FAILED = -1  # the token of a row whose sampling raised (its request fails alone)


class Sampler:
    def __init__(self, seed: int | None = None):
        self._generators: dict[str, torch.Generator] = {}  # request_id -> its seeded generator
        self._shared_seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def forget(self, request_ids) -> None:
        """Drop state of requests that ended."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], errors: dict[str, str] | None = None
    ) -> tuple[list[int], list[SampledLogprobs | None]]:
        """logits: (num_rows, vocab). Returns one token per row, and logprobs where asked for.

        With `errors`, a failure is isolated to the rows that cause it: request_id -> message
        lands in `errors` and the row's token is FAILED. Without it, a failure raises."""
        if errors is None:
            return self._sample(logits, rows)
        try:
            return self._sample(logits, rows)
        except Exception:  # noqa: BLE001 - find the culprit rows, keep the rest of the batch
            return self._row_by_row(logits, rows, errors)

    def _row_by_row(self, logits, rows, errors) -> tuple[list[int], list[SampledLogprobs | None]]:
        """Each row alone (the rare path). A seeded row whose generator had already drawn in the
        failed batch draws again, so its stream shifts by one draw in this step only."""
        tokens: list[int] = []
        logprobs: list[SampledLogprobs | None] = []
        for i, row in enumerate(rows):
            try:
                (token,), (lp,) = self._sample(logits[i : i + 1], [row])
            except Exception as exc:  # noqa: BLE001 - this row's settings are the cause
                errors[row.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
                token, lp = FAILED, None
            tokens.append(token)
            logprobs.append(lp)
        return tokens, logprobs

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[SampledLogprobs | None]]:
        logits = apply_token_bitmasks(logits.float(), [r.token_bitmask for r in rows])
        logprobs = self._logprobs(logits, rows)
        logits = apply_penalties(logits, rows)
        tokens = logits.argmax(dim=-1)  # (num_rows,): right for greedy rows, replaced for others
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = sampling_probs(logits[idx], [rows[i].params for i in random_rows])
            noise = self._exponential_noise(probs, [rows[i] for i in random_rows])
            tokens[idx] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        if logprobs is not None:
            logprobs = [_pick_logprobs(lp, t, r) for lp, t, r in zip(logprobs, token_list, rows)]
        else:
            logprobs = [None] * len(rows)
        return token_list, logprobs

    def verify(self, logits: torch.Tensor, row: SamplingRow, drafts: list[int],
               draft_probs: torch.Tensor | None = None) -> tuple[list[int], list[SampledLogprobs | None]]:
        """logits: (k + 1, vocab), the target's rows after [last token, d_1 .. d_k]; draft_probs:
        (k, vocab) q of a draft model, None for n-gram drafts. Returns the accepted drafts plus
        one token, and logprobs for them where asked for."""
        k, p = len(drafts), row.params
        # Only penalties read the history: copy it with the drafts only for them.
        rows = [SamplingRow(row.request_id, p, row.prompt_token_ids, row.output_token_ids + drafts[:j])
                for j in range(k + 1)] if _has_penalty(p) else [row] * (k + 1)
        logits = logits.float()
        logprobs = self._logprobs(logits, rows)
        logits = apply_penalties(logits, rows)
        if p.greedy:  # a one-hot target: any draft is compared with the argmax (rejection's one-hot case)
            emitted = accepted_prefix(logits.argmax(dim=-1).tolist(), drafts)
        else:
            probs = sampling_probs(logits, [p] * (k + 1))  # (k + 1, vocab)
            noise, uniform, rewind = self._verify_noise(probs, row, with_uniform=draft_probs is not None)
            draft_ids = torch.tensor([drafts], dtype=torch.long, device=logits.device)
            tokens, num_accepted = rejection_sample(
                probs[None], draft_ids, noise[None], None if draft_probs is None else draft_probs[None].float(),
                None if uniform is None else uniform[None])
            emitted = tokens[0, : int(num_accepted[0]) + 1].tolist()
            rewind(len(emitted))
        if logprobs is None:
            return emitted, [None] * len(emitted)
        return emitted, [_pick_logprobs(logprobs[j], t, row) for j, t in enumerate(emitted)]

    def _verify_noise(self, probs: torch.Tensor, row: SamplingRow, with_uniform: bool):
        """(noise (k + 1, vocab), uniform (k,) in (0, 1] or None, rewind(num_emitted)).

        Per position: one vocab-sized Exp(1) row (what the plain sampler draws per token), then
        a uniform for the acceptance test of a draft model's token. A seeded generator is wound
        back to the state before the first position that emitted nothing."""
        num_rows, device = probs.shape[0], probs.device
        seeded = row.params.seed is not None
        gen = self._generator_for(row, device) if seeded else self._shared_generator(device)
        noise, uniform = torch.empty_like(probs), torch.ones(num_rows - 1, device=device)
        states = []
        for j in range(num_rows):
            if seeded:
                states.append(gen.get_state())
            noise[j].exponential_(generator=gen)
            if with_uniform and j < num_rows - 1:
                uniform[j] = 1.0 - torch.rand((), generator=gen, device=device)
        if not with_uniform:
            uniform = None

        def rewind(num_emitted: int) -> None:
            if seeded and num_emitted < num_rows:
                gen.set_state(states[num_emitted])

        return noise, uniform, rewind

    # ------------------------------------------------------------------ internals

    def _logprobs(self, logits: torch.Tensor, rows: list[SamplingRow]):
        if all(r.params.logprobs is None for r in rows):
            return None
        return torch.log_softmax(logits, dim=-1)  # raw: before penalties and temperature

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)  # (num_random_rows, vocab)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                (len(unseeded), probs.shape[1]), device=probs.device
            ).exponential_(generator=self._shared_generator(probs.device))
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                # Exactly one vocab-sized draw per sampled token: the stream depends on nothing else.
                noise[i].exponential_(generator=self._generator_for(row, probs.device))
        return noise

    def _generator_for(self, row: SamplingRow, device) -> torch.Generator:
        gen = self._generators.get(row.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(row.params.seed)
            self._generators[row.request_id] = gen
        return gen

    def _shared_generator(self, device) -> torch.Generator:
        device = torch.device(device)
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._shared_seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._shared_seed)
            self._shared[device] = gen
        return gen


# ------------------------------------------------------------------------------ pure functions


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (HF semantics, prompt + output) then presence/frequency (OpenAI, output only)."""
    rows_to_penalise = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not rows_to_penalise:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows_to_penalise:  # a loop over rows, each one vectorised over its tokens
        p, row = rows[i].params, logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(rows[i].prompt_token_ids + rows[i].output_token_ids, dtype=torch.long)
            seen = seen.to(logits.device).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            out = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)  # (vocab,)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(rows, vocab) probabilities after temperature and the top-k / top-p / min-p filters."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        too_unlikely = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(too_unlikely, 0.0)  # the max always survives
    return probs


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """One descending sort serves both filters; the best token always survives."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (rows, vocab)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    remove = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of better tokens
    remove |= mass_before >= top_p[:, None]  # keep the smallest prefix reaching top_p
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _pick_logprobs(row_logprobs: torch.Tensor, token: int, row: SamplingRow) -> SampledLogprobs | None:
    k = row.params.logprobs
    if k is None:
        return None
    top = ()
    if k > 0:
        values, ids = row_logprobs.topk(k)
        top = tuple(zip(ids.tolist(), values.clamp(min=MIN_LOGPROB).tolist()))
    return SampledLogprobs(token_id=token, logprob=max(float(row_logprobs[token]), MIN_LOGPROB), top=top)
