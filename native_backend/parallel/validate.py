"""Which tensor-parallel sizes split a model, refused at start with the sizes that would.

    query heads % N == 0;  KV heads % N == 0, or N % KV heads == 0 (each KV head replicated);
    MLP intermediate % N == 0;  vocabulary % N == 0 (embedding and LM head split by rows);
    int4 weights (GGUF Q4 run packed): o_proj's and down_proj's inputs per rank % group == 0

SmolLM2-135M (9 heads, 3 KV heads, MLP 1536, vocab 49152): 1 and 3. A tiny Llama with 8 heads and
2 KV heads: 1, 2, 4 and 8.
"""

from __future__ import annotations

from native_backend.config import ModelConfig


def split_problems(config: ModelConfig, size: int, group_size: int | None = None) -> list[str]:
    """What does not split across `size` ranks; empty when everything does. `group_size`: int4
    weights quantized in groups along the input dimension, which a row-parallel shard (o_proj,
    down_proj) must not cut."""
    c, problems = config, []
    if c.num_heads % size:
        problems.append(f"{c.num_heads} attention heads")
    kv = c.num_kv_heads
    if (kv % size if kv >= size else size % kv):
        problems.append(f"{kv} KV heads (neither split evenly nor replicated evenly)")
    if c.intermediate_size % size:
        problems.append(f"MLP intermediate size {c.intermediate_size}")
    if c.vocab_size % size:
        problems.append(f"vocabulary of {c.vocab_size}")
    if group_size and not problems:
        for what, n in (("o_proj", c.num_heads * c.head_dim), ("down_proj", c.intermediate_size)):
            if (n // size) % group_size:
                problems.append(f"{what}'s int4 groups of {group_size} (a shard of {n // size} inputs would cut one)")
    return problems


def valid_tp_sizes(config: ModelConfig, group_size: int | None = None) -> list[int]:
    return [n for n in range(1, config.num_heads + 1) if not split_problems(config, n, group_size)]


def check_tp_size(config: ModelConfig, size: int, model_name: str, group_size: int | None = None) -> None:
    """Raise ValueError naming what does not split and the sizes that would."""
    problems = split_problems(config, size, group_size) if size >= 1 else ["a size below 1"]
    if problems:
        raise ValueError(f"parallel.tensor_parallel_size: {size} ranks cannot split {model_name}: "
                         f"{'; '.join(problems)}; valid sizes for this model: "
                         f"{', '.join(map(str, valid_tp_sizes(config, group_size)))}")
