"""The memory arithmetic of `kvgate plan`: the classic worked example, GQA, quantized weights and
KV, tensor parallelism, and reading a model's shape from a GGUF file or an HF directory."""

from __future__ import annotations

import json

import pytest

from native_backend.config.default_model import default_gguf_path
from native_backend.tools.memory_plan import (
    GPUS, KNOWN_MODELS, KV_FORMATS, WEIGHT_FORMATS, GiB, MiB, PlanError, PlanInputs, kv_bytes_per_token,
    linear_params_per_rank, make_plan, model_shape, other_params_per_rank, valid_tp_sizes, weights_bytes_per_rank,
)

LLAMA_2_70B = KNOWN_MODELS["Llama-2-70B"]
FP16 = KV_FORMATS["float16"]


def plan(model="Llama-2-70B", **kw):
    return make_plan(PlanInputs(model=model, **kw), KNOWN_MODELS[model])


def params(config, tp=1):
    return linear_params_per_rank(config, tp) + other_params_per_rank(config, tp)


# ------------------------------------------------------------------------------ the worked example


def test_textbook_llama_2_70b_needs_2_5_mib_a_token_and_fits_about_70_requests_in_360_gib():
    textbook = plan(kv_cache_gib=360, max_model_len=2048, gqa=False)
    assert textbook.kv_bytes_per_token == 2 * 80 * 8192 * 2 == int(2.5 * MiB)
    request = textbook.fits[0]
    assert request.tokens == 2048 and request.bytes_per_sequence > 5e9  # "over 5 GB per request"
    assert request.sequences == 72  # ~70


def test_its_real_8_kv_heads_make_it_320_kib_a_token_and_8x_the_requests():
    real = plan(kv_cache_gib=360, max_model_len=2048)
    assert real.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert real.fits[0].sequences == 576 == 8 * 72
    textbook = plan(kv_cache_gib=360, max_model_len=2048, gqa=False)
    assert textbook.real_fits == real.fits  # the --no-gqa plan carries its own correction


def test_shorter_lengths_halve_down_from_full_context():
    p = plan(gpu="H200", tp=2)
    assert [f.tokens for f in p.fits] == [4096, 2048, 1024, 512]
    assert [f.sequences for f in p.fits] == [p.num_blocks // (n // 16) for n in (4096, 2048, 1024, 512)]


# ------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("name, published", [
    ("Llama-2-7B", 6_738_415_616), ("Llama-2-70B", 68_976_648_192),
    ("Llama-3-8B", 8_030_261_248), ("Qwen2-7B", 7_615_616_512), ("SmolLM2-135M", 134_515_008),
])
def test_parameter_counts_match_the_published_models(name, published):
    assert params(KNOWN_MODELS[name]) == published


def test_fp16_weights_are_two_bytes_a_parameter():
    assert weights_bytes_per_rank(LLAMA_2_70B, WEIGHT_FORMATS["fp16"]) == 2 * 68_976_648_192


def test_awq_int4_70b_is_about_35_to_38_gb():
    awq = weights_bytes_per_rank(LLAMA_2_70B, WEIGHT_FORMATS["awq-int4"])
    assert 35e9 <= awq <= 38e9
    int4_alone = linear_params_per_rank(LLAMA_2_70B, 1) // 2
    assert awq > int4_alone + params(LLAMA_2_70B) // 128 * 2  # group scales (and zeros) are counted


# ------------------------------------------------------------------------------ KV dtypes


def test_kv_bytes_follow_the_dtype_and_int8_counts_its_scales():
    per = {name: kv_bytes_per_token(LLAMA_2_70B, fmt) for name, fmt in KV_FORMATS.items()}
    assert per["float32"] == 2 * per["float16"] == 2 * per["bfloat16"] == 4 * per["fp8_e4m3"]
    assert per["int8"] == 2 * 80 * 8 * (128 + 4)  # one float32 scale per token per KV head


def test_auto_kv_dtype_is_the_compute_dtype():
    assert plan(weights="bf16", kv_cache_gib=1).kv_cache_dtype == "bfloat16"
    assert plan(weights="awq-int4", kv_cache_gib=1).kv_cache_dtype == "float16"
    assert plan(weights="fp16", kv_cache_dtype="fp8_e4m3", kv_cache_gib=1).kv_bytes_per_token == 160 * 1024


# ------------------------------------------------------------------------------ tensor parallelism


def test_tp_splits_kv_heads_while_there_are_enough_and_replicates_them_after():
    assert plan(tp=2, kv_cache_gib=1).kv_heads_per_rank == 4
    assert plan(tp=8, kv_cache_gib=1).kv_bytes_per_token == 2 * 80 * 1 * 128 * 2
    replicated = plan(tp=16, kv_cache_gib=1)
    assert replicated.kv_heads_per_rank == 1  # 8 KV heads on 16 ranks: one copy per rank
    assert replicated.kv_bytes_per_token == plan(tp=8, kv_cache_gib=1).kv_bytes_per_token


def test_tp_splits_the_weights():
    fp16 = WEIGHT_FORMATS["fp16"]
    whole, rank = weights_bytes_per_rank(LLAMA_2_70B, fp16), weights_bytes_per_rank(LLAMA_2_70B, fp16, 8)
    assert whole / 8 <= rank < whole / 8 * 1.01  # norms are replicated, everything else splits


def test_a_tp_that_does_not_split_the_heads_is_refused_naming_the_valid_sizes():
    with pytest.raises(PlanError, match=r"--tp 2 .* 9 attention heads;.* valid sizes: 1, 3$"):
        plan("SmolLM2-135M", tp=2, gpu="L4")
    assert valid_tp_sizes(LLAMA_2_70B) == [1, 2, 4, 8, 16, 32, 64]


def test_the_plan_refuses_what_the_engine_refuses():
    """9 ranks split SmolLM2's 9 heads, but not its MLP (1536) nor its vocabulary (49152): the
    engine refuses TP 9 at start, and so does the plan (one rule: parallel.validate)."""
    with pytest.raises(PlanError, match=r"--tp 9 .*MLP intermediate size 1536; vocabulary of 49152; valid sizes: 1, 3$"):
        plan("SmolLM2-135M", tp=9, gpu="L4")


def test_int4_weights_are_held_to_the_engines_packed_int4_rule():
    """Llama-3-8B splits 32 ways in fp16, but AWQ int4 (groups of 128) at 32 ranks would give
    down_proj 448 inputs a rank, cutting a group: the engine refuses it, so does the plan."""
    assert plan("Llama-3-8B", tp=32, kv_cache_gib=1).weights_bytes > 0  # fp16: a valid size
    with pytest.raises(PlanError, match=r"--tp 32 .*down_proj's int4 groups of 128 \(a shard of 448 inputs "
                                        r"would cut one\); valid sizes: 1, 2, 4, 8, 16$"):
        plan("Llama-3-8B", weights="awq-int4", tp=32, kv_cache_gib=1)


# ------------------------------------------------------------------------------ the budget


def test_gpu_budget_is_usable_memory_less_weights_activations_and_reserve():
    p = plan(gpu="H200", tp=2)
    assert p.usable_bytes == int(GPUS["H200"] * 0.9)
    assert p.kv_budget_bytes == p.usable_bytes - p.weights_bytes - p.activation_bytes - p.reserve_bytes
    assert p.num_blocks == p.kv_budget_bytes // p.bytes_per_block
    assert p.bytes_per_block == 16 * 160 * 1024


def test_memory_gib_is_the_same_as_a_gpu_of_that_size():
    by_name = plan(gpu="H100-80G", weights="awq-int4")
    by_size = plan(memory_gib=GPUS["H100-80G"] / GiB, weights="awq-int4")
    assert by_size.num_blocks == by_name.num_blocks


def test_bf16_prefill_counts_its_copy_of_the_linears_in_the_weights():
    """2 bytes a decoder-linear weight on each rank: what the engine's prefill_matmul keeps
    (SmolLM2: 202.5 MiB, the figure the engine's start-up line reports for its copies)."""
    smol = KNOWN_MODELS["SmolLM2-135M"]
    base, bf16 = plan("SmolLM2-135M", memory_gib=4, weights="fp32"), \
        plan("SmolLM2-135M", memory_gib=4, weights="fp32", prefill_matmul="bf16")
    assert bf16.prefill_copy_bytes == 2 * linear_params_per_rank(smol, 1) == bf16.weights_bytes - base.weights_bytes
    assert round(bf16.prefill_copy_bytes / MiB, 1) == 202.5 and base.prefill_copy_bytes == 0
    assert bf16.kv_budget_bytes == base.kv_budget_bytes - bf16.prefill_copy_bytes
    # auto: counted where the engine may choose bf16 (int4 weights), not for a float model
    assert plan("Llama-2-7B", gpu="L4", weights="awq-int4", prefill_matmul="auto").prefill_copy_bytes > 0
    assert plan("Llama-2-7B", gpu="L4", weights="fp16", prefill_matmul="auto").prefill_copy_bytes == 0
    with pytest.raises(PlanError, match="--prefill-matmul: 'fp16' is not one of auto, fp32, bf16"):
        plan("Llama-2-7B", gpu="L4", prefill_matmul="fp16")


def test_a_model_that_does_not_fit_says_which_tp_would():
    with pytest.raises(PlanError, match="does not fit.*--tp 2 fits"):
        plan(gpu="H100-80G")


def test_exactly_one_memory_source():
    with pytest.raises(PlanError, match="exactly one of --gpu, --memory-gib and --kv-cache-gib"):
        plan(gpu="H200", memory_gib=80)


@pytest.mark.parametrize("kw, message", [
    (dict(gpu="V100"), "unknown GPU 'V100'; known: H200, H100-80G"),
    (dict(gpu="L4", weights="int3"), "unknown weight format 'int3'; known: fp32, fp16, bf16, awq-int4, fp8"),
    (dict(gpu="L4", kv_cache_dtype="fp4"), "unknown KV cache dtype 'fp4'; known: float32,"),
    (dict(gpu="L4", block_size=0), "--block-size must be positive"),
    (dict(gpu="L4", memory_fraction=1.5), "--memory-fraction must be in"),
])
def test_bad_input_is_named(kw, message):
    with pytest.raises(PlanError, match=message):
        plan("Llama-2-7B", **kw)


def test_the_plan_is_json_serializable():
    data = json.loads(json.dumps(plan(gpu="H200", tp=2).to_dict()))
    assert data["kv_bytes_per_token"] == 160 * 1024 and data["model"]["num_kv_heads"] == 8


# ------------------------------------------------------------------------------ the model's shape


def smollm2_gguf() -> str:
    return default_gguf_path()  # found, never imported (DESIGN.md)


SHAPE = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size",
         "vocab_size", "max_position_embeddings", "tie_word_embeddings")


def test_the_real_gguf_has_the_built_in_tables_shape():
    from_file, built_in = model_shape(smollm2_gguf()), KNOWN_MODELS["SmolLM2-135M"]
    assert {k: getattr(from_file, k) for k in SHAPE} == {k: getattr(built_in, k) for k in SHAPE}


def test_an_hf_directory_is_read_from_its_config_json(tmp_path):
    import transformers  # pinned in requirements.txt: never a skip
    transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=128).save_pretrained(tmp_path)
    config = model_shape(str(tmp_path))
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (2, 2, 16)
    p = make_plan(PlanInputs(model=str(tmp_path), kv_cache_gib=1), config)
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 and p.fits[0].tokens == 128


@pytest.mark.parametrize("spec, message", [
    ("Llama-9", "unknown model 'Llama-9'.*built-in: Llama-2-7B, Llama-2-13B, Llama-2-70B"),
    ("/nope/model.gguf", "does not exist"),
])
def test_unknown_models_are_named(spec, message):
    with pytest.raises(PlanError, match=message):
        model_shape(spec)


def test_files_that_are_not_models_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(PlanError, match="cannot read a model's shape"):
        model_shape(str(tmp_path / "notes.txt"))
    with pytest.raises(PlanError, match="cannot read a model's shape"):
        model_shape(str(tmp_path))  # a directory without config.json


def test_names_are_case_insensitive():
    assert model_shape("llama-2-70b") == LLAMA_2_70B
    assert plan(gpu="h200", tp=2).gpu_memory_bytes == GPUS["H200"]


def test_planning_needs_no_torch():
    """A plan is made on a laptop: the module, a GGUF read included, never imports torch."""
    import subprocess
    import sys

    code = ("import sys; from native_backend.tools.memory_plan import model_shape; "
            f"model_shape({smollm2_gguf()!r}); assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
