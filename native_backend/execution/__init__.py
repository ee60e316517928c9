"""Execution: everything between the engine core and the model on its device(s). The executor
(`execute(SchedulerOutput) -> RunnerOutput`; in-process, or tensor-parallel workers), the model
runner and sampler, fp8 KV scale calibration, speculative decoding's draft models and
rejection sampling, and the KV connector's worker side (kv_transfer: blocks between engines over TCP).

May import config, kernels, text, core (the batch DTOs and sampling parameters it executes) and
model. Never imports process or tools.
"""
