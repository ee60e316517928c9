"""/v1/embeddings from the native engine behind a real gateway, through the real openai client.

The vectors are checked against transformers (`AutoModel`'s final-norm hidden states of the same
token ids, last-token pooled and L2-normalised; tolerance as in
tests/native_backend/test_pooling.py), in float and base64, and while a streamed chat
completion runs on the same engine, which must finish token for token as it does alone.
"""

import base64
import struct
import threading

import httpx
import pydoc_data.topics
import pytest

from tests.support.checks.hf_reference import base_model, hidden_states, max_diff, pooled
from tests.support.servers.loopback import native_gateway_fixtures

pytestmark = pytest.mark.timeout(900)

TOLERANCE = 1e-5
CONFIG = """
models:
  - name: smollm2
    timeouts: {first_token_s: 300}  # a loaded CI machine: prefill is slow, not stuck
    deployments:
      - name: native-0
        backend: native
        settings:
          max_num_seqs: 8
          max_num_batched_tokens: 128
          kv_cache_bytes: 268435456
          num_threads: 2
          embeddings: {pooling: last}
"""
TEXTS = ["The capital of France is Paris.", "Paged attention keeps the KV cache in blocks.",
         " ".join(list(pydoc_data.topics.topics.values())[:2])[:1200]]  # 128-token chunks


gw, client = native_gateway_fixtures(CONFIG, client_timeout=300)


@pytest.fixture(scope="module")
def hf_model():
    return base_model()


def token_ids(gw, text: str) -> list[int]:
    return httpx.post(gw.base_url + "/tokenize", json={"model": "smollm2", "prompt": text}).json()["tokens"]


def post(gw, body: dict) -> httpx.Response:
    return httpx.post(gw.base_url + "/v1/embeddings", json=body, timeout=300)


def test_models_card_says_the_model_embeds(gw):
    card = httpx.get(gw.base_url + "/v1/models").json()["data"][0]
    assert "embeddings" in card["capabilities"]["endpoints"]


def test_float_and_base64_vectors_match_transformers(gw, client, hf_model):
    floats = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    b64 = client.embeddings.create(model="smollm2", input=TEXTS)  # the client's default: base64, decoded
    ids = [token_ids(gw, text) for text in TEXTS]
    assert floats.usage.prompt_tokens == b64.usage.prompt_tokens == sum(map(len, ids))
    assert floats.model == "smollm2" and [d.index for d in floats.data] == [0, 1, 2]
    for row, row64, tokens in zip(floats.data, b64.data, ids):
        assert len(row.embedding) == hf_model.config.hidden_size
        assert max_diff(row.embedding, row64.embedding) == 0.0  # the same float32 values either way
        assert max_diff(row.embedding, pooled(hidden_states(hf_model, tokens), "last")) < TOLERANCE
    raw = post(gw, {"model": "smollm2", "input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{hf_model.config.hidden_size}f", base64.b64decode(raw))
    assert max_diff(decoded, floats.data[0].embedding) < TOLERANCE  # alone, not in a batch of three


def test_token_arrays_embed_as_their_text_does(gw, client):
    ids = [token_ids(gw, text) for text in TEXTS[:2]]
    by_ids = client.embeddings.create(model="smollm2", input=ids, encoding_format="float")
    by_text = client.embeddings.create(model="smollm2", input=TEXTS[:2], encoding_format="float")
    one = client.embeddings.create(model="smollm2", input=ids[0], encoding_format="float")  # one token array
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[0])
    for a, b in zip(by_ids.data, by_text.data):
        assert max_diff(a.embedding, b.embedding) < TOLERANCE
    assert max_diff(one.data[0].embedding, by_text.data[0].embedding) < TOLERANCE


def test_embeddings_while_a_streamed_chat_runs_leave_it_unchanged(gw, client):
    """Three embedding calls while a streamed chat is mid-generation: each vector as computed
    alone, and the chat's text as generated alone. The chat cannot end before the calls do (it
    asks for far more tokens than it reads: the reader closes it once it has the text to compare),
    so it is in flight throughout whatever the machine's speed; one ordered log of what happened
    (no clock) shows it."""
    chat = dict(model="smollm2", messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
                temperature=0, extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(**chat, max_tokens=32).choices[0].message.content
    embedded_alone = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    log, pieces, finish = [], [], []  # log: "chunk" / "embeddings start" / "embeddings end", in order
    chunks_arrived, embeddings_done = threading.Event(), threading.Event()

    def read_stream():
        stream = client.chat.completions.create(**chat, max_tokens=4000, stream=True)
        with stream:
            for chunk in stream:
                log.append("chunk")
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish.append(chunk.choices[0].finish_reason)
                if len(log) >= 5:
                    chunks_arrived.set()
                if embeddings_done.is_set() and len("".join(pieces)) >= len(alone):
                    break  # closing the stream aborts the rest of the request

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert chunks_arrived.wait(300), "the stream did not start"
    log.append("embeddings start")
    embedded = [client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float") for _ in range(3)]
    log.append("embeddings end")
    embeddings_done.set()
    reader.join(timeout=600)
    assert not reader.is_alive(), f"the stream had {len(''.join(pieces))} of {len(alone)} characters"
    start, end = log.index("embeddings start"), log.index("embeddings end")
    assert "chunk" in log[:start] and "chunk" in log[end:], "the stream was not in flight throughout"
    assert not any(finish), finish  # still generating when it was closed
    assert "".join(pieces).startswith(alone)
    for out in embedded:
        for row, row_alone in zip(out.data, embedded_alone.data):
            assert max_diff(row.embedding, row_alone.embedding) < TOLERANCE


@pytest.mark.parametrize("body, param, code", [
    ({"input": "hello", "dimensions": 8}, "dimensions", "unsupported_parameter"),
    ({"input": [[1, 2, 3], [4, 10**7]]}, "input[1]", None),
    ({"input": ["fine", "word " * 9000]}, "input[1]", "context_length_exceeded"),
])
def test_bad_input_is_400_naming_the_path_and_the_engine_serves_on(gw, client, body, param, code):
    response = post(gw, {"model": "smollm2", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code)
    deployment = next(d for d in gw.state.registry.deployments() if d.name == "native-0")
    assert deployment.breaker.consecutive_failures == 0  # the client's mistake, not the engine's
    assert len(client.embeddings.create(model="smollm2", input="still here").data) == 1
    assert gw.backend("native-0").client.in_flight == 0  # the failed input's siblings are gone too
