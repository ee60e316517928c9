"""Config validation: unknown keys rejected, each error with its path and line."""

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="t.yaml")
    return info.value.problems


def test_shipped_configs_are_valid():
    for name in ("default.yaml", "echo.yaml"):
        config = load_config(ROOT / "configs" / name)
        assert config.models


def test_unknown_key_names_path_and_line():
    text = "models:\n  - name: m\n    deployments:\n      - name: d\n        backend: echo\n        colour: red\n"
    assert problems(text) == ["models[0].deployments[0].colour: unknown key (t.yaml:6)"]


def test_wrong_type_names_path_and_line():
    text = "server:\n  port: lots\nmodels:\n  - name: m\n    deployments: [{name: d, backend: echo}]\n"
    [problem] = problems(text)
    assert problem.startswith("server.port: Input should be a valid integer")
    assert problem.endswith("(t.yaml:2)")


def test_missing_field_and_range():
    text = "server:\n  limits:\n    max_tokens: 0\nmodels:\n  - deployments: []\n"
    found = problems(text)
    assert "server.limits.max_tokens: Input should be greater than 0 (t.yaml:3)" in found
    assert any(p.startswith("models[0].name: Field required") for p in found)
    assert any(p.startswith("models[0].deployments: List should have at least 1 item") for p in found)


def test_duplicate_names_are_refused():
    text = (
        "models:\n  - name: a\n    deployments: [{name: d, backend: echo}]\n"
        "  - name: b\n    aliases: [a]\n    deployments: [{name: d, backend: echo}]\n"
    )
    assert any("'a' is used twice" in p for p in problems(text))


def test_not_yaml_and_not_a_mapping():
    assert problems("models: [")[0].startswith("not valid YAML")
    assert problems("- 1\n- 2\n") == ["the top level must be a mapping (server:, models:, plugins:)"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60)


def test_check_config_cli_accepts_a_good_file():
    result = run_cli("check-config", str(ROOT / "configs" / "echo.yaml"))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_check_config_cli_reports_backend_settings_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "models:\n  - name: m\n    deployments:\n      - name: d\n        backend: echo\n"
        "        settings: {tokens_per_second: -1}\n"
        "      - name: e\n        backend: warp-drive\n"
    )
    result = run_cli("check-config", str(bad))
    assert result.returncode == 1
    assert "models[0].deployments[0].settings.tokens_per_second: Input should be greater than or equal to 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_cli_unknown_backend(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    deployments:\n      - name: e\n        backend: warp-drive\n")
    result = run_cli("check-config", str(bad))
    assert result.returncode == 1
    assert "models[0].deployments[0].backend: unknown backend kind 'warp-drive'" in result.stderr


def test_check_config_cli_missing_file(tmp_path):
    result = run_cli("check-config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 1
    assert "cannot read file" in result.stderr


def _roles(*roles: str, extra: str = "") -> str:
    deployments = "".join(f"      - {{name: d{i}, backend: echo, role: {r}}}\n" for i, r in enumerate(roles))
    return f"models:\n  - name: m\n{extra}    deployments:\n{deployments}"


def test_prefill_and_decode_roles_pair_up():
    config = parse_config(_roles("prefill", "decode", "decode", extra="    disaggregation: {min_prompt_chars: 500}\n"))
    assert config.models[0].disaggregated and config.models[0].disaggregation.min_prompt_chars == 500
    assert not parse_config(_roles("colocated", "colocated")).models[0].disaggregated
    assert problems(_roles("prefill")) == [
        "models[0].deployments: a model with role prefill deployments needs a decode deployment too (t.yaml:4)"]
    assert problems(_roles("decode", "decode"))[0].startswith(
        "models[0].deployments: a model with role decode deployments needs a prefill deployment too")
    assert problems(_roles("prefill", "decode", "colocated"))[0].startswith(
        "models[0].deployments: a model's deployments are either all colocated or each prefill or decode")
    assert problems(_roles("prefill", "decode", extra="    disaggregation: {min_prompt_chars: -1}\n"))[0].startswith(
        "models[0].disaggregation.min_prompt_chars: Input should be greater than or equal to 0")
    assert problems(_roles("mixer"))[0].startswith("models[0].deployments[0].role: Input should be 'colocated'")


def test_check_config_cli_accepts_the_disaggregated_vllm_config():
    result = run_cli("check-config", str(ROOT / "configs" / "disaggregated_vllm.yaml"))
    assert result.returncode == 0, result.stderr
    config = load_config(ROOT / "configs" / "disaggregated_vllm.yaml")
    assert [d.role for d in config.models[0].deployments] == ["prefill", "prefill", "decode", "decode"]


def test_check_config_cli_accepts_the_disaggregated_native_config():
    """configs/disaggregated.yaml (`make serve CONFIG=...`): the gateway's roles, and each native
    engine's KV connector settings, which check-config validates through the plugin."""
    result = run_cli("check-config", str(ROOT / "configs" / "disaggregated.yaml"))
    assert result.returncode == 0, result.stderr
    [model] = load_config(ROOT / "configs" / "disaggregated.yaml").models
    assert [(d.role, d.settings["kv_role"]) for d in model.deployments] == [("prefill", "producer"),
                                                                            ("decode", "consumer")]


def test_check_config_cli_refuses_unpaired_roles(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(_roles("prefill", "prefill"))
    result = run_cli("check-config", str(bad))
    assert result.returncode == 1
    assert "a model with role prefill deployments needs a decode deployment too" in result.stderr
