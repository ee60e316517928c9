"""Plugins are found through entry points, exactly as a third party's would be."""

import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import openai
import pytest

from gateway.hookspecs import hookimpl
from gateway.plugins import collect_backends, make_plugin_manager
from tests.support.servers.loopback import listening_url, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def test_echo_distribution_is_discovered_through_its_entry_point():
    [ep] = [ep for ep in entry_points(group="kvgate") if ep.name == "echo"]
    assert ep.dist.name == "kvgate-echo"
    pm = make_plugin_manager()
    assert pm.has_plugin("echo")
    assert "echo" in collect_backends(pm, {}).factories


def test_kvgate_plugins_restricts_what_loads(monkeypatch):
    monkeypatch.setenv("KVGATE_PLUGINS", "something-else")
    pm = make_plugin_manager()
    assert not pm.has_plugin("echo")
    assert pm.has_plugin("builtin_policies")  # the gateway's own always load


def test_registering_a_kind_twice_names_both_plugins():
    class Clash:
        @hookimpl
        def register_backends(self, register, config):
            register("echo", lambda settings, name: None)

    pm = make_plugin_manager({"clash": Clash()})
    with pytest.raises(ValueError, match="'echo' is registered by both plugin 'echo' and plugin 'clash'"):
        collect_backends(pm, {})


def test_plugin_receives_only_its_own_config_section():
    seen = {}

    class Probe:
        @hookimpl
        def register_backends(self, register, config):
            seen.update(config)

    pm = make_plugin_manager({"probe": Probe()})
    collect_backends(pm, {"probe": {"a": 1}, "echo": {"secret": "x"}})
    assert seen == {"a": 1}


def make_third_party_plugin(tmp_path: Path) -> Path:
    """Copy the echo template into a new distribution with its own name and backend kind."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "plugins" / "echo", src, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    (src / "kvgate_echo").rename(src / "kvgate_parrot")
    module = src / "kvgate_parrot" / "__init__.py"
    module.write_text(module.read_text().replace('register("echo"', 'register("parrot"'))
    project = src / "pyproject.toml"
    project.write_text(
        project.read_text()
        .replace('name = "kvgate-echo"', 'name = "kvgate-parrot"')
        .replace('echo = "kvgate_echo"', 'parrot = "kvgate_parrot"')
        .replace('packages = ["kvgate_echo"]', 'packages = ["kvgate_parrot"]')
    )
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    return target


def test_a_third_party_plugin_installed_with_pip_serves_requests(tmp_path):
    site = make_third_party_plugin(tmp_path)
    config = tmp_path / "parrot.yaml"
    config.write_text("models:\n  - name: polly\n    deployments:\n      - name: p0\n        backend: parrot\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    check = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(config)],
                           env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "0"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = listening_url(server, tmp_path / "server.log")
        wait_ready(base, server)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="polly", prompt="pieces of eight", max_tokens=3)
        assert out.choices[0].text == "pieces of eight"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
