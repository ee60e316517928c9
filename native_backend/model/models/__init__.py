"""Model architectures, keyed by the names Hugging Face and GGUF files use for them."""

from __future__ import annotations

from native_backend.model.models.llama import LlamaForCausalLM

# GGUF `general.architecture` and HF `model_type` -> class. Qwen2 needs q/k/v biases only
# (see `ModelConfig.attention_bias`), which the Llama class would have to grow first.
MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM}

__all__ = ["LlamaForCausalLM", "MODEL_CLASSES"]
