"""Tensor parallelism over worker processes: rank 0 in the engine process, ranks 1..N-1 spawned.

    engine core ── SchedulerOutput ──> TensorParallelExecutor (rank 0)
                                         │ StepDelta (new tokens, block-table tails, ended ids)
                                         ├──pipe──> worker rank 1 ─┐
                                         ├──pipe──> worker rank 2 ─┤  each: its shard of every layer,
                                         │                          │  its KV heads' cache; the same
                                         └─ rank 0's model ─────────┘  forward, in lockstep
                                              all-reduce after o_proj and down_proj (and the
                                              embedding), LM head slices gathered on rank 0,
                                              which alone samples

Modules: `validate` (which sizes split a model), `deltas` (what a step sends), `group` (the
torch.distributed group: gloo on CPU, NCCL on CUDA, everything on loopback, a timeout on every
collective), `worker` (a rank's process), `executor` (rank 0's side: starts, steps, watches and
stops the workers).
"""
