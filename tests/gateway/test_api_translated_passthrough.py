"""/v1/responses passed through to a deployment that serves the Responses API itself (here
another kvgate on loopback, `server: kvgate`), translated onto chat for one that does not: the
back gateway's traces show which path each request took, and the client gets the same answer
either way, streamed or not, counted in the front gateway's metrics."""

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from kvgate_echo import reply_pieces
from tests.support.servers.loopback import GatewayServer, free_port

BACK = """
models:
  - name: echo
    deployments: [{name: echo-0, backend: echo}]
  - name: failing
    deployments: [{name: failing-0, backend: echo, settings: {fail_after_tokens: 2}}]
"""

FRONT = """
models:
  - name: echo
    policy: round_robin
    deployments:
      - name: native-responses
        backend: openai
        upstream_model: echo
        settings: {{base_url: "{base}/v1", server: kvgate, metrics: none}}
      - name: down
        backend: openai
        upstream_model: echo
        settings: {{base_url: "http://127.0.0.1:{dead}/v1", server: kvgate, metrics: none}}
  - name: chat-only
    deployments:
      - name: chat-only-0
        backend: openai
        upstream_model: echo
        settings: {{base_url: "{base}/v1", server: kvgate, metrics: none,
                    capabilities: {{endpoints: [chat, completions]}}}}
  - name: failing
    deployments:
      - name: failing-up
        backend: openai
        upstream_model: failing
        settings: {{base_url: "{base}/v1", server: kvgate, metrics: none}}
"""
PROMPT = "the quick brown fox jumps"


def expected(max_tokens: int) -> str:
    return "".join(p for _, p in reply_pieces(PROMPT.split(), 0, max_tokens, ())[0])


@pytest.fixture(scope="module")
def gateways():
    exporter = InMemorySpanExporter()
    with GatewayServer(BACK, span_exporter=exporter) as back:
        with GatewayServer(FRONT.format(base=back.base_url, dead=free_port())) as front:
            yield front, back, exporter


def back_paths(exporter) -> list[str]:
    paths = [s.attributes["url.path"] for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    exporter.clear()
    return paths


def test_a_deployment_that_serves_responses_gets_the_request_as_it_came(gateways):
    front, back, exporter = gateways
    back_paths(exporter)
    r = front.openai().responses.create(model="echo", input=PROMPT, max_output_tokens=3)
    assert r.output_text == expected(3) and r.status == "incomplete"
    assert r.model == "echo" and (r.usage.input_tokens, r.usage.output_tokens) == (5, 3)
    assert back_paths(exporter) == ["/v1/responses"]


def test_a_deployment_that_does_not_gets_it_translated_onto_chat(gateways):
    front, back, exporter = gateways
    back_paths(exporter)
    r = front.openai().responses.create(model="chat-only", input=PROMPT, max_output_tokens=3)
    assert r.output_text == expected(3) and r.model == "chat-only"  # the front's own answer
    assert back_paths(exporter) == ["/v1/chat/completions"]


def test_a_passed_through_stream_is_the_upstreams_events_as_they_came(gateways):
    front, back, exporter = gateways
    direct = list(back.openai().responses.create(model="echo", input=PROMPT, max_output_tokens=4, stream=True))
    back_paths(exporter)
    before = _completion_tokens(front)
    relayed = list(front.openai().responses.create(model="echo", input=PROMPT, max_output_tokens=4, stream=True))
    assert back_paths(exporter) == ["/v1/responses"]
    assert [(e.type, e.sequence_number, getattr(e, "delta", None)) for e in relayed] == [
        (e.type, e.sequence_number, getattr(e, "delta", None)) for e in direct]
    assert relayed[-1].response.output_text == expected(4)
    assert _completion_tokens(front) == before + 4  # its usage was read on the way


def test_an_upstream_failure_mid_stream_is_relayed_as_it_said_it(gateways):
    front, back, _ = gateways
    body = {"model": "failing", "input": PROMPT, "max_output_tokens": 4, "stream": True}
    kinds = []
    for gw in (back, front):
        with httpx.stream("POST", gw.base_url + "/v1/responses", json=body) as r:
            kinds.append([line for line in r.iter_lines() if line.startswith("event: ")])
    direct, relayed = kinds
    assert relayed == direct and direct[-2:] == ["event: error", "event: response.failed"]


def test_requests_fail_over_before_the_first_byte(gateways):
    front, _, _ = gateways
    client = front.openai()
    for _ in range(4):  # round robin: some land on the deployment that is down first
        assert client.responses.create(model="echo", input=PROMPT, max_output_tokens=2).output_text == expected(2)


def _completion_tokens(gw) -> float:
    for family in text_string_to_metric_families(httpx.get(gw.base_url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "kvgate_completion_tokens_sum" and sample.labels["model"] == "echo":
                return sample.value
    return 0.0
