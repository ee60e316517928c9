"""Model architectures, keyed by the names Hugging Face and GGUF files use for them."""

from __future__ import annotations

from native_backend.config.architectures import ARCHITECTURES, check_architecture
from native_backend.model.models.llama import LlamaForCausalLM

# config.architectures' implementation names -> class; which checkpoint architecture runs on which
# implementation is that module's list (the one the settings check reads without torch).
IMPLEMENTATIONS = {"llama": LlamaForCausalLM}
MODEL_CLASSES = {architecture: IMPLEMENTATIONS[impl] for architecture, impl in ARCHITECTURES.items()}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class that runs checkpoints of `architecture`; an unknown one is an error naming it and
    the architectures this engine runs."""
    try:
        check_architecture(architecture)
    except ValueError as exc:
        raise NotImplementedError(str(exc)) from None
    return MODEL_CLASSES[architecture]


__all__ = ["LlamaForCausalLM", "MODEL_CLASSES", "model_class"]
