"""The engine core: the loop (schedule, execute, update), the scheduler, the block manager,
sequences, the batch DTOs that cross to the executor, sampling parameters, what the core takes and
gives (interface), the speculation policy (which requests speculate, with how many tokens), the
KV events the prefix cache reports (kv_events), and the KV connector's scheduler side for
prefill/decode disaggregation (kv_connector, kv_params: which blocks to hold for a remote decode,
which to read from a producer; the execution side moves them).

Pure Python, no torch: tested on CPU with hand-made runner outputs. May import config and text,
the latter for grammars only (token masks): it steps in token ids and never makes text (the
process's output processor detokenizes and applies stop strings). Never imports model or
execution: the engine is handed its executor (process.factory builds it).
"""
