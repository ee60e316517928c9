"""Model architectures, keyed by the names Hugging Face and GGUF files use for them."""

from __future__ import annotations

from native_backend.model.models.llama import LlamaForCausalLM

# GGUF `general.architecture` and HF `model_type` (ModelConfig.architecture) -> class. Qwen2 needs
# q/k/v biases only (see `ModelConfig.attention_bias`), which the Llama class would have to grow first.
MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class that runs checkpoints of `architecture`; an unknown one is an error naming it and
    the architectures this engine runs."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise NotImplementedError(f"model architecture {architecture or '(none named)'!r} is not supported; "
                                  f"this engine runs {', '.join(MODEL_CLASSES)}") from None


__all__ = ["LlamaForCausalLM", "MODEL_CLASSES", "model_class"]
