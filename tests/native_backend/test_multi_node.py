"""An engine across two "nodes" on loopback (issue 47 item 3): node 0 is the engine (rank 0, here in
the test process), node 1 a separate `kvgate engine --headless --node-rank 1` process that holds
rank 1 and serves no HTTP. Pipeline parallel 2, one stage a node, on the tiny 6-layer GQA Llama.

- greedy tokens equal transformers' and a single-process engine's; TP 2 x PP 2 across the two
  nodes (two ranks a node: node 0 spawns rank 1, node 1 ranks 2 and 3) gives transformers' too;
- layouts that cannot span the nodes are refused (uneven ranks; kv_role);
- a node with the wrong secret is refused (its own log says so, node 0's log names it) and the
  engine keeps waiting: it starts once the right node joins;
- a node that dies fails the next step naming rank 1 on node 1; a node that stops answering fails
  it after the collective timeout (the error's words, not a timer, are asserted).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import pytest
import torch

from native_backend.core.engine import LLMEngine
from native_backend.core.interface import EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.factory import make_executor
from native_backend.execution.parallel.executor import TensorParallelError, check_supported
from tests.support.checks.pipeline_checks import NEW_TOKENS, NUM_LAYERS, PROMPTS, config_for, hf_greedy
from tests.support.checks.node_checks import SECRET, START_S, Node, free_port
from tests.support.checks.tensor_parallel_checks import greedy_tokens, tiny_gqa_llama

pytestmark = pytest.mark.timeout(600)

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_gqa_llama(tmp_path_factory.mktemp("tiny-gqa-6"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "rendezvous"
    path.write_text(SECRET + "\n")
    return str(path)


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def start_engine(config) -> tuple[threading.Thread, dict]:
    """make_executor in a thread: node 0 waits at its rendezvous while the test starts nodes (PP 2 on
    two nodes: no local worker, whose PR_SET_PDEATHSIG would fire when this thread ends)."""
    made: dict = {}

    def make():
        try:
            made["executor"] = make_executor(config)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            made["error"] = exc

    thread = threading.Thread(target=make, daemon=True)
    thread.start()
    return thread, made


def two_nodes(checkpoint, secret_file, **settings):
    port = free_port()
    config = config_for(checkpoint, pipeline_parallel_size=2, nnodes=2, master_port=port,
                        rendezvous_secret_file=secret_file, **settings)
    node = Node(port, SECRET)  # it retries until node 0 listens
    # made on this thread: a local worker's PR_SET_PDEATHSIG fires when the thread that spawned it ends
    return config, make_executor(config), node


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def engine(checkpoint, secret_file):
    """Node 0 first meets a node with the wrong secret, then the right one."""
    records, logger = Records(), logging.getLogger("kvgate.engine")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    port = free_port()
    config = config_for(checkpoint, pipeline_parallel_size=2, nnodes=2, master_port=port,
                        rendezvous_secret_file=secret_file)
    thread, made = start_engine(config)
    impostor = node = None
    try:
        silent = connect_when_listening(port)
        silent.sendall(b"kvgate")  # a few bytes of the greeting, then nothing
        while silent.recv(4096):  # node 0's greeting, then its close: it gave up on the handshake (deadline)
            pass
        silent.close()
        impostor = Node(port, "not-the-secret-of-these-nodes")
        refused = impostor.wait_for("refused this node")
        impostor.kill()
        waiting_after_refusal = thread.is_alive()
        node = Node(port, SECRET)
        thread.join(START_S)
        assert "executor" in made, made.get("error")
    except BaseException:
        for n in (impostor, node):
            if n is not None:
                n.kill()  # no node process outlives a failed set-up
        raise
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    yield config, made["executor"], node, (refused, waiting_after_refusal, records.messages)
    made["executor"].close()
    node.kill()


def connect_when_listening(port: int) -> socket.socket:
    for _ in range(START_S * 10):
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            time.sleep(0.1)
    raise AssertionError("node 0 never listened")


def test_a_node_without_the_secret_is_refused_and_the_engine_waits_for_the_right_one(engine):
    _, executor, node, (refused, waiting, messages) = engine
    assert any("refused a peer from 127.0.0.1" in m and "it sent no answer within 5 s" in m for m in messages)
    assert "its rendezvous secret differs" in refused
    assert waiting  # refused, the engine had not started (nor failed): it went on waiting
    assert any("refused a peer from 127.0.0.1" in m and "does not know the shared secret" in m for m in messages)
    assert any(m.startswith("rank 1 joined from 127.0.0.1:") for m in messages)
    assert "2 nodes from 127.0.0.1" in executor.describe()


def test_greedy_tokens_across_two_nodes_equal_transformers_and_one_process(engine, checkpoint, reference):
    config, executor, _, _ = engine
    single = LLMEngine(config_for(checkpoint), make_executor(config_for(checkpoint)))
    assert greedy_tokens(single, PROMPTS, NEW_TOKENS) == reference
    assert greedy_tokens(LLMEngine(config, executor), PROMPTS, NEW_TOKENS) == reference


def test_a_node_that_dies_fails_the_stream_naming_it(engine):
    config, executor, node, _ = engine
    core = LLMEngine(config, executor)
    core.add_request(EngineRequest("dying", PROMPTS[0], SamplingParams(max_tokens=100, temperature=0.0,
                                                                       ignore_eos=True)))
    tokens = 0
    while tokens < 3:  # the stream is under way
        tokens += sum(len(o.new_token_ids) for o in core.step())
    node.kill()
    with pytest.raises(TensorParallelError, match=r"pipeline-parallel worker died: rank 1 on node 1 "
                                                  r"\(127\.0\.0\.1:\d+\) closed its connection"):
        for _ in range(100):
            core.step()


def test_a_node_that_stops_answering_fails_the_step_after_the_collective_timeout(engine, checkpoint, secret_file):
    engine[1].close()  # one group per process: the first engine's is over
    config, executor, node = two_nodes(checkpoint, secret_file, collective_timeout_s=5)
    try:
        core = LLMEngine(config, executor)
        assert greedy_tokens(core, PROMPTS[:1], 2)
        for pid in node.rank_pids():
            os.kill(pid, signal.SIGSTOP)
        core.add_request(EngineRequest("stuck", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0)))
        with pytest.raises(TensorParallelError, match=r"no output within 5 s \(collective timeout\) from the last "
                                                      r"stage \(rank 1 on node 1\)"):
            for _ in range(100):
                core.step()
    finally:
        executor.close()
        node.kill()


def test_tensor_x_pipeline_parallel_across_two_nodes_gives_transformers_tokens(engine, checkpoint, secret_file,
                                                                              reference):
    """TP 2 x PP 2: two ranks a node (node 0 spawns rank 1 beside itself, node 1's agent spawns ranks 2
    and 3, local ranks 0 and 1), each stage's all-reduces inside a node, the stage hand-off across."""
    engine[1].close()  # one group per process
    config, executor, node = two_nodes(checkpoint, secret_file, tensor_parallel_size=2)
    try:
        assert [w.rank for w in executor.workers] == [1, 2, 3]
        assert [_node(w) for w in executor.workers] == [None, 1, 1]
        assert greedy_tokens(LLMEngine(config, executor), PROMPTS, NEW_TOKENS) == reference
        assert len(node.rank_pids()) == 2
    finally:
        executor.close()
        node.kill()


def _node(worker):
    return getattr(worker.process, "node", None)


def test_layouts_that_cannot_span_the_nodes_are_refused(checkpoint):
    with pytest.raises(ValueError, match=r"parallel.nnodes 3: the 2 ranks .* must spread evenly over the nodes"):
        config_for(checkpoint, pipeline_parallel_size=2, nnodes=3)
    with pytest.raises(ValueError, match=r"parallel.master_addr '0.0.0.0': name node 0's own address"):
        config_for(checkpoint, pipeline_parallel_size=2, nnodes=2, master_addr="0.0.0.0")
    with pytest.raises(ValueError, match=r"parallel.nnodes 2 with kv_role 'consumer': not supported yet"):
        check_supported(config_for(checkpoint, tensor_parallel_size=2, nnodes=2, kv_role="consumer"))
