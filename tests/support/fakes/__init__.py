"""Stand-ins for what cannot run here or must misbehave on cue: a scripted OpenAI-compatible upstream, the tensorrt_llm stand-in."""
