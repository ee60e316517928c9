"""The token embedding and the LM head, split by vocabulary across ranks.

    vocab of V over size ranks: rank r holds rows [r * V/size, (r+1) * V/size)
    embedding: each rank looks up the ids it holds (zeros for the others); one all-reduce sums
    LM head:   each rank scores its rows of the vocabulary (the TP executor gathers them)

With one rank both are the plain lookup and projection. A tied head (SmolLM2) shares the
embedding's parameter, so the matrix exists once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from native_backend.model.layers.linear import ColumnParallelLinear, LinearMethod
from native_backend.model.layers.sharding import ShardSpec, default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, shard: ShardSpec, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.shard = shard
        self.rows = shard.part(vocab_size, "vocabulary")
        self.first_row = shard.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, self.shard.narrow(loaded, 0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (num_tokens,) -> (num_tokens, hidden)
        if self.shard.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.shard.all_reduce(out)


class ParallelLMHead(ColumnParallelLinear):
    """hidden -> this rank's slice of the vocabulary's logits; `tie_to` shares an embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, *, method: LinearMethod, shard: ShardSpec,
                 dtype: torch.dtype, device: torch.device, tie_to: VocabParallelEmbedding | None = None):
        super().__init__(hidden_size, vocab_size, bias=False, method=method, shard=shard, dtype=dtype, device=device)
        if tie_to is not None:
            self.weight = tie_to.weight  # the same Parameter: loaded once, through the embedding
