"""The OpenAI API through the real `openai` client against a real gateway on loopback."""

import httpx
import pytest

from kvgate_echo import reply_pieces
from tests.support.servers.loopback import GatewayServer

CONFIG = """
models:
  - name: echo
    aliases: [echo-alias]
    deployments:
      - name: echo-0
        backend: echo
"""

PROMPT = "the quick brown fox jumps"


def expected(prompt: str, max_tokens: int, seed: int = 0, stop=()) -> str:
    pieces, _ = reply_pieces(prompt.split(), seed, max_tokens, stop)
    return "".join(p for _, p in pieces)


@pytest.fixture(scope="module")
def gw():
    with GatewayServer(CONFIG) as server:
        yield server


@pytest.fixture(scope="module")
def client(gw):
    return gw.openai()


def test_models_lists_each_model_once(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["echo"]
    assert models.data[0].object == "model"


def test_completion_returns_text_and_usage(client):
    out = client.completions.create(model="echo", prompt=PROMPT, max_tokens=7, seed=2)
    assert out.object == "text_completion"
    assert out.choices[0].text == expected(PROMPT, 7, seed=2)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 7, 12)


def test_completion_default_max_tokens_is_16(client):
    out = client.completions.create(model="echo", prompt=PROMPT)
    assert out.usage.completion_tokens == 16


def test_alias_routes_to_the_model(client):
    out = client.completions.create(model="echo-alias", prompt=PROMPT, max_tokens=2)
    assert out.model == "echo"
    assert out.choices[0].text == expected(PROMPT, 2)


def test_completion_stream_concatenates_to_the_same_text(client):
    chunks = list(
        client.completions.create(
            model="echo", prompt=PROMPT, max_tokens=9, seed=3, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(PROMPT, 9, seed=3)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_chat_completion(client):
    out = client.chat.completions.create(
        model="echo",
        messages=[{"role": "system", "content": "ignored words"}, {"role": "user", "content": PROMPT}],
        max_completion_tokens=4,
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected(PROMPT, 4)
    assert out.usage.completion_tokens == 4


def test_chat_stream_opens_with_role_and_ends_with_finish_reason(client):
    chunks = list(
        client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": PROMPT}], max_tokens=5, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected(PROMPT, 5)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_raw_stream_ends_with_done(gw):
    body = {"model": "echo", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", gw.base_url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 3


def test_stop_string_is_never_emitted(client):
    full = expected(PROMPT, 8)
    out = client.completions.create(model="echo", prompt=PROMPT, max_tokens=8, stop=["own f"])
    assert out.choices[0].text == full[: full.index("own f")]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model="echo", prompt=PROMPT, max_tokens=8, stop=["own f"], stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index("own f")]


def test_n_choices_with_seed_differ_and_are_reproducible(client):
    kw = dict(model="echo", messages=[{"role": "user", "content": PROMPT}], max_tokens=3, n=3, seed=10)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [expected(PROMPT, 3, seed=10 + i) for i in range(3)]
    assert texts == [c.message.content for c in again.choices]
    assert first.usage.prompt_tokens == 5  # counted once per prompt, not per choice
    assert first.usage.completion_tokens == 9


def test_n_choices_stream_interleaves_every_index(client):
    chunks = list(
        client.completions.create(model="echo", prompt=PROMPT, max_tokens=4, n=2, seed=0, stream=True)
    )
    by_index = {0: "", 1: ""}
    for c in chunks:
        by_index[c.choices[0].index] += c.choices[0].text
    assert by_index == {0: expected(PROMPT, 4, 0), 1: expected(PROMPT, 4, 1)}


def test_batch_of_prompts_gives_one_choice_each(client):
    out = client.completions.create(model="echo", prompt=["a b c", "x y"], max_tokens=2)
    assert [c.text for c in out.choices] == [expected("a b c", 2), expected("x y", 2)]
    assert out.usage.prompt_tokens == 5


def test_token_id_prompt(client):
    out = client.completions.create(model="echo", prompt=[11, 22, 33], max_tokens=2)
    assert out.choices[0].text == "t11 t22"


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": PROMPT}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert [lp.token for lp in content] == PROMPT.split()[:3]
    assert all(lp.logprob == -0.125 for lp in content)


def test_completion_logprobs(client):
    out = client.completions.create(model="echo", prompt=PROMPT, max_tokens=2, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["the", "quick"]
    assert lp.text_offset == [0, 3]


def test_user_and_ignored_parameters_are_accepted(client):
    out = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
        user="alice", metadata={"k": "v"}, store=False,
    )
    assert out.choices[0].message.content == "the"


def test_content_parts_are_joined(client):
    out = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": [{"type": "text", "text": "alpha beta"}]}],
        max_tokens=2,
    )
    assert out.choices[0].message.content == "alpha beta"


def test_health_endpoints(gw):
    assert httpx.get(gw.base_url + "/health/live").json() == {"status": "alive"}
    ready = httpx.get(gw.base_url + "/health/ready")
    assert ready.status_code == 200
    assert ready.json()["deployments"] == {"echo-0": "ready"}
