"""Readiness: every deployment up ("all", the default), or one per model ("any")."""

import httpx
import pytest

from tests.support.servers.loopback import GatewayServer

CONFIG = """
server: {{readiness: {mode}}}
models:
  - name: pool
    deployments:
      - {{name: up-0, backend: echo}}
      - {{name: down-0, backend: echo, settings: {{refuse_at_start: true}}}}
  - name: single
    deployments: [{{name: up-1, backend: echo}}]
"""


@pytest.mark.parametrize("mode, status", [("all", 503), ("any", 200)])
def test_readiness_modes(mode, status):
    with GatewayServer(CONFIG.format(mode=mode)) as gw:
        r = httpx.get(gw.base_url + "/health/ready")
        assert r.status_code == status
        assert r.json()["deployments"]["up-0"] == "ready"
        assert "refuses to start" in r.json()["deployments"]["down-0"]


def test_any_mode_is_not_ready_when_a_model_has_no_deployment_up():
    config = CONFIG.format(mode="any").replace("{name: up-1, backend: echo}",
                                                "{name: up-1, backend: echo, settings: {refuse_at_start: true}}")
    with GatewayServer(config) as gw:
        assert httpx.get(gw.base_url + "/health/ready").status_code == 503


def test_a_disaggregated_model_with_only_its_prefill_pool_up_cannot_serve():
    config = """
server: {readiness: any}
models:
  - name: pd
    deployments:
      - {name: p-0, backend: echo, role: prefill}
      - {name: d-0, backend: echo, role: decode, settings: {refuse_at_start: true}}
"""
    with GatewayServer(config) as gw:
        assert httpx.get(gw.base_url + "/health/ready").status_code == 503
        assert httpx.get(gw.base_url + "/health").json() == {"status": "unavailable", "models_down": ["pd"]}
        refused = httpx.post(gw.base_url + "/v1/completions", json={"model": "pd", "prompt": "a b", "max_tokens": 2})
        assert refused.status_code == 503


def test_a_disaggregated_echo_model_serves_through_both_pools():
    config = """
models:
  - name: pd
    deployments:
      - {name: p-0, backend: echo, role: prefill}
      - {name: d-0, backend: echo, role: decode}
"""
    with GatewayServer(config) as gw:
        answer = httpx.post(gw.base_url + "/v1/completions", json={"model": "pd", "prompt": "a b c", "max_tokens": 3})
        assert answer.status_code == 200
        hops = httpx.get(gw.base_url + "/metrics").text
        assert 'kvgate_pd_hops_total{model="pd",outcome="ok",pool="prefill"} 1.0' in hops
        assert 'kvgate_pd_hops_total{model="pd",outcome="ok",pool="decode"} 1.0' in hops
