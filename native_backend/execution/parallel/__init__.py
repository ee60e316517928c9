"""Tensor and pipeline parallelism over worker processes: rank 0 in the engine process, ranks
1..N-1 spawned (N = TP x PP).

    engine core ── SchedulerOutput ──> TensorParallelExecutor (rank 0)
                                         │ StepDelta (new tokens, block-table tails, ended ids)
                                         ├──pipe──> worker rank 1 ─┐
                                         ├──pipe──> worker rank 2 ─┤  each: its shard of every layer,
                                         │                          │  its KV heads' cache; the same
                                         └─ rank 0's model ─────────┘  forward, in lockstep
                                              all-reduce after o_proj and down_proj (and the
                                              embedding), LM head slices gathered on rank 0,
                                              which alone samples

Pipeline parallelism: each stage (TP ranks) holds its run of layers; stage s sends its residual
stream to stage s + 1 (`stage_link`), the last stage's TP rank 0 samples and answers on its pipe,
and up to P steps are in flight (executor.submit / collect).

Modules: `topology` (a rank's stage, TP group and link), `validate` (which sizes split a model), `deltas` (what a step sends), `group` (the
torch.distributed group: gloo on CPU, NCCL on CUDA, everything on loopback, a timeout on every
collective), `stage_link` (hidden states stage to stage), `worker` (a rank's process), `executor` (rank 0's side: starts, steps, watches and
stops the workers), `nodes` (across machines: the authenticated rendezvous where other nodes' ranks
join rank 0), `node_agent` (a headless node: `kvgate engine --headless`).
"""
