"""Budgets per key and team through the real openai client against the echo backend: a budget
refuses with 429 quota_exceeded once its window has no room, spend equals the usage the client
was shown, cut streams are charged what they streamed, and a key reads only its own budgets."""

import calendar
import datetime as dt
import json
import time

import httpx
import openai
import pytest

from gateway.config import ConfigError, parse_config
from tests.support.servers.loopback import GatewayServer

ALICE, ALEX, BOB, CAROL = "sk-alice-0123456789", "sk-alex-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"

CONFIG = f"""
auth:
  keys:
    - {{name: alice, key: {ALICE}, team: ml}}
    - {{name: alex, key: {ALEX}, team: ml}}
    - {{name: bob, key: {BOB}}}
    - {{name: carol, key: {CAROL}}}
budgets:
  usage_log: {{usage_log}}
  prices:
    echo: {{input_per_million: 100, output_per_million: 1000}}
  limits:
    - {{name: ml-daily, team: ml, limit: 20, window: day}}
    - {{name: bob-money, key: bob, models: [echo], unit: money, limit: 0.1, window: month, soft_limit: 0.5}}
    - {{name: carol-shadow, key: carol, limit: 10, window: day, shadow: true}}
    - {{name: carol-slow, key: carol, models: [slow], limit: 1000, window: rolling, period_s: 3600}}
models:
  - name: echo
    deployments: [{{name: echo-0, backend: echo}}]
  - name: slow
    deployments: [{{name: slow-0, backend: echo, settings: {{tokens_per_second: 20}}}}]
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    log = tmp_path_factory.mktemp("budgets") / "usage.jsonl"
    with GatewayServer(CONFIG.replace("{usage_log}", str(log))) as server:
        server.usage_log = log
        yield server


def client(gw, key):
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)


def info(gw, key) -> dict:
    r = httpx.get(gw.base_url + "/key/info", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200
    return r.json()


def budget(gw, key, name, settled=True) -> dict:
    """The key's view of one budget; with `settled`, once nothing is held (settles run after the answer)."""
    deadline = time.monotonic() + 10
    while True:
        found = next(b for b in info(gw, key)["budgets"] if b["name"] == name)
        if not settled or found["reserved"] == 0 or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def seconds_to_utc_midnight() -> float:
    now = dt.datetime.now(dt.timezone.utc)
    tomorrow = (now + dt.timedelta(days=1)).date()
    return calendar.timegm(tomorrow.timetuple()) - now.timestamp()


def test_a_team_budget_counts_every_key_of_the_team_and_refuses_past_its_limit(gw):
    # echo answers a prompt of 3 words with max_tokens 4 words: 7 tokens, the client is told
    seen = []
    for key in (ALICE, ALEX):
        r = client(gw, key).completions.create(model="echo", prompt="a b c", max_tokens=4)
        seen.append(r.usage.total_tokens)
    assert budget(gw, ALICE, "ml-daily")["spend"] == sum(seen) == budget(gw, ALEX, "ml-daily")["spend"]
    # 14 spent; the next one may cost its bound (the prompt's 5 bytes + 4) = 9 > 6 left
    with pytest.raises(openai.RateLimitError) as refused:
        client(gw, ALICE).completions.create(model="echo", prompt="a b c", max_tokens=4)
    err = refused.value.body
    assert err["code"] == "quota_exceeded" and err["type"] == "insufficient_quota"
    assert "ml-daily" in err["message"] and "team=ml" in err["message"]
    retry_after = int(refused.value.response.headers["retry-after"])
    assert abs(retry_after - seconds_to_utc_midnight()) < 5  # until the day window resets
    # a smaller request still fits: a bound of 1 + 1 tokens
    r = client(gw, ALEX).completions.create(model="echo", prompt="a", max_tokens=1)
    assert budget(gw, ALEX, "ml-daily")["spend"] == sum(seen) + r.usage.total_tokens


def test_money_from_the_price_table_and_the_soft_limit_warning(gw):
    r = client(gw, BOB).chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "one two three four five"}], max_tokens=3)
    usage = r.parse().usage
    cost = (usage.prompt_tokens * 100 + usage.completion_tokens * 1000) / 1e6  # the config's prices
    assert budget(gw, BOB, "bob-money")["spend"] == pytest.approx(cost)
    assert "x-kvgate-budget-warning" not in r.headers  # its bound stayed under half of 0.1
    # bound: ~100 bytes of messages' JSON + template overhead at 100/M, + 60 x 1000/M: past the 0.05 soft limit
    r = client(gw, BOB).chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "x"}], max_tokens=60)
    assert r.headers["x-kvgate-budget-warning"].startswith("bob-money=")


def test_shadow_budgets_count_past_the_limit_without_refusing(gw):
    total = 0
    for _ in range(3):
        r = client(gw, CAROL).completions.with_raw_response.create(
            model="echo", prompt="a b c", max_tokens=4)
        total += r.parse().usage.total_tokens
    assert total > 10
    assert budget(gw, CAROL, "carol-shadow")["spend"] == total
    assert r.headers["x-kvgate-budget-warning"] == f"carol-shadow={int(100 * (total - 7 + 9) / 10)}%"


def test_a_cut_stream_is_charged_what_it_streamed_and_the_rest_is_refunded(gw):
    # slow streams 20 words/s; the client leaves after 3 content chunks of max_tokens 200
    before = budget(gw, CAROL, "carol-slow")["spend"]
    stream = client(gw, CAROL).completions.create(model="slow", prompt="w " * 50, max_tokens=200, stream=True)
    got = 0
    for chunk in stream:
        got += sum(1 for c in chunk.choices if c.text)
        if got == 3:
            break
    stream.close()
    after = budget(gw, CAROL, "carol-slow")
    charged = after["spend"] - before
    assert after["reserved"] == 0
    # the streamed tokens (at least the 3 the client read, at most a few more in flight) plus the
    # prompt bound the backend never confirmed (100 bytes): far under the 300 reserved
    assert 100 + 3 <= charged <= 100 + 10


def test_a_key_reads_its_own_budgets_only(gw):
    mine = info(gw, BOB)
    assert mine["key"] == "bob" and mine["team"] is None
    assert {b["name"] for b in mine["budgets"]} == {"bob-money"}
    assert {b["name"] for b in info(gw, CAROL)["budgets"]} == {"carol-shadow", "carol-slow"}
    assert {b["name"] for b in info(gw, ALICE)["budgets"]} == {"ml-daily"}
    assert httpx.get(gw.base_url + "/key/info", timeout=10).status_code == 401
    day = budget(gw, ALICE, "ml-daily", settled=False)
    assert day["resets_at"] - time.time() == pytest.approx(seconds_to_utc_midnight(), abs=5)


def test_metrics_and_the_usage_log(gw):
    client(gw, ALICE).completions.create(model="echo", prompt="a", max_tokens=1)
    budget(gw, ALICE, "ml-daily")
    text = gw.state.metrics.exposition().decode()
    assert 'kvgate_budget_spend{budget="ml-daily",subject="team=ml"}' in text
    assert 'kvgate_budget_refused_total{budget="ml-daily"}' in text
    view = gw.state.budgets.overview()  # the status page's (operator) view
    row = next(r for r in view["budgets"] if r["budget"] == "ml-daily")
    assert row["subject"] == "team=ml" and row["spend"] == budget(gw, ALICE, "ml-daily")["spend"]
    records = [json.loads(line) for line in gw.usage_log.read_text().splitlines()]
    last = [r for r in records if r["key"] == "alice"][-1]
    assert last["team"] == "ml" and last["model"] == "echo" and last["input_tokens"] == 1
    assert last["output_tokens"] == 1 and last["budgets"] == {"ml-daily": 2}


@pytest.mark.parametrize("budgets, message", [
    ("{limits: [{name: a, limit: 1}]}", "give exactly one of key and team"),
    ("{limits: [{name: a, key: k, limit: 1, window: rolling}]}", "period_s"),
    ("{limits: [{name: a, key: k, limit: 1, unit: money}]}", "unit money needs budgets.prices.echo"),
    ("{limits: [{name: a, key: k, limit: 1, models: [nope]}]}", "'nope' is not a model"),
    ("{limits: [{name: a, key: k, limit: 1, reset_at: '25:00'}]}", "reset_at"),
])
def test_bad_budgets_are_config_errors(budgets, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(f"budgets: {budgets}\nmodels: [{{name: echo, deployments: [{{name: e, backend: echo}}]}}]\n")
