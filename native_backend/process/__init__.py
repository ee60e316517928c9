"""The engine process: the loop that drives an engine core in its own process, the async client
the gateway's side holds, the messages between them, the factory that builds the core, the output
processor (the core's token ids as text: detokenization, stop strings; it holds the engine
process's tokenizer), and the KV-event publisher (the prefix cache's changes on a ZMQ socket, in
vLLM's format).

The client and the process loop import only core.interface and the standard library (the gateway
side never loads torch); the factory, imported by name inside the engine process, may import every
layer below.
"""
