"""The native plugin's settings against the engine's config: every setting reaches the engine,
field by field, and every engine field is a setting (or named here as the plugin's own); the
settings check (`kvgate check-config`) refuses a tensor-parallel size the model cannot split, as the
engine would at start, without importing torch."""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys

import pydantic
import pytest

from kvgate_native.settings import KVEventsSettings, NativeSettings, SpeculativeSettings
from native_backend.config.engine import FIELD_PARTS, EngineConfig, KVEventsOptions, LoRAOptions, SpeculativeOptions

# Settings that are the plugin's, not the engine's: how the plugin runs it, or names it takes.
PLUGIN_ONLY = {"model", "startup_timeout_s", "supervision", "embeddings", "tool_call_parser", "lora_resolver_dir"}
# Engine fields the plugin fills itself instead of taking from YAML.
ENGINE_ONLY = {"path", "tokenizer_cache_dir", "cpu_kv_cache_bytes"}
NESTED = {"speculative", "kv_events"}  # nested parts, absent unless asked for: their fields are held in step below
SPECULATIVE = dict(method="draft", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                   draft_model="/models/draft.gguf", draft_num_layers=None, max_batch_size=5,
                   min_acceptance_rate=0.3)


def test_every_setting_is_an_engine_field_and_back():
    settings = set(NativeSettings.model_fields) - PLUGIN_ONLY - NESTED
    assert settings == set(FIELD_PARTS) - ENGINE_ONLY
    assert set(SpeculativeSettings.model_fields) == {f.name for f in dataclasses.fields(SpeculativeOptions)}
    assert set(KVEventsSettings.model_fields) == {f.name for f in dataclasses.fields(KVEventsOptions)}


def test_kv_events_settings_arrive_as_the_engines_options_and_are_checked_by_it():
    events = dict(endpoint="tcp://*:6001", replay_endpoint="tcp://*:6002", topic="kv@a", buffer_steps=5, hwm=9,
                  publish_token_ids=True)
    assert NativeSettings(kv_events=events).engine_config().kv_events == KVEventsOptions(**events)
    assert NativeSettings().engine_config().kv_events is None
    with pytest.raises(pydantic.ValidationError, match="kv_events.endpoint.*not a ZMQ address"):
        NativeSettings(kv_events={"endpoint": "localhost:5557"})


def test_kv_events_by_default_bind_loopback_and_leave_the_tokens_out():
    """The plugin's defaults are the engine's safe ones (issue 40 item 1): the gateway connects to a
    loopback publisher the engine binds, and BlockStored goes out without the prompts' tokens."""
    options = NativeSettings(kv_events={}).engine_config().kv_events
    assert options.endpoint == "tcp://127.0.0.1:5557" and options.publish_token_ids is False
    assert KVEventsOptions() == options


def test_speculative_settings_arrive_field_by_field():
    assert set(SPECULATIVE) == set(SpeculativeSettings.model_fields)
    for name, value in SPECULATIVE.items():  # every value differs from its default but these two
        assert SpeculativeSettings.model_fields[name].default != value or name in ("method", "draft_num_layers")
    config = NativeSettings(speculative=SPECULATIVE).engine_config()
    assert config.speculative == SpeculativeOptions(**SPECULATIVE)
    self_draft = dict(method="draft", draft_num_layers=6)  # the other way to name a draft
    assert NativeSettings(speculative=self_draft).engine_config().speculative == SpeculativeOptions(**self_draft)
    assert NativeSettings().engine_config().speculative is None


@pytest.mark.parametrize("speculative, message", [
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="eagle"), "method"),
    (dict(method="draft"), "needs exactly one of draft_model"),
    (dict(method="draft", draft_model="d.gguf", draft_num_layers=4), "needs exactly one of draft_model"),
    (dict(method="ngram", draft_num_layers=4), "only for method 'draft'"),
    (dict(method="ngram", prompt_lookup_min=5, prompt_lookup_max=3), "prompt_lookup_min"),
    (dict(method="ngram", num_speculative_tokens=12), "above 7"),
    (dict(method="ngram", typo=1), "typo"),
])
def test_bad_speculative_settings_are_refused_with_the_reason(speculative, message):
    with pytest.raises(pydantic.ValidationError, match=message) as info:
        NativeSettings(speculative=speculative)
    assert "speculative" in str(info.value)


def _non_default_settings() -> dict:
    """A value for every engine setting that differs from its default (and is valid)."""
    return dict(dtype="bfloat16", device="cuda:1", num_threads=3, cpu_kernels=False, block_size=32,
                kv_cache_dtype="int8", kv_cache_bytes=123 << 20, memory_fraction=0.5, enable_prefix_caching=False,
                kv_scales="unit", max_num_seqs=7, max_num_batched_tokens=99, max_model_len=777, tensor_parallel_size=1,
                collective_timeout_s=7.5, quantization="gguf", prefix_hash_seed="1234", kv_role="both",
                kv_transfer_host="0.0.0.0", kv_transfer_port=7001, kv_transfer_advertise_host="10.0.0.7",
                kv_transfer_timeout_s=5.0, kv_hold_timeout_s=60.0, kv_transfer_max_connections=3,
                kv_allowed_producers=("10.0.0.0/8", "prefill.llm.svc"), kv_transfer_key_env="KV_KEY",
                kv_transfer_header_timeout_s=0.5, prefill_matmul="bf16", prefill_attention="fp32",
                long_prefill_token_threshold=64,
                lm_head="float", decode_matmul="fp32", pipeline_parallel_size=2, pipeline_layer_partition=(3, 4),
                nnodes=2, master_addr="10.0.0.1", master_port=29600, rendezvous_secret_file="/etc/kvgate/secret")


LORA = dict(enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=5)  # not under PP: a test of their own


def test_the_lora_settings_arrive_and_lora_modules_take_vllms_two_forms():
    config = NativeSettings(**LORA, lora_modules=["sql=/a/sql", {"name": "chat", "path": "/a/chat"}]).engine_config()
    assert config.lora == LoRAOptions(**LORA, lora_modules={"sql": "/a/sql", "chat": "/a/chat"})
    for bad, message in ((["sql"], "expected 'name=path'"), (["x=/a", "x=/b"], "given twice"),
                         ([{"name": "x"}], "path")):
        with pytest.raises(pydantic.ValidationError, match=message):
            NativeSettings(**LORA, lora_modules=bad)
    with pytest.raises(pydantic.ValidationError, match="needs enable_lora"):
        NativeSettings(lora_modules=["x=/a"])


def test_each_setting_arrives_in_its_part():
    values = _non_default_settings()
    assert set(values) == set(NativeSettings.model_fields) - PLUGIN_ONLY - NESTED - set(LORA) - {"lora_modules"}
    config = NativeSettings(model="/models/x.gguf", **values).engine_config()
    for name, value in values.items():
        assert getattr(getattr(config, FIELD_PARTS[name]), name) == value, name
    assert config.model.path == "/models/x.gguf"


@pytest.mark.parametrize("field, value", [("kv_cache_dtype", "fp4"), ("kv_scales", "guess"), ("block_size", 0),
                                          ("kv_role", "kv_both"), ("kv_transfer_port", 70000),
                                          ("kv_hold_timeout_s", 0), ("kv_transfer_max_connections", 0),
                                          ("kv_transfer_header_timeout_s", 0),
                                          ("prefill_matmul", "fp16"), ("prefill_attention", "fp16"),
                                          ("lm_head", "int4"), ("decode_matmul", "fp16")])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        NativeSettings(**{field: value})


def test_a_kv_role_goes_with_tensor_parallelism_and_a_separate_draft_model():
    # Under tensor parallelism every rank's shard moves (test_kv_connector_tp.py); a separate draft
    # computes its own KV of a read prompt (test_kv_connector.py): both accepted.
    assert NativeSettings(kv_role="producer", tensor_parallel_size=3).engine_config().transfer.produces
    config = NativeSettings(kv_role="consumer", speculative={"method": "draft", "draft_model": "default"}).engine_config()
    assert config.transfer.consumes and config.speculative.draft_model
    assert NativeSettings(kv_role="both", kv_transfer_host="::").engine_config().transfer.advertised_host == "::1"


def test_engine_config_parts_validate_themselves():
    with pytest.raises(ValueError, match="cache.kv_cache_dtype: 'fp4'"):
        EngineConfig.build(path="m.gguf", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="scheduler.max_num_seqs must be positive"):
        EngineConfig.build(path="m.gguf", max_num_seqs=0)
    with pytest.raises(TypeError, match="unknown engine setting 'max_seqs'"):
        EngineConfig.build(path="m.gguf", max_seqs=4)
    assert EngineConfig.build(path="m.gguf", dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert dataclasses.is_dataclass(EngineConfig.build(path="m.gguf").cache)


@pytest.fixture(scope="module")
def tiny_awq_g8(tmp_path_factory) -> str:
    """An int4 AWQ g8 checkpoint of the tiny GQA Llama (8 heads, 2 KV heads, MLP 112): its heads and
    MLP split at 2, 4 and 8, its packed linears at 2 only (28 gate/up columns a rank at 4: 3.5 int32s)."""
    from native_backend.tools.quantize import QuantizeOptions, quantize_model
    from tests.support.checks.tensor_parallel_checks import tiny_gqa_llama

    out = str(tmp_path_factory.mktemp("tiny-int4-g8"))
    quantize_model(tiny_gqa_llama(tmp_path_factory.mktemp("tiny-gqa")), out, QuantizeOptions(method="rtn", group_size=8))
    return out


def test_check_config_refuses_an_awq_split_that_cuts_packed_columns_naming_the_sizes_that_work(
        tiny_awq_g8, tmp_path, capsys):
    from gateway import cli

    def check(tp: int) -> tuple[int, str]:
        path = tmp_path / f"tp{tp}.yaml"
        path.write_text(f"models:\n  - name: m\n    deployments:\n      - name: d\n        backend: native\n"
                        f"        settings: {{model: {tiny_awq_g8}, quantization: awq, tensor_parallel_size: {tp}}}\n")
        code = cli.main(["check-config", str(path)])
        out = capsys.readouterr()
        return code, out.out + out.err

    assert check(2)[0] == 0
    code, output = check(4)
    assert code == 1, output
    assert ("parallel.tensor_parallel_size: 4 ranks cannot split tiny-int4-g8" in output
            and "gate_proj/up_proj's packed int4 columns (a shard of 28 outputs would cut an int32 of 8)" in output
            and output.rstrip().endswith("valid sizes for this model: 1, 2")), output
    assert "Traceback" not in output


def test_the_settings_refuse_a_pipeline_the_model_cannot_run_with_the_reason(tiny_awq_g8):
    """The tiny Llama has 2 layers: 3 stages cannot split them; 2 stages can, but not with a kv_role.
    The check reads config.json alone (no torch)."""
    with pytest.raises(pydantic.ValidationError, match=r"3 stages cannot split 2 layers .*valid sizes for this "
                                                      r"model: 1\.\.2"):
        NativeSettings(model=tiny_awq_g8, pipeline_parallel_size=3)
    with pytest.raises(pydantic.ValidationError, match=r"pipeline_parallel_size 2 with kv_role 'consumer': not "
                                                      r"supported yet"):
        NativeSettings(model=tiny_awq_g8, pipeline_parallel_size=2, kv_role="consumer")
    assert NativeSettings(model=tiny_awq_g8, pipeline_parallel_size=2).engine_config().parallel.world_size == 2


def test_the_split_check_of_the_settings_does_not_import_torch(tiny_awq_g8):
    """The gateway process never imports torch: the settings check reads config.json alone."""
    code = ("import sys; from kvgate_native.settings import NativeSettings; "
            f"NativeSettings(model={tiny_awq_g8!r}, quantization='awq', tensor_parallel_size=2); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("speculative, error", [
    ("{method: ngram, num_speculative_tokens: 4}", None),
    ("{method: draft, draft_num_layers: 4}",
     "tensor_parallel_size 3 with speculative method 'draft': not supported (a draft model runs at "
     "tensor_parallel_size 1 only); with tensor parallelism use speculative method 'ngram' (prompt lookup)"),
])
def test_check_config_passes_ngram_speculation_at_tp3_and_refuses_a_draft_model_naming_ngram(
        tmp_path, capsys, speculative, error):
    from gateway import cli

    path = tmp_path / "tp3.yaml"
    path.write_text("models:\n  - name: m\n    deployments:\n      - name: d\n        backend: native\n"
                    f"        settings: {{tensor_parallel_size: 3, speculative: {speculative}}}\n")
    code = cli.main(["check-config", str(path)])
    out = capsys.readouterr()
    output = out.out + out.err
    if error is None:
        assert code == 0, output
    else:
        assert code == 1 and error in output, output
        assert "Traceback" not in output


def test_the_gateways_sampling_parameters_reach_the_engine_field_for_field():
    """One set of sampling fields across the process boundary: nothing the gateway validated is
    dropped on the way to the engine, and both sides default alike."""
    from gateway.backend import GenerationRequest
    from gateway.backend import SamplingParams as GatewaySampling
    from kvgate_native.mapping import engine_sampling
    from native_backend.core.sampling_params import SamplingParams as EngineSampling

    def defaults(cls):
        return {f.name: f.default for f in dataclasses.fields(cls)}

    assert defaults(GatewaySampling) == defaults(EngineSampling)
    sampling = GatewaySampling(max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=7, stop=("x",),
                               stop_token_ids=(1,), ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.25,
                               repetition_penalty=1.5, logprobs=2)
    assert dataclasses.asdict(engine_sampling(GenerationRequest("r", "m", sampling))) == dataclasses.asdict(sampling)


@pytest.mark.parametrize("embeddings, declared", [(None, True), ({"pooling": "mean"}, True), ({"enabled": False}, False)])
def test_embeddings_are_declared_unless_switched_off(embeddings, declared):
    from kvgate_native.backend import NativeBackend

    settings = NativeSettings(**({"embeddings": embeddings} if embeddings is not None else {}))
    backend = NativeBackend(settings, name="native-0")
    try:
        assert ("embeddings" in backend.capabilities().endpoints) is declared
        assert {"chat", "completions", "tokenize"} <= backend.capabilities().endpoints
    finally:
        backend._tokenize_pool.shutdown()


@pytest.mark.parametrize("embeddings, message", [({"pooling": "max"}, "pooling"), ({"normalize": False}, "normalize")])
def test_check_config_refuses_bad_embedding_settings_naming_them(tmp_path, capsys, embeddings, message):
    from gateway import cli

    path = tmp_path / "embed.yaml"
    path.write_text("models:\n  - name: m\n    deployments:\n      - name: d\n        backend: native\n"
                    f"        settings: {{embeddings: {embeddings}}}\n".replace("'", '"'))
    code = cli.main(["check-config", str(path)])
    out = capsys.readouterr()
    assert code == 1 and f"settings.embeddings.{message}" in out.out + out.err, out.out + out.err


def _gguf_header(fields: list[tuple[str, int, bytes]]) -> bytes:
    """A GGUF file's header (no tensors): (key, value type, encoded value) per metadata entry."""
    text = lambda s: struct.pack("<Q", len(s.encode())) + s.encode()  # noqa: E731
    body = b"".join(text(key) + struct.pack("<I", kind) + value for key, kind, value in fields)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + body


def test_the_architecture_is_read_from_a_model_file_without_reading_the_whole_file(tmp_path):
    """The default GGUF names llama first; a header that names it after a string, a number and an
    array of strings (the tokenizer's shape) is scanned to it; an HF directory's config.json."""
    from native_backend.config.architectures import architecture_on_disk
    from native_backend.config.default_model import default_gguf_path

    assert architecture_on_disk(default_gguf_path()) == "llama"
    s = lambda v: struct.pack("<Q", len(v)) + v.encode()  # noqa: E731
    later = tmp_path / "later.gguf"
    later.write_bytes(_gguf_header([("general.name", 8, s("x")), ("general.alignment", 4, struct.pack("<I", 32)),
                                    ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + s("a") + s("bc")),
                                    ("general.architecture", 8, s("qwen2"))]))
    assert architecture_on_disk(str(later)) == "qwen2"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert architecture_on_disk(str(tmp_path / "hf")) == "mistral"
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        architecture_on_disk(str(tmp_path / "not.gguf"))


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_check_config_refuses_a_model_file_of_an_architecture_the_engine_does_not_run(tmp_path, capsys, kind):
    """Refused by name with the list the model registry builds from (config.architectures), the
    default model passes, and the check never imports torch."""
    from gateway import cli
    from native_backend.model.models import MODEL_CLASSES

    if kind == "gguf":
        model = tmp_path / "qwen.gguf"
        model.write_bytes(_gguf_header([("general.architecture", 8, struct.pack("<Q", 5) + b"qwen2")]))
    else:
        model = tmp_path / "qwen"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))

    def check(settings: str) -> tuple[int, str]:
        path = tmp_path / "c.yaml"
        path.write_text("models:\n  - name: m\n    deployments:\n      - name: d\n        backend: native\n"
                        f"        settings: {settings}\n")
        code = cli.main(["check-config", str(path)])
        out = capsys.readouterr()
        return code, out.out + out.err

    code, output = check(f"{{model: {model}}}")
    assert code == 1 and "model architecture 'qwen2' is not supported; this engine runs llama, mistral" in output
    assert "Traceback" not in output
    assert list(MODEL_CLASSES) == ["llama", "mistral"]
    assert check("{model: default}")[0] == 0
    probe = ("import sys; from kvgate_native.settings import NativeSettings\n"
             f"try: NativeSettings(model={str(model)!r})\nexcept ValueError as e: assert 'qwen2' in str(e)\n"
             "else: raise SystemExit('accepted')\n"
             "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
