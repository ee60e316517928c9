"""Prometheus metrics at GET /metrics, read back with prometheus_client's own parser."""

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers.loopback import GatewayServer

CONFIG = """
sla_classes:
  - {name: interactive, priority: 0, max_queue_wait_s: 10}
  - {name: batch, priority: 10, sheddable: true}
default_sla_class: interactive
models:
  - name: echo
    queue: {max_in_flight_per_deployment: 1}
    deployments: [{name: echo-0, backend: echo, settings: {tokens_per_second: 100}}]
  - name: flaky
    policy: round_robin
    breaker: {failures: 1, cooldown_s: 60}
    deployments:
      - {name: bad, backend: echo, settings: {fail_after_tokens: 0}}
      - {name: good, backend: echo}
"""


@pytest.fixture(scope="module")
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


def scrape(gw) -> dict[str, list]:
    r = httpx.get(gw.base_url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def value(samples, name, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def quantile(samples, name, q, **labels) -> float:
    """histogram_quantile, as PromQL computes it, from the cumulative buckets."""
    buckets = sorted(
        ((float(s.labels["le"]), s.value) for s in samples[name + "_bucket"]
         if all(s.labels.get(k) == v for k, v in labels.items())), key=lambda b: b[0])
    total = buckets[-1][1]
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_bound, prev_count = bound, count
    return prev_bound


def complete(gw, model="echo", sla=None, stream=False, max_tokens=5):
    headers = {"x-sla-class": sla} if sla else {}
    body = {"model": model, "prompt": "a b c d", "max_tokens": max_tokens, "stream": stream}
    return httpx.post(gw.base_url + "/v1/completions", json=body, headers=headers, timeout=30)


def test_request_counts_latencies_and_tokens(gw):
    for stream in (False, True, False):
        assert complete(gw, stream=stream).status_code == 200
    samples = scrape(gw)
    assert value(samples, "kvgate_requests_total", model="echo", deployment="echo-0",
                 sla_class="interactive", status="200") >= 3
    assert value(samples, "kvgate_time_to_first_token_seconds_count", model="echo") >= 3
    assert value(samples, "kvgate_inter_token_latency_seconds_count", model="echo") >= 12  # 4 gaps x 3
    assert value(samples, "kvgate_completion_tokens_sum", model="echo") >= 15
    assert value(samples, "kvgate_prompt_tokens_sum", model="echo") >= 12
    # at 100 tokens/s the gaps are ~10 ms: P50 and P99 computed from the buckets say so
    p50 = quantile(samples, "kvgate_inter_token_latency_seconds", 0.5, model="echo")
    p99 = quantile(samples, "kvgate_e2e_request_latency_seconds", 0.99, model="echo")
    assert 0.005 <= p50 <= 0.05
    assert 0.03 <= p99 <= 5


def test_shed_and_queue_metrics(gw):
    holder = threading.Thread(target=complete, args=(gw,), kwargs={"max_tokens": 60})
    holder.start()
    deadline = time.monotonic() + 5
    while gw.state.registry.resolve("echo").in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert value(scrape(gw), "kvgate_in_flight_requests", model="echo") == 1
    assert complete(gw, sla="batch").status_code == 503
    holder.join()
    samples = scrape(gw)
    assert value(samples, "kvgate_shed_requests_total", model="echo", sla_class="batch", reason="shed") == 1
    assert value(samples, "kvgate_requests_total", model="echo", status="503") >= 1
    assert value(samples, "kvgate_queue_wait_seconds_count", model="echo") >= 1
    assert value(samples, "kvgate_in_flight_requests", model="echo") == 0


def test_retries_and_breaker_state(gw):
    assert complete(gw, model="flaky").status_code == 200
    samples = scrape(gw)
    assert value(samples, "kvgate_backend_retries_total", model="flaky", deployment="bad") >= 1
    assert value(samples, "kvgate_breaker_state", model="flaky", deployment="bad") == 2  # open
    assert value(samples, "kvgate_breaker_state", model="flaky", deployment="good") == 0
    assert value(samples, "kvgate_deployment_up", deployment="good") == 1


def test_a_400_of_the_backends_own_checks_is_not_charged_to_its_deployment(gw):
    """The echo deployment refuses a prompt + max_tokens over its context after routing: that is
    the client's mistake, counted under no deployment as the gateway's own refusals are."""
    body = {"model": "echo", "prompt": "a " * 4095, "max_tokens": 10}  # echo's context: 4096 words
    r = httpx.post(gw.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    samples = scrape(gw)
    assert value(samples, "kvgate_requests_total", model="echo", status="400", deployment="echo-0") == 0
    assert value(samples, "kvgate_requests_total", model="echo", status="400", deployment="") == 1


def test_refusals_while_the_body_is_parsed_and_the_model_resolved_are_counted(gw):
    """400s and 404s before any request record: under no deployment and no SLA class, the model
    the body named when it is one, else "" (a client's made-up model names are no label values)."""
    def refusals(model, status):
        return value(scrape(gw), "kvgate_requests_total", model=model, deployment="", sla_class="", status=status)

    before = {k: refusals(*k) for k in [("echo", "400"), ("", "404"), ("", "400")]}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    sent = [
        ("/v1/chat/completions", {"model": "echo", **chat, "temperature": 5}, 400),  # the body's own check
        ("/v1/chat/completions", {"model": "echo", **chat, "skip_special_tokens": 1}, 400),
        ("/v1/completions", {"model": "echo", "prompt": "hi", "max_tokens": 1, "logit_bias": {"1": 2}}, 400),
        ("/v1/chat/completions", {"model": "no-such-model-7f3a", **chat}, 404),
        ("/tokenize", {"model": "no-such-model-7f3a", "prompt": "hi"}, 404),
        ("/v1/chat/completions", {"model": ["echo"], **chat}, 400),
    ]
    for path, body, status in sent:
        assert httpx.post(gw.base_url + path, json=body, timeout=30).status_code == status, body
    assert httpx.post(gw.base_url + "/v1/completions", content=b"{not json", timeout=30).status_code == 400
    assert refusals("echo", "400") - before[("echo", "400")] == 3
    assert refusals("", "404") - before[("", "404")] == 2
    assert refusals("", "400") - before[("", "400")] == 2
    assert not any("no-such-model" in s.labels.get("model", "") for s in scrape(gw)["kvgate_requests_total"])
