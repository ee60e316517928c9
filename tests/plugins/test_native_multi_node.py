"""Two launches on loopback form one engine and serve over HTTP through the gateway (issue 47 item 3):
node 0 is a real gateway whose native deployment says nnodes 2 (SmolLM2 fp32, pipeline parallel 2),
node 1 `kvgate engine --headless --node-rank 1` in its own process group, started first (it waits
for node 0's rendezvous).

Greedy completions through the openai client equal transformers'. A node-1 rank SIGKILLed
mid-stream fails the in-flight stream with one error event, the supervisor's cause names rank 1 on
node 1, the engine restarts, node 1 rejoins it on its own, and the model serves again.
"""

from __future__ import annotations

import os
import signal

import pytest

from native_backend.model.loader import default_gguf_path
from native_backend.text.tokenizer import Tokenizer
from tests.support.checks.node_checks import SECRET, Node, free_port
from tests.support.checks.stream_checks import ends_with_one_error_then_done, ready, stream_lines, wait_until
from tests.support.checks.tensor_parallel_checks import smollm2_prompts, transformers_greedy
from tests.support.servers.loopback import GatewayServer

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]  # two SmolLM2 loads, ~6 min on 2 loaded cores

NEW_TOKENS = 12


def config(port: int, secret_file: str) -> str:
    settings = (f"{{pipeline_parallel_size: 2, nnodes: 2, master_addr: 127.0.0.1, master_port: {port}, "
                f"rendezvous_secret_file: {secret_file}, num_threads: 1, kv_cache_bytes: 33554432, "
                "max_num_seqs: 4, collective_timeout_s: 10, "
                "supervision: {watchdog_s: 60, backoff_s: 0.2, max_deaths: 5, window_s: 600}}")
    return f"""
models:
  - name: smollm2
    breaker: {{failures: 50, cooldown_s: 1}}
    deployments:
      - name: native-2nodes
        backend: native
        settings: {settings}
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    os.environ.setdefault("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    secret_file = tmp_path_factory.mktemp("secret") / "rendezvous"
    secret_file.write_text(SECRET)
    port = free_port()
    node = Node(port)  # waits for node 0
    try:
        with GatewayServer(config(port, str(secret_file)), ready_timeout=900) as server:
            server.node = node
            yield server
    finally:
        node.kill()


def test_two_launches_serve_greedy_completions_equal_to_transformers(gw, tmp_path):
    tokenizer = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=tmp_path)
    prompts = smollm2_prompts(tokenizer)[:2]
    client = gw.openai(timeout=300)
    got = [client.completions.create(model="smollm2", prompt=p, max_tokens=NEW_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}) for p in prompts]
    for out, tokens in zip(got, transformers_greedy(prompts, NEW_TOKENS)):
        assert out.choices[0].text == tokenizer.decode(tokens)
    gw.node.wait_for("joining the engine at 127.0.0.1")


def test_a_node_that_dies_fails_the_stream_and_the_engine_comes_back_with_it(gw):
    backend = gw.backend("native-2nodes")
    restarts, joins = backend.supervisor.restarts, gw.node.count("joining the engine")
    lines = stream_lines(gw, max_tokens=400)  # within the 32 MiB KV cache: killed long before its end
    next(lines)  # streaming
    for pid in gw.node.rank_pids():  # the node's rank, not its agent: the agent rejoins the restarted engine
        os.kill(pid, signal.SIGKILL)
    assert "native-2nodes" in ends_with_one_error_then_done(lines)
    wait_until(lambda: backend.supervisor.restarts > restarts, 60, "the supervisor to restart the engine")
    assert "rank 1 on node 1" in backend.supervisor.last_cause
    assert "closed its connection" in backend.supervisor.last_cause
    wait_until(lambda: gw.node.count("joining the engine") > joins, 300, "node 1 to rejoin")
    wait_until(lambda: ready(gw), 900, "the restarted engine")
    answer = gw.openai(timeout=120).completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    assert answer.usage.completion_tokens == 2
