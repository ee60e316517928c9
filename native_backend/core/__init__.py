"""The engine core: the loop (schedule, execute, update), the scheduler, the block manager,
sequences, the batch DTOs that cross to the executor, sampling parameters, what the core takes and
gives (interface), the speculation policy (which requests speculate, with how many tokens), and the
KV events the prefix cache reports (kv_events).

Pure Python, no torch: tested on CPU with hand-made runner outputs. May import config and text.
Never imports model or execution: the engine is handed its executor (process.factory builds it).
"""
