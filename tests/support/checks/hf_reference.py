"""transformers as the numerical reference for pooled embeddings: the base model (`AutoModel`) of
the default GGUF, dequantized to float32 as the engine's float path is, and its final-norm hidden
states (`last_hidden_state`, what the LM head reads) pooled and L2-normalised as the engine pools."""

from __future__ import annotations

import os

import torch
from transformers import AutoModel

from native_backend.model.loader import default_gguf_path


def base_model():
    path = default_gguf_path()
    torch.set_num_threads(2)
    model = AutoModel.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


def hidden_states(model, ids: list[int]) -> torch.Tensor:
    """The final-norm hidden states of one prompt, (tokens, hidden)."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0]


def pooled(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=-1)


def max_diff(a, b) -> float:
    """Largest difference between two vectors' components (lists or tensors), in float32."""
    return float((torch.as_tensor(a, dtype=torch.float32) - torch.as_tensor(b, dtype=torch.float32)).abs().max())
