"""Hidden states from one pipeline stage to the next: point-to-point over the whole group.

    stage s, TP rank t ──isend (2, num_tokens, hidden): the residual and the last block's delta──>
                          stage s+1, TP rank t   (every TP rank of a stage holds the whole stream)

The receiver knows num_tokens from the step's chunks (its own copy of the batch), so only the
values travel. Sends do not wait for the receiver: stage s goes on to the next batch in flight
while stage s+1 is still on the previous one; each send's tensor is kept until gloo/NCCL reports
it delivered. Messages between two ranks arrive in the order sent, which is the batches' order at
every stage.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class StageLink:
    def __init__(self, prev_rank: int | None, next_rank: int | None, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.prev_rank, self.next_rank = prev_rank, next_rank  # global ranks; None: first / last stage
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._sending: deque = deque()  # (work, tensor) not yet delivered
        self.recv_seconds = 0.0  # time spent waiting for (and taking) the previous stage's output

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (residual, delta) for this step's num_tokens tokens."""
        import torch.distributed as dist

        buffer = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        started = time.perf_counter()
        dist.recv(buffer, src=self.prev_rank)
        self.recv_seconds += time.perf_counter() - started
        return buffer[0], buffer[1]

    def send(self, residual: torch.Tensor, delta: torch.Tensor) -> None:
        """(residual, delta) to the next stage, without waiting for it to take them."""
        import torch.distributed as dist

        self._reap()
        stream = torch.stack((residual, delta)).contiguous()  # (2, num_tokens, hidden)
        self._sending.append((dist.isend(stream, dst=self.next_rank), stream))

    def wait_sent(self) -> None:
        """Every send delivered (raises what gloo/NCCL raised: a peer gone, a timeout)."""
        while self._sending:
            work, _ = self._sending.popleft()
            work.wait()

    def _reap(self) -> None:
        while self._sending and self._sending[0][0].is_completed():
            self._sending.popleft()[0].wait()  # raises a failed send's error
