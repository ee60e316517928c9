"""Speculative decoding behind a live gateway, through the real openai client.

One gateway serves four native deployments of SmolLM2 (one engine process each): no
speculation, n-gram drafts, the self-speculative draft (the model's first 4 layers), and a
separate draft model: an int4 copy of the target (`kvgate quantize`'s format; RTN for speed). Greedy
answers with speculation equal those without, streamed and not; then /metrics, the engine spans
and the status page report the speculation those requests did, consistently with each other.
"""

import asyncio
import os
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers.loopback import GatewayServer

pytestmark = pytest.mark.timeout(900)

ENGINE = "max_num_seqs: 4, max_num_batched_tokens: 128, kv_cache_bytes: 67108864, num_threads: 1"
# min_acceptance_rate 0: the 4-layer early exit guesses poorly, and every step should verify.
CONFIG = """
models:
  - name: plain
    deployments: [{{name: plain-0, backend: native, settings: {{{ENGINE}}}}}]
  - name: ngram
    deployments:
      - name: ngram-0
        backend: native
        settings: {{{ENGINE}, speculative: {{method: ngram, num_speculative_tokens: 4}}}}
  - name: selfdraft
    deployments:
      - name: selfdraft-0
        backend: native
        settings:
          {{{ENGINE}, speculative: {{method: draft, draft_num_layers: 4, num_speculative_tokens: 3,
                                     min_acceptance_rate: 0.0}}}}
  - name: int4draft
    deployments:
      - name: int4draft-0
        backend: native
        settings: {{{ENGINE}, speculative: {{method: draft, draft_model: {INT4_DIR}, num_speculative_tokens: 2}}}}
"""
SPECULATING = {"ngram": ("ngram-0", 4), "selfdraft": ("selfdraft-0", 3), "int4draft": ("int4draft-0", 2)}

PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs "
           "into the forest, where the trees are tall and the river is cold.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
CHATS = [
    f"Repeat this passage word for word: {PASSAGE}",
    "Write three sentences about the moon.",
    f"Fix the typo and repeat the rest unchanged: {PASSAGE.replace('forest', 'forrest')}",
]
PROMPTS = [CODE, f"{PASSAGE}\n\nThe same passage again:\n{PASSAGE[:40]}", "The capital of France is"]
GREEDY = dict(temperature=0, max_tokens=40, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    from native_backend.model.loader import default_gguf_path
    from native_backend.tools.quantize import QuantizeOptions, quantize_model

    int4_dir = tmp_path_factory.mktemp("smollm2-int4")
    quantize_model(default_gguf_path(), str(int4_dir), QuantizeOptions(method="rtn", group_size=64))
    exporter = InMemorySpanExporter()
    config = CONFIG.format(ENGINE=ENGINE, INT4_DIR=int4_dir)
    with GatewayServer(config, ready_timeout=900, span_exporter=exporter) as gw:
        yield gw, exporter


@pytest.fixture(scope="module")
def client(traced):
    return traced[0].openai(timeout=300)


def chat(client, model, content, stream):
    kw = dict(model=model, messages=[{"role": "user", "content": content}], **GREEDY)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def complete(client, model, prompt, stream):
    if not stream:
        return client.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(model=model, prompt=prompt, stream=True,
                                                                          **GREEDY) if c.choices)


@pytest.fixture(scope="module")
def plain_answers(client):
    return {"chat": [chat(client, "plain", c, stream=False) for c in CHATS],
            "completion": [complete(client, "plain", p, stream=False) for p in PROMPTS]}


@pytest.mark.parametrize("model", sorted(SPECULATING))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_with_speculation_equals_greedy_without(client, plain_answers, model, stream):
    assert [chat(client, model, c, stream) for c in CHATS] == plain_answers["chat"]
    assert [complete(client, model, p, stream) for p in PROMPTS] == plain_answers["completion"]


def scrape(gw) -> dict[str, list]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(gw.base_url + "/metrics").text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def value(samples, name, **labels) -> float:
    [s] = [s for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    return s.value


def per_position(samples, name, **labels) -> dict[int, float]:
    return {int(s.labels["position"]): s.value for s in samples.get(name, [])
            if all(s.labels.get(k) == v for k, v in labels.items())}


def spec_counts_from_spans(exporter, deployment) -> dict[str, float]:
    """Sums of the engine.decode spans' speculation attributes of one deployment's requests."""
    spans = exporter.get_finished_spans()
    attempts = {s.context.span_id for s in spans
                if s.kind == SpanKind.CLIENT and s.attributes.get("kvgate.deployment") == deployment}
    decodes = [s for s in spans if s.name == "engine.decode" and s.parent.span_id in attempts]
    keys = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    totals = {k: sum(s.attributes[f"kvgate.engine.{k}"] for s in decodes) for k in keys}
    totals["requests"] = len(decodes)
    totals["rates"] = [s.attributes.get("kvgate.engine.spec_acceptance_rate") for s in decodes]
    return totals


def settled_metrics(gw, exporter, deployment, model):
    """/metrics once the engine's periodic stats have caught up with the finished requests."""
    deadline = time.monotonic() + 30
    while True:
        samples, spans = scrape(gw), spec_counts_from_spans(exporter, deployment)
        if value(samples, "vllm:spec_decode_num_draft_tokens_total", model_name=model) == spans["spec_draft_tokens"]:
            return samples, spans
        assert time.monotonic() < deadline, "the engine's stats never caught up with its spans"
        time.sleep(0.2)


@pytest.mark.parametrize("model", sorted(SPECULATING))
def test_metrics_and_spans_count_the_speculation_done(traced, client, plain_answers, model):
    gw, exporter = traced
    deployment, k = SPECULATING[model]
    for content in CHATS:  # this deployment has decoded something, whatever ran before
        chat(client, model, content, stream=False)
    samples, spans = settled_metrics(gw, exporter, deployment, model)
    vllm = {"model_name": model, "engine": deployment}
    ours = {"model": model, "deployment": deployment}

    drafts = value(samples, "vllm:spec_decode_num_drafts_total", **vllm)
    proposed = value(samples, "vllm:spec_decode_num_draft_tokens_total", **vllm)
    accepted = value(samples, "vllm:spec_decode_num_accepted_tokens_total", **vllm)
    per_pos = per_position(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **vllm)
    assert drafts > 0 and 0 < accepted <= proposed <= k * drafts
    assert sorted(per_pos) == list(range(k))  # every position from 0 to k - 1, zeros included
    counts = [per_pos[j] for j in range(k)]
    assert counts == sorted(counts, reverse=True) and sum(counts) == accepted  # position j needs j - 1 first
    assert counts[0] <= drafts

    # kvgate's names carry the same numbers
    assert value(samples, "kvgate_engine_spec_decode_drafts_total", **ours) == drafts
    assert value(samples, "kvgate_engine_spec_decode_draft_tokens_total", **ours) == proposed
    assert value(samples, "kvgate_engine_spec_decode_accepted_tokens_total", **ours) == accepted
    assert per_position(samples, "kvgate_engine_spec_decode_accepted_tokens_per_pos_total", **ours) == per_pos

    # every request's decode span says what it speculated: the sums are the engine's counters
    assert spans["requests"] >= len(CHATS)
    assert (spans["spec_drafts"], spans["spec_draft_tokens"], spans["spec_accepted_tokens"]) == (
        drafts, proposed, accepted)
    assert all(r is None or 0.0 <= r <= 1.0 for r in spans["rates"]) and any(r is not None for r in spans["rates"])

    # the status page shows the same acceptance
    [d] = [d for m in httpx.get(gw.base_url + "/status.json").json()["models"] if m["name"] == model
           for d in m["deployments"]]
    shown = d["engine"]["spec_decode"]
    assert shown["num_speculative_tokens"] == k
    assert shown["acceptance_rate"] == pytest.approx(accepted / proposed)
    assert shown["mean_accepted_length"] == pytest.approx(1 + accepted / drafts)


def test_a_deployment_without_speculation_exports_no_spec_decode_series(traced, plain_answers):
    gw, exporter = traced
    samples = scrape(gw)
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "kvgate_engine_spec_decode_drafts_total"):
        assert not [s for s in samples.get(name, []) if "plain" in s.labels.values()]
    assert value(samples, "vllm:num_requests_running", model_name="plain") == 0  # the engine is exported
    [d] = [d for m in httpx.get(gw.base_url + "/status.json").json()["models"] if m["name"] == "plain"
           for d in m["deployments"]]
    assert "spec_decode" not in d["engine"]
    spans = exporter.get_finished_spans()
    attempts = {s.context.span_id for s in spans
                if s.kind == SpanKind.CLIENT and s.attributes.get("kvgate.deployment") == "plain-0"}
    decodes = [s for s in spans if s.name == "engine.decode" and s.parent.span_id in attempts]
    assert decodes and not any(k.startswith("kvgate.engine.spec_") for s in decodes for k in s.attributes)


def test_a_missing_draft_model_is_refused_at_start_naming_it(tmp_path):
    from kvgate_native.backend import make_native_backend

    missing = str(tmp_path / "no-such-draft")
    backend = make_native_backend({"speculative": {"method": "draft", "draft_model": missing}}, "draft-0")
    with pytest.raises(RuntimeError, match=f"'draft-0': speculative.draft_model {missing} does not exist"):
        asyncio.run(backend.start())
