"""precise_prefix over two real native engines publishing KV events: the gateway tokenizes the
chat with the engines' own template, and a conversation's next turn goes to the engine that holds
its history, which then serves it from its prefix cache."""

from __future__ import annotations

import os
import tempfile
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydoc_data.topics import topics

from kvgate_native.backend import _local_address
from tests.support.servers.loopback import GatewayServer

pytestmark = pytest.mark.timeout(900)  # two engines load the real model


ADMIN_ENV, ADMIN_KEY = "KVGATE_TEST_KV_ROUTING_ADMIN", "admin-key-for-kv-routing"


def config(sockets: str) -> str:
    """Each engine publishes on an ipc:// socket of its own in `sockets` (a folder): nothing to
    pick beforehand that another process could take (a free TCP port found earlier can be), and
    nothing on the network; the gateway subscribes to the same path (the TCP wire is
    tests/native_backend/test_kv_events.py's, on ports the publisher binds as tcp://127.0.0.1:*)."""
    engines = "".join(f"""
      - name: native-{i}
        backend: native
        settings: {{max_num_seqs: 4, kv_cache_bytes: 67108864, num_threads: 1,
                   kv_events: {{endpoint: "ipc://{sockets}/e{i}", replay_endpoint: "ipc://{sockets}/e{i}r"}}}}"""
                      for i in range(2))
    return f"""
auth: {{admin_key_env: {ADMIN_ENV}}}
models:
  - name: smollm2
    policy: precise_prefix
    deployments:{engines}
"""


def test_wildcard_endpoints_become_loopback_addresses():
    assert _local_address("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert _local_address("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert _local_address("tcp://[::]:5557") == "tcp://[::1]:5557"
    assert _local_address("tcp://10.0.0.7:5557") == "tcp://10.0.0.7:5557"


def route_of(exporter) -> dict:
    return dict(next(s for s in exporter.get_finished_spans() if s.name == "kvgate.route").attributes)


def test_a_conversations_next_turn_goes_where_its_history_is_cached_until_the_caches_are_reset(tmp_path, monkeypatch):
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path / "kvgate-cache"))
    monkeypatch.setenv(ADMIN_ENV, ADMIN_KEY)
    exporter = InMemorySpanExporter()
    system = "Answer briefly. Reference: " + " ".join(topics["for"].split())[:1200]
    # A short folder (an ipc path has ~100 bytes at most), removed after the gateway stops.
    with tempfile.TemporaryDirectory(prefix="kvgate-kv-") as sockets, \
            GatewayServer(config(sockets), ready_timeout=600, span_exporter=exporter) as gw:
        history = [{"role": "system", "content": system}, {"role": "user", "content": "What does a for loop do?"}]

        def turn() -> tuple[dict, dict]:
            exporter.clear()
            r = httpx.post(gw.base_url + "/v1/chat/completions", timeout=300, json={
                "model": "smollm2", "messages": history, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json(), route_of(exporter)

        first, first_route = turn()
        history += [first["choices"][0]["message"], {"role": "user", "content": "And a while loop?"}]
        feed = gw.state.registry.pools[0].policy.kv_feed
        home = first_route["kvgate.deployment"]
        deadline = time.monotonic() + 30
        while not (feed.live(home) and feed.index.blocks_of(home) >= 16):  # the first turn's blocks arrived
            assert time.monotonic() < deadline, "the engine's KV events did not reach the index"
            time.sleep(0.1)
        second, second_route = turn()
        assert second_route["kvgate.deployment"] == home
        assert second_route["kvgate.kv_prefix_matched_tokens"] >= 16 * 16
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 16

        # An operator resets the engines' prefix caches: each says AllBlocksCleared, the index
        # drops their blocks, and the same prompt is computed afresh.
        reset = httpx.post(gw.base_url + "/admin/reset_prefix_cache", params={"model": "smollm2"},
                           headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
        assert reset.status_code == 200 and sorted(reset.json()["reset"]) == ["native-0", "native-1"]
        deadline = time.monotonic() + 30
        while any(feed.index.blocks_of(name) for name in feed.streams):
            assert time.monotonic() < deadline, "the reset did not reach the index"
            time.sleep(0.05)
        again, again_route = turn()  # the second turn's prompt once more
        assert (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
        assert again_route.get("kvgate.kv_prefix_matched_tokens", 0) == 0
