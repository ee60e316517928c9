"""The chart's engine across machines, rendered then run on loopback processes (issue 47 item 3).

engines[].nnodes 2 on cpu (the default SmolLM2 file, pipeline parallel 2) is rendered with the real
helm; the leader pod's container command runs here with sh (its config from the ConfigMap, the
downward API's pod IP 127.0.0.1, the env its Secrets give it, `kvgate serve` bound to a loopback
port) and so does the node pod's (pod index 0, its Secret's env), the one substitution being the
leader Service's DNS name, which only a cluster resolves, by 127.0.0.1. The two form one engine:
the leader serves a completion with the engine key, and its start-up line says 2 nodes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.charts.test_helm import (NAMESPACE, RELEASE, REPO, config_maps, engine_container, find, render,
                                    secret_env, stop)
from tests.support.checks.node_checks import free_port
from tests.support.servers.loopback import listening_url

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]  # SmolLM2 loaded by two processes

VALUES = """
models:
  - name: smollm2-135m-instruct
engines:
  - {{name: big, model: smollm2-135m-instruct, pipelineParallelSize: 2, nnodes: 2, masterPort: {port},
     kvCacheBytes: 33554432, maxNumSeqs: 4, numThreads: 1}}
"""


@pytest.fixture(scope="module")
def helm():
    from tests.charts.tools import tool_path

    return str(tool_path("helm"))


def leader_script(docs, tmp_path) -> str:
    [script] = engine_container(docs, "big")["args"]
    mounted = tmp_path / "mounted.yaml"
    mounted.write_text(config_maps(docs)[f"{RELEASE}-kvgate-big-config"])
    script = script.replace("/etc/kvgate/config.yaml", str(mounted)).replace("/tmp/config.yaml",
                                                                            str(tmp_path / "written.yaml"))
    assert "exec kvgate serve --config" in script
    return script.replace("exec kvgate serve --config", f"exec {sys.executable} -m gateway.cli serve --config") + (
        " --host 127.0.0.1 --port 0")


def node_script(docs) -> str:
    [nodes] = find(docs, "StatefulSet", f"{RELEASE}-kvgate-big-nodes")
    [script] = nodes["spec"]["template"]["spec"]["containers"][0]["args"]
    leader = f"{RELEASE}-kvgate-big-leader.{NAMESPACE}.svc.cluster.local"
    assert f"--master-addr {leader} " in script and script.startswith("exec kvgate engine --headless")
    return script.replace(leader, "127.0.0.1").replace("exec kvgate engine",
                                                       f"exec {sys.executable} -m gateway.cli engine")


def test_the_rendered_leader_and_node_form_one_engine_and_serve(helm, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(VALUES.format(port=free_port()))
    docs = render(helm, [values])
    cache = {"KVGATE_CACHE_DIR": os.environ.get("KVGATE_CACHE_DIR", str(tmp_path / "cache"))}
    leader_env = {**os.environ, **cache, **secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-big"),
                  "KVGATE_POD_IP": "127.0.0.1"}
    node_env = {**os.environ, **cache, **secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-big-nodes"),
                "KVGATE_POD_INDEX": "0"}
    log_path = tmp_path / "leader.log"
    with open(log_path, "wb") as log, open(tmp_path / "node.log", "wb") as node_log:
        node = subprocess.Popen(["sh", "-c", node_script(docs)], cwd=REPO, env=node_env, stdout=node_log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        leader = subprocess.Popen(["sh", "-c", leader_script(docs, tmp_path)], cwd=REPO, env=leader_env, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        base = listening_url(leader, log_path, timeout=900)
        key = leader_env["KVGATE_ENGINE_KEY"]
        answer = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                            json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4,
                                  "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert "2 nodes from 127.0.0.1" in log_path.read_text(errors="replace")
        assert "joining the engine at 127.0.0.1" in (tmp_path / "node.log").read_text(errors="replace")
    finally:
        stop(leader)
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
