"""Readiness: every deployment up ("all", the default), or one per model ("any")."""

import httpx
import pytest

from servers import GatewayServer

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
