"""Text: the tokenizer (ids <-> text, chat templates), incremental detokenization, stop strings.

May import config only; no torch. The frontend's side of the engine (as vLLM v1's output
processor): whatever turns token ids into the text a client reads.
"""
