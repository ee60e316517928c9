"""The engine's settings (EngineConfig and its parts), the model's shape (ModelConfig, read from a
config.json or a GGUF's metadata), and where kvgate keeps what it builds (cache_dir).

Imports no other layer and no torch: the gateway's side (the native plugin's settings check, the
planner) reads it without loading the engine.
"""
