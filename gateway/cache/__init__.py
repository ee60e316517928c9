"""The exact response cache: opt-in per model, deterministic requests only, hits replayed as the
original answer (streams as SSE) without a backend."""
