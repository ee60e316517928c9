"""Which tensor-parallel sizes split a model, refused at start with the sizes that would.

    query heads % N == 0;  KV heads % N == 0, or N % KV heads == 0 (each KV head replicated);
    MLP intermediate % N == 0;  vocabulary % N == 0 (embedding and LM head split by rows);
    int4 linears held packed (AWQ checkpoints; GGUF Q4 run as stored), with group size g:
        column-parallel (q, k, v, gate, up): a rank's outputs % 8 == 0 (qweight and qzeros hold
            8 columns an int32: a shard must not cut a word; the C kernel's bands of 16 columns
            take a last band of 8 and the Triton kernel masks its tiles, so whole words are all
            they need; scales split by outputs)
        row-parallel (o, down): a rank's inputs % g == 0 (whole groups: qweight rows, and the
            rows of qzeros and scales, K / (g N) each)

SmolLM2-135M (9 heads, 3 KV heads, MLP 1536, vocab 49152): 1 and 3, float or int4 g32 / g64 (a
rank's o_proj has 192 inputs, down_proj 512). A tiny Llama with 8 heads and 2 KV heads: 1, 2, 4
and 8.

Speculative decoding: method ngram runs at any size (its drafts come from the token history on
rank 0; every rank runs the verification's forward pass); method draft is refused (its draft
passes sample on rank 0 between forward passes that would have to run on every rank).

Torch-free (config.json, GGUF metadata through `gguf`'s numpy reader): the engine checks at start,
the gateway's settings check (`kvgate check-config`) runs the same rule without the engine.
"""

from __future__ import annotations

import os

from native_backend.config.model import ModelConfig
from native_backend.model.quantization.format import PACK, read_quant_config_file

GGUF_Q4_GROUP = 32  # llama.cpp's Q4_0 / Q4_1 block: the int4 method's group for quantization "gguf"


def check_model_on_disk(path: str, size: int, quantization: str = "none") -> None:
    """`check_tp_size` for the model at `path` (an HF directory or a GGUF file) as the engine will
    run it: packed int4 linears when the directory is an AWQ checkpoint (its group size) or the GGUF
    runs its Q4 linears as stored (`quantization` gguf, blocks of 32)."""
    if os.path.isdir(path):
        config, quant = ModelConfig.from_hf_dir(path), read_quant_config_file(path)
        group = quant.group_size if quant is not None else None
    else:
        import gguf  # numpy only, no torch

        config = ModelConfig.from_gguf(gguf.GGUFReader(path))
        group = GGUF_Q4_GROUP if quantization == "gguf" else None  # Q4_0 / Q4_1 blocks, run packed
    check_tp_size(config, size, os.path.basename(path.rstrip("/")) or path, group)


def check_speculative_method(size: int, method: str | None, pipeline_size: int = 1) -> None:
    """Raise ValueError for speculative decoding that tensor or pipeline parallelism does not run
    (method draft), naming what does (ngram); None: speculation off. `size`: tensor-parallel ranks."""
    if pipeline_size > 1 and method == "draft":
        raise ValueError(f"parallel.pipeline_parallel_size {pipeline_size} with speculative method 'draft': not "
                         "supported (a draft model runs on one rank only); with pipeline parallelism use "
                         "speculative method 'ngram' (prompt lookup)")
    if size > 1 and method == "draft":
        raise ValueError(f"parallel.tensor_parallel_size {size} with speculative method 'draft': not supported "
                         "(a draft model runs at tensor_parallel_size 1 only); with tensor parallelism use "
                         "speculative method 'ngram' (prompt lookup)")


def check_pipeline_on_disk(config) -> None:
    """`check_pipeline` for the model at config.model.path (config.json or the GGUF's metadata)."""
    path = config.model.path
    if os.path.isdir(path):
        num_layers = ModelConfig.from_hf_dir(path).num_layers
    else:
        import gguf  # numpy only, no torch

        num_layers = ModelConfig.from_gguf(gguf.GGUFReader(path)).num_layers
    check_pipeline(config, num_layers)


def check_pipeline(config, num_layers: int) -> None:
    """Raise ValueError for a pipeline the model cannot split into (each stage needs a layer; a
    given partition must add up), or one combined with what pipeline parallelism does not run yet:
    prefill/decode disaggregation (a producer or consumer would move each stage's blocks)."""
    from native_backend.model.layers.stages import partition_layers

    p = config.parallel
    partition_layers(num_layers, p.pipeline_parallel_size, p.pipeline_layer_partition)
    if config.transfer.kv_role:
        raise ValueError(f"parallel.pipeline_parallel_size {p.pipeline_parallel_size} with kv_role "
                         f"'{config.transfer.kv_role}': not supported yet (prefill/decode disaggregation would move "
                         "every stage's share of the KV blocks); run disaggregated engines at pipeline_parallel_size 1")


def split_problems(config: ModelConfig, size: int, group_size: int | None = None) -> list[str]:
    """What does not split across `size` ranks; empty when everything does. `group_size`: the
    linears are packed int4 weights quantized in groups along the input dimension, which a
    column-parallel shard must not cut between int32 words nor a row-parallel one within a group."""
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
        problems += int4_problems(c, size, group_size)
    return problems


def int4_problems(c: ModelConfig, size: int, group_size: int) -> list[str]:
    """Packed int4 linears whose shard at `size` (heads, KV heads and MLP already split) would cut
    an int32 of 8 output columns or a quantization group of inputs."""
    columns = (("q_proj", c.num_heads * c.head_dim // size),
               ("k_proj/v_proj", kv_heads_per_rank(c.num_kv_heads, size) * c.head_dim),
               ("gate_proj/up_proj", c.intermediate_size // size))
    rows = (("o_proj", c.num_heads * c.head_dim // size), ("down_proj", c.intermediate_size // size))
    return ([f"{what}'s packed int4 columns (a shard of {n} outputs would cut an int32 of {PACK})"
             for what, n in columns if n % PACK] +
            [f"{what}'s int4 groups of {group_size} (a shard of {n} inputs would cut one)"
             for what, n in rows if n % group_size])


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads a rank holds: its share while they split, one whole (replicated) when there are
    fewer heads than ranks (layers/sharding.py: ShardSpec.kv_head_shard)."""
    return num_kv_heads // size if num_kv_heads >= size else 1


def valid_tp_sizes(config: ModelConfig, group_size: int | None = None) -> list[int]:
    return [n for n in range(1, config.num_heads + 1) if not split_problems(config, n, group_size)]


def check_tp_size(config: ModelConfig, size: int, model_name: str, group_size: int | None = None) -> None:
    """Raise ValueError naming what does not split and the sizes that would."""
    problems = split_problems(config, size, group_size) if size >= 1 else ["a size below 1"]
    if problems:
        raise ValueError(f"parallel.tensor_parallel_size: {size} ranks cannot split {model_name}: "
                         f"{'; '.join(problems)}; valid sizes for this model: "
                         f"{', '.join(map(str, valid_tp_sizes(config, group_size)))}")
