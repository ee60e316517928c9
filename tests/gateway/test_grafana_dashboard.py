"""The Grafana dashboard only queries metrics that kvgate really exports."""

import json
import re
from pathlib import Path

import httpx

from tests.support.servers.loopback import GatewayServer

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "kvgate-dashboard.json"
METRIC = re.compile(r"\b(kvgate_[a-z0-9_]+)")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def exported_families() -> set[str]:
    """Families a gateway with an engine-like backend exports (the engine series need one)."""
    from prometheus_client.parser import text_string_to_metric_families

    with GatewayServer("models:\n  - name: m\n    deployments: [{name: d, backend: echo}]\n") as gw:
        httpx.post(gw.base_url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2})
        text = httpx.get(gw.base_url + "/metrics").text
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.add(family.name)
    return names


def test_dashboard_is_valid_json_with_panels():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "kvgate"
    assert len(dash["panels"]) >= 10
    assert all(p["targets"] for p in dash["panels"])


def test_every_gateway_series_in_the_dashboard_exists():
    exported = exported_families()
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in METRIC.findall(e)}
    gateway_series = {m for m in used if not m.startswith("kvgate_engine_")}
    missing = [m for m in gateway_series
               if m not in exported and not any(m.removesuffix(s) in exported for s in SUFFIXES)]
    assert missing == []
    # engine series come from metrics.ENGINE_SERIES, exported when a native engine is present
    from gateway.observability.metrics import ENGINE_SERIES

    engine_names = {name for name, *_ in ENGINE_SERIES}
    for m in used - gateway_series:
        assert m.removesuffix("_total") in engine_names, m
