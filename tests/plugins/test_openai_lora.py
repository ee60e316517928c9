"""vLLM upstreams' LoRA adapters as models of their pool (issue 43 item 6): with `lora_adapters`,
the openai plugin reads each upstream's /v1/models (vLLM lists an adapter with `parent` and
`root`, vllm/entrypoints/openai/serving_models.py) and its vllm:lora_requests_info (the newest
series: vllm/v1/metrics/loggers.py sets it to the current time); the gateway lists the adapter
under the pool, sends its requests only to the upstream that lists it, with the adapter as the
upstream's `model`, and lora_affinity reads the upstream's slots."""

from __future__ import annotations

import time

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from kvgate_openai.metrics import lora_info
from tests.support.servers.loopback import AppServer, GatewayServer

# vLLM's page: an older series (before sql ran) and the newest one
METRICS = """vllm:num_requests_running{model_name="base"} 1.0
vllm:num_requests_waiting{model_name="base"} 0.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="chat"} 1.8e9
"""


class FakeVLLM:
    """/v1/models, /metrics and /v1/completions in vLLM's shapes; it says which model it was asked."""

    def __init__(self, adapters: dict[str, str]):
        self.adapters, self.asked = adapters, []
        self.server = AppServer(Starlette(routes=[Route("/v1/models", self.models), Route("/metrics", self.metrics),
                                                  Route("/v1/completions", self.complete, methods=["POST"])]))

    async def models(self, request: Request):
        cards = [{"id": "base", "object": "model", "root": "/models/base", "parent": None, "max_model_len": 2048}]
        cards += [{"id": n, "object": "model", "root": root, "parent": "base", "max_model_len": None}
                  for n, root in self.adapters.items()]
        return JSONResponse({"object": "list", "data": cards})

    async def metrics(self, request: Request):
        return PlainTextResponse(METRICS if self.adapters else METRICS.split("vllm:lora")[0])

    async def complete(self, request: Request):
        model = (await request.json())["model"]
        self.asked.append(model)
        return JSONResponse({"id": "c", "object": "text_completion", "created": 0, "model": model,
                             "choices": [{"index": 0, "text": f"from {model}", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})


def test_the_newest_lora_requests_info_series_is_read():
    info = lora_info(METRICS)
    assert (info.max_loras, info.running, info.waiting) == (2, ("sql",), ("chat",))
    assert lora_info('vllm:num_requests_running{model_name="base"} 1.0\n') is None


def test_an_upstreams_adapters_are_models_of_its_pool_served_only_there():
    with_sql, without = FakeVLLM({"sql": "/adapters/sql"}), FakeVLLM({})
    deployments = "".join(f"""
      - name: {name}
        backend: openai
        upstream_model: base
        settings: {{base_url: "{up.server.base_url}/v1", server: vllm, lora_adapters: true, metrics_poll_s: 0.1}}"""
                          for name, up in (("a", with_sql), ("b", without)))
    config = f"""
models:
  - name: m
    policy: lora_affinity
    deployments:{deployments}
"""
    try:
        with GatewayServer(config) as gw:
            deadline = time.monotonic() + 30
            while "sql" not in gw.state.registry.pools[0].adapters():
                assert time.monotonic() < deadline, "the upstream's adapters were never read"
                time.sleep(0.05)
            cards = {m["id"]: m for m in httpx.get(gw.base_url + "/v1/models").json()["data"]}
            assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("m", "/adapters/sql")
            for _ in range(4):
                r = httpx.post(gw.base_url + "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
                assert (r.status_code, r.json()["model"], r.json()["choices"][0]["text"]) == (200, "sql", "from sql")
            assert (with_sql.asked, without.asked) == (["sql"] * 4, [])
            a, b = gw.state.registry.pools[0].deployments
            lora = a.backend.load().lora
            assert (lora.max_loras, lora.running, lora.waiting) == (2, ("sql",), ("chat",))
            assert b.backend.load().lora.adapters == {}
            r = httpx.post(gw.base_url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from base"
    finally:
        with_sql.server.close()
        without.server.close()
