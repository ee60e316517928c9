"""Write a float model (our LlamaForCausalLM, dense linears) as an AutoAWQ GEMM checkpoint.

    OUT/config.json            the model's Hugging Face config + quantization_config
    OUT/model.safetensors      decoder linears: <name>.qweight / .qzeros / .scales (+ .bias);
                               everything else (embedding, norms, an untied LM head) in fp16,
                               as AutoAWQ saves it
    OUT/tokenizer.json, ...    the model's tokenizer files (from the HF directory, or extracted
                               from the GGUF file)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import torch

from native_backend.config.model import ModelConfig
from native_backend.model.quantization.format import QuantConfig
from native_backend.model.quantization.rtn import check_group_size, quantize_weight

# Files a Hugging Face model directory keeps its tokenizer and generation defaults in.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def decoder_linears(model) -> dict[str, torch.nn.Module]:
    """HF name prefix -> linear layer, for every linear of every decoder layer (what gets int4)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                out[f"model.layers.{i}.{part}.{name}"] = getattr(getattr(layer, part), name)
    return out


def check_group_sizes(model, group: int) -> None:
    """Every decoder linear must split into whole groups: refused up front, naming the layer."""
    for name, linear in decoder_linears(model).items():
        check_group_size(name, tuple(linear.weight.shape), group)


def quantized_state(model, quant: QuantConfig, progress: Callable[[str], None] = lambda _: None):
    """(name, tensor) of the whole checkpoint: packed int4 decoder linears, fp16 for the rest."""
    linears = decoder_linears(model)
    packed_params = {f"{prefix}.weight" for prefix in linears}
    for prefix, linear in linears.items():
        progress(prefix)
        q = quantize_weight(linear.weight.detach(), quant.group_size)
        yield f"{prefix}.qweight", q.qweight
        yield f"{prefix}.qzeros", q.qzeros
        yield f"{prefix}.scales", q.scales
        if linear.bias is not None:
            yield f"{prefix}.bias", linear.bias.detach().to(torch.float16)
    skip = packed_params | {f"{p}.bias" for p in linears}
    if model.config.tie_word_embeddings:
        skip.add("lm_head.weight")
    for name, param in model.named_parameters():
        if name not in skip:
            yield name, param.detach().to(torch.float16)


def write_checkpoint(model, quant: QuantConfig, out_dir: str, hf_config: dict,
                     progress: Callable[[str], None] = lambda _: None) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in quantized_state(model, quant, progress)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config, "torch_dtype": "float16", "quantization_config": quant.to_hf_dict()}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def hf_config_dict(source: str, config: ModelConfig) -> dict:
    """The source's own config.json, or (GGUF) a Llama config.json written from its metadata."""
    if not source.endswith(".gguf"):
        with open(os.path.join(source, "config.json")) as f:
            return {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "mlp_bias": False, "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }


def copy_tokenizer(source: str, out_dir: str) -> None:
    """Tokenizer files beside the weights: copied from an HF directory, extracted from a GGUF."""
    if source.endswith(".gguf"):
        from native_backend.text.tokenizer import load_gguf_hf_tokenizer

        load_gguf_hf_tokenizer(source).save_pretrained(out_dir)
        return
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copy(path, os.path.join(out_dir, name))
