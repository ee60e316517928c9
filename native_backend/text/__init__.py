"""Text: the tokenizer (ids <-> text, chat templates), incremental detokenization, stop strings.

May import config only; no torch. The frontend's side of the engine: the native plugin tokenizes
prompts with it, and the engine process's output processor (process/output_processor.py, as vLLM
v1's) turns the core's token ids into the text a client reads. The core never imports it.
"""
