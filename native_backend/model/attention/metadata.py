"""What attention needs to know about one step's batch, built once per step by the model runner.

The batch is flat: the tokens of all sequences are concatenated. For sequence s:

    rows of q / k / v:    query_start_loc[s] .. query_start_loc[s+1]-1      (query_lens[s] rows)
    positions of those:   context_lens[s] - query_lens[s] .. context_lens[s]-1
    keys it may attend:   positions 0 .. context_lens[s]-1, causally (key_pos <= query_pos)
    where the keys live:  block_tables[s, pos // block_size] * block_size + pos % block_size

`context_lens` counts cached + new tokens, so decode (query_len 1), a whole prompt, a later chunk
of a prompt and a prefix-cache hit are the same case.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache row that receives each token's K/V
    # (num_seqs, max_blocks) int64 (indexes the cache directly on CPU), padded with block 0 (masked)
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32, cumulative query_lens
    query_lens: torch.Tensor  # (num_seqs,) int32: new tokens this step
    context_lens: torch.Tensor  # (num_seqs,) int32: cached + new tokens
    max_query_len: int
    max_context_len: int
    block_size: int
    # Host copies, so CPU-side branching and per-sequence loops never wait on the device.
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    # Per-step scratch a backend derives once from the fields above and every layer reuses
    # (the reference backend keeps its gather indices, masks and workspaces here).
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        *,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """From per-sequence lists; the slot of each new token follows from its block table.

        Built with a few list comprehensions and one tensor per field: this runs every step.
        """
        num_seqs = len(query_lens)
        max_blocks = max(max((len(t) for t in block_tables), default=0), 1)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        tables = torch.tensor(padded, dtype=torch.long).view(num_seqs, max_blocks)
        start_loc = [0]
        for n in query_lens:
            start_loc.append(start_loc[-1] + n)
        bs = block_size
        slots = [
            table[pos // bs] * bs + pos % bs
            for table, n, ctx in zip(block_tables, query_lens, context_lens)
            for pos in range(ctx - n, ctx)
        ]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=tables.to(device),
            query_start_loc=torch.tensor(start_loc, dtype=torch.int32, device=device),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            context_lens_cpu=list(context_lens),
        )


def token_positions(query_lens: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """(num_tokens,) int64: the position of every new token, without a Python loop over tokens."""
    q_lens = query_lens.long()
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # (num_tokens,)
    first_row = torch.cumsum(q_lens, 0) - q_lens  # (num_seqs,)
    row_in_seq = torch.arange(int(q_lens.sum())) - first_row[seq_of_token]
    return (context_lens.long() - q_lens)[seq_of_token] + row_in_seq


def compute_slot_mapping(
    block_tables: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """(num_tokens,) int64: slot = block_table[pos // block_size] * block_size + pos % block_size.

        block_table  [ 7 | 2 | 9 ]        block_size 4, position 6
        positions     0-3 4-7 8-11        -> block 2, offset 2 -> slot 2*4 + 2 = 10
    """
    positions = token_positions(query_lens, context_lens)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens.long())
    blocks = block_tables.long()[seq_of_token, positions // block_size]
    return blocks * block_size + positions % block_size
