"""Fuzz a live gateway in front of the native engine (SmolLM2) from its OpenAPI schema: no
response >= 500, every 4xx an OpenAI-style error, and the engine still up and serving (never
restarted) afterwards. Small limits keep each generated case cheap on a CPU (a chat request
without max_tokens runs to the end of the context, here 96 tokens)."""

import os

import httpx
import pytest

from tests.support.checks.fuzz_run import assert_each_pair_ran, examples_for_total, fuzz
from tests.support.servers.loopback import GatewayServer

pytestmark = pytest.mark.timeout(1800)

FUZZ_EXAMPLES = int(os.environ.get("KVGATE_NATIVE_FUZZ_EXAMPLES", "25"))

CONFIG = """
server:
  limits: {max_tokens: 3, max_n: 2, max_prompts: 2, max_choices: 4, max_prompt_tokens: 256, max_body_bytes: 16384}
models:
  - name: smollm2
    deployments:
      - name: native-0
        backend: native
        settings: {max_num_seqs: 8, kv_cache_bytes: 67108864, num_threads: 2, max_model_len: 96}
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    with GatewayServer(CONFIG, ready_timeout=600) as server:
        yield server


def check_engine_unharmed(gw):
    backend = gw.backend("native-0")
    assert backend.supervisor.state == "up" and backend.supervisor.restarts == 0
    r = httpx.post(gw.base_url + "/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    deployment = gw.state.registry.deployments()[0]
    assert deployment.breaker.state == "closed" and deployment.in_flight == 0


def test_fuzzing_the_native_engine_never_reaches_a_500(gw):
    result = fuzz(gw.base_url, FUZZ_EXAMPLES)
    print(f"fuzz (native): {result}")
    assert_each_pair_ran(result, FUZZ_EXAMPLES)
    assert 200 in result["statuses"]
    check_engine_unharmed(gw)


@pytest.mark.slow
def test_fuzz_tier_native(gw):
    examples = examples_for_total(gw.base_url, 2_000)  # every operation x both generation modes
    result = fuzz(gw.base_url, examples)
    print(f"fuzz tier (native): {result}")
    assert_each_pair_ran(result, examples)
    check_engine_unharmed(gw)
