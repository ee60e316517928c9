"""bench/gpu_check.py where it sees no GPU: it parses, skips itself with a clear message, and
the pieces that can run on a CPU (the kernel harness, the bandwidth arithmetic, a random Llama's
decode steps, transformers' batched greedy) do what the GPU run relies on."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_script()


def test_it_parses_its_options():
    args = gpu_check.parse_args(["--only", "kernels", "--only", "bandwidth", "--peak-tbps", "3.35"])
    assert (args.only, args.peak_tbps, args.out) == (["kernels", "bandwidth"], 3.35, gpu_check.OUT)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "everything"])


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    # The script runs in its own process: hiding the GPUs from that process (CUDA_VISIBLE_DEVICES
    # empty) makes this machine one without a GPU for it, here and on a GPU host alike.
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert "gpu_check: skipped: no CUDA GPU here" in proc.stdout
    assert not out.exists()


TINY = {"decode": [(1, 1), (17, 1)], "chunked": [(20, 5), (9, 1)]}


def test_kernel_harness_passes_a_correct_backend_and_catches_a_wrong_one():
    from native_backend.model.attention import AttentionBackend, get_attention_backend
    from native_backend.model.kv_cache import KV_CACHE_DTYPES

    cases = list(gpu_check.attention_cases(TINY, [(2, 2, 16)], (4,)))
    report = gpu_check.kernel_checks("cpu", "cpu", cases=cases, with_selfchecks=False)
    assert report["ok"] and report["cases"] == len(cases) * len(KV_CACHE_DTYPES)

    ref = get_attention_backend("cpu", "reference")
    off_by_a_bit = AttentionBackend("wrong", ref.write_kv, lambda q, kv, md, scale: ref.paged_attention(q, kv, md, scale * 1.1))
    kind, seqs, shape = cases[-1]
    result = gpu_check.check_attention_case(off_by_a_bit, ref, seqs, shape, KV_CACHE_DTYPES["float32"], "cpu")
    assert not result["ok"] and result["attention_max_err"] > result["tolerance"]


def test_a_case_that_cannot_run_is_reported_not_raised(monkeypatch):
    from native_backend.model.kv_cache import KVCacheDType

    monkeypatch.setattr("native_backend.model.kv_cache.KV_CACHE_DTYPES",
                        {"odd": KVCacheDType("odd", 1, storage="no-such-dtype")})
    report = gpu_check.kernel_checks("cpu", "reference", cases=list(gpu_check.attention_cases(TINY, [(1, 1, 16)], (4,))),
                                     with_selfchecks=False)
    assert not report["ok"] and all("error" in r for r in report["results"])


def test_decode_bytes_count_each_weight_once_plus_the_kv_read():
    from native_backend.config.model import ModelConfig

    tiny = dict(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=112, max_position_embeddings=256)
    tied = gpu_check.random_llama(ModelConfig(**tiny, tie_word_embeddings=True), "cpu", torch.float32)
    untied = gpu_check.random_llama(ModelConfig(**tiny), "cpu", torch.float32)
    layer = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 112 + 2 * 64)  # q,o + k,v + MLP + 2 norms, fp32
    weights = 4 * (96 * 64 + 64) + 2 * layer  # one 96 x 64 matrix (embedding/lm_head) + final norm
    kv = 2 * 2 * 2 * 16 * 2 * 100  # K and V x layers x kv heads x head_dim x 2 bytes x 100 tokens
    assert gpu_check.bytes_per_decode_token(tied, 100, 2) == {"weights": weights, "kv": kv, "total": weights + kv}
    # Untied: the lm_head is read, the embedding table is not (a lookup reads one row).
    assert gpu_check.bytes_per_decode_token(untied, 100, 2)["weights"] == weights


def test_decode_steps_of_a_random_llama_run_and_time_on_cpu():
    from native_backend.config.model import ModelConfig

    config = ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=112, max_position_embeddings=256)
    model = gpu_check.random_llama(config, "cpu", torch.float32)
    times = gpu_check.decode_step_times(model, "cpu", "float32", context_len=20, steps=5)
    assert len(times) == 5 and all(t > 0 for t in times)
    options = gpu_check.cuda_graph_options()  # without a CUDA-graph switch in the runner: the default only
    assert options == [{}] or [list(o.values()) for o in options] == [[False], [True]]


def test_transformers_padded_batches_give_the_unbatched_greedy_tokens(tmp_path):
    import transformers  # pinned in requirements.txt: never a skip
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.15)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    batched = gpu_check.hf_padded_greedy(model, prompts, 6)
    assert batched == [gpu_check.hf_greedy(model, p, 6) for p in prompts]
    assert all(len(b) == 6 for b in batched)
    # Each run gets its own cast copy: the loaded fp32 weights are never rounded through bf16.
    half = gpu_check.on_device(model, "cpu", torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32


def test_the_summary_names_each_section_figure():
    line = gpu_check.summary_line("throughput", {"ok": True, "seconds": 12.0, "kvgate_out_tok_s": 900.0,
                                                 "hf_static_out_tok_s": 300.0, "ratio": 3.0})
    assert "kvgate 900 vs transformers 300 output tok/s (3.00x)" in line
    line = gpu_check.summary_line("bandwidth", {"ok": True, "seconds": 5.0, "runs": [
        {"tok_s": 200.0, "achieved_tbps": 0.5, "utilisation": 0.104}]})
    assert "200 tok/s, 0.50 TB/s, 10.4% of peak" in line


def test_the_trtllm_section_runs_the_contract_with_the_real_package_required():
    result = gpu_check.trtllm_contract()
    assert result["ran_at"] == time.strftime("%Y-%m-%d")  # the record docs/testing-ci.md keeps of its last run
    if importlib.util.find_spec("tensorrt_llm") is None:  # here: the section fails, saying why
        assert not result["ok"] and "required here: KVGATE_REQUIRE_TRTLLM is set" in result["output"]
        assert result["tensorrt_llm"] is None
    else:
        assert result["ok"], result["output"]
        assert result["tensorrt_llm"]


def test_the_structured_section_runs_constrained_batches_and_validates_them():
    """The constrained-decoding section on the CPU (the real SmolLM2, fp32, one request of the
    battery's boolean schema, which ends in a few tokens): the constrained output completes and validates, the mask timers saw every constrained row, and
    the summary names the figures. On CUDA the same code masks through the Triton kernel."""
    from native_backend.model.loader import default_gguf_path
    from structured_battery import SCHEMAS

    FLAG = [name for name, _, _ in SCHEMAS].index("flag")
    r = gpu_check.structured(default_gguf_path(), device="cpu", dtype="float32", requests=1, max_tokens=16,
                             warm_up=False, first_schema=FLAG, kv_cache_bytes=64 << 20, num_threads=2)
    assert r["ok"], r
    assert r["constrained"]["complete"] == 1 and r["masked_row_steps"] >= r["constrained"]["output_tokens"]
    assert r["unconstrained"]["output_tokens"] == r["constrained"]["output_tokens"]  # the same work, unmasked
    assert r["mask_apply_us_per_row"] > 0
    assert "complete constrained outputs valid" in gpu_check.summary_line("structured", {**r, "seconds": 1.0})
