"""`kvgate plan`, contributed by the native plugin through the `register_commands` hook: the text
table, `--json`, GGUF and HF-directory models, and bad input as a message with a nonzero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway import cli
from gateway.hookspecs import hookimpl
from native_backend.config.default_model import default_gguf_path


def plan(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_worked_example_and_its_correction(capsys):
    code, out, _ = plan(capsys, "--model", "Llama-2-70B", "--kv-cache-gib", "360", "--max-model-len", "2048",
                        "--no-gqa")
    assert code == 0
    assert "2.50 MiB/token = 2 x 80 layers x 64 KV heads x 128 x 2 B" in out
    assert "2048 tokens (full context)        72   (5 GiB of KV each)" in out
    assert "real 8 KV heads of 128: 320 KiB/token, 8x less, and 576 sequences of 2048 tokens fit instead of 72" in out

    code, out, _ = plan(capsys, "--model", "Llama-2-70B", "--kv-cache-gib", "360", "--max-model-len", "2048")
    assert "320 KiB/token = 2 x 80 layers x 8 KV heads x 128 x 2 B" in out
    assert "2048 tokens (full context)       576" in out


def test_the_70b_on_8_a100s_proposes_tp_8_and_tp_4_x_pp_2_with_their_memory_per_rank(capsys):
    """Llama-3-70B (80 layers, hidden 8192, 64 heads / 8 KV heads of 128, MLP 28672, vocabulary
    128256), bf16, 8 x A100-80G. Worked out by hand: at TP 8 a rank holds per layer q and o
    (2 x 8192 x 1024), one KV head's k and v (2 x 8192 x 128) and its MLP slice (3 x 8192 x 3584):
    106,954,752 weights; at TP 4 x PP 2 twice that on half the layers, the same 8,556,380,160.
    The last stage adds the LM head's 32,064 rows (TP 4) and 81 norms; TP 8 a rank's embedding and
    head rows (2 x 16,032) and 161 norms."""
    code, out, _ = plan(capsys, "--model", "Llama-3-70B", "--weights", "bf16", "--gpu", "A100-80G", "--gpus", "8",
                        "--json")
    assert code == 0
    layouts = {(x["tp"], x["pp"]): x["plan"] for x in json.loads(out)}
    assert list(layouts) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    linear = 80 * (2 * 8192 * 1024 + 2 * 8192 * 128 + 3 * 8192 * 3584)
    assert layouts[(8, 1)]["weights_bytes"] == 2 * (linear + 2 * 16032 * 8192 + 161 * 8192)
    assert layouts[(4, 2)]["weights_bytes"] == 2 * (linear + 32064 * 8192 + 81 * 8192)
    assert layouts[(4, 2)]["stage_layers"] == 40
    kv_per_token = 2 * 80 * 1 * 128 * 2  # K and V, 80 layers, one KV head a rank, bf16; PP 2: 40 layers x 2 heads
    assert layouts[(8, 1)]["kv_bytes_per_token"] == layouts[(4, 2)]["kv_bytes_per_token"] == kv_per_token
    _, text, _ = plan(capsys, "--model", "Llama-3-70B", "--weights", "bf16", "--gpu", "A100-80G", "--gpus", "8")
    assert "tp 4 x pp 2" in text and "16.4 GiB" in text and "across nodes use PP" in text


def test_more_stages_than_layers_is_refused(capsys):
    code, _, err = plan(capsys, "--model", "SmolLM2-135M", "--gpu", "L4", "--pp", "31")
    assert code == 1 and "31 stages cannot split 30 layers" in err


def test_a_gpu_plan_shows_every_term_of_the_budget(capsys):
    code, out, _ = plan(capsys, "--model", "Llama-2-70B", "--gpu", "H200", "--tp", "2")
    assert code == 0
    for term in ("weights", "per rank, tp 2", "memory       H200", "activations", "reserve", "KV budget",
                 "blocks", "4096 tokens (full context)", "512 tokens"):
        assert term in out


def test_json_is_the_whole_plan(capsys):
    code, out, _ = plan(capsys, "--model", "Llama-2-70B", "--weights", "awq-int4", "--gpu", "H100-80G", "--json")
    data = json.loads(out)
    assert code == 0 and 35e9 <= data["weights_bytes"] <= 38e9
    assert data["kv_bytes_per_token"] == 320 * 1024 and data["fits"][0]["tokens"] == 4096


def test_tp_replication_is_explained(capsys):
    _, out, _ = plan(capsys, "--model", "Llama-2-70B", "--gpu", "H100-80G", "--tp", "16")
    assert "tp 16 > 8 KV heads: each rank keeps a copy of one KV head" in out


def test_the_real_smollm2_gguf(capsys):
    path = default_gguf_path()
    code, out, _ = plan(capsys, "--model", path, "--gpu", "L4", "--weights", "fp32")
    assert code == 0
    assert "30 layers, 9 query heads, 3 KV heads x 64" in out
    assert "45 KiB/token = 2 x 30 layers x 3 KV heads x 64 x 4 B" in out  # auto KV: fp32 like the weights


def test_an_hf_directory(capsys, tmp_path):
    import transformers  # pinned in requirements.txt: never a skip
    transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=128).save_pretrained(tmp_path)
    code, out, _ = plan(capsys, "--model", str(tmp_path), "--memory-gib", "1")
    assert code == 0 and "128 tokens (full context)" in out


@pytest.mark.parametrize("args, message", [
    (["--model", "Llama-9", "--gpu", "L4"], "unknown model 'Llama-9'"),
    (["--model", "Llama-2-7B", "--gpu", "V100"], "unknown GPU 'V100'; known: H200, H100-80G, A100-80G"),
    (["--model", "SmolLM2-135M", "--gpu", "L4", "--tp", "2"], "valid sizes: 1, 3"),
    (["--model", "Llama-2-70B", "--gpu", "L4"], "does not fit"),
    (["--model", "Llama-2-7B"], "exactly one of --gpu, --memory-gib and --kv-cache-gib"),
])
def test_bad_input_is_a_message_and_exit_1(capsys, args, message):
    code, out, err = plan(capsys, *args)
    assert code == 1 and out == ""
    assert err.startswith("kvgate plan: ") and message in err


def test_the_installed_command_exits_nonzero_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "plan", "--model", "Llama-9", "--gpu", "L4"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "built-in: Llama-2-7B" in result.stderr and "Traceback" not in result.stderr


def test_a_plugin_command_may_not_replace_a_built_in(monkeypatch):
    class Clash:
        @hookimpl
        def register_commands(self, register):
            register("serve", object())

    from gateway import plugins

    make = plugins.make_plugin_manager
    monkeypatch.setattr(plugins, "make_plugin_manager", lambda: make({"clash": Clash()}))
    with pytest.raises(ValueError, match="plugin command 'serve' would replace the built-in 'kvgate serve'"):
        cli.main(["plan", "--help"])
