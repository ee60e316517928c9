"""The engine core: the loop (schedule, execute, update), the scheduler, the block manager,
sequences, the batch DTOs that cross to the executor, sampling parameters, what the core takes and
gives (interface), the speculation policy (which requests speculate, with how many tokens), and the
KV events the prefix cache reports (kv_events).

Pure Python, no torch: tested on CPU with hand-made runner outputs. May import config and text,
the latter for grammars only (token masks): it steps in token ids and never makes text (the
process's output processor detokenizes and applies stop strings). Never imports model or
execution: the engine is handed its executor (process.factory builds it).
"""
