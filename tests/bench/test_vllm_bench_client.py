"""`vllm bench serve` against kvgate: vLLM's own request functions (vllm.benchmarks.lib.
endpoint_request_func, what `vllm bench serve --backend vllm|openai-chat|openai-responses` sends
and how it reads the stream) run against a gateway serving the echo backend, from the vLLM venv of
bench/vllm_server.sh (pure Python: no vLLM server starts). Each must succeed and read the echo's
words and token count back as vLLM's benchmark would record them. Slow tier: it needs that venv
(a skip, or a failure under KVGATE_REQUIRE_VLLM, which .ci/run sets)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.servers.loopback import GatewayServer
from tests.support.servers.vllm import SCRIPT, require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = """
models:
  - name: echo
    deployments:
      - {name: echo-0, backend: echo}
"""

CLIENT = """
import asyncio, json, sys
import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput

async def main(base):
    out = {}
    async with aiohttp.ClientSession() as session:
        for backend, path in (("vllm", "/v1/completions"), ("openai-chat", "/v1/chat/completions"),
                              ("openai-responses", "/v1/responses")):
            asked = RequestFuncInput(prompt="alpha beta gamma delta", api_url=base + path, prompt_len=4,
                                     output_len=3, model="echo")
            got = await ASYNC_REQUEST_FUNCS[backend](asked, session)
            out[backend] = {"success": got.success, "error": got.error, "text": got.generated_text,
                            "output_tokens": got.output_tokens, "itl": len(got.itl), "ttft": got.ttft}
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""


def test_vllm_bench_serve_request_functions_read_kvgates_streams():
    require_vllm()
    python = subprocess.run(["bash", str(SCRIPT), "python"], capture_output=True, text=True).stdout.strip()
    with GatewayServer(CONFIG) as gw:
        proc = subprocess.run([python, "-c", CLIENT, gw.base_url], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for backend, got in results.items():
        assert got["success"], (backend, got["error"])
        assert got["text"].split() == ["alpha", "beta", "gamma"], (backend, got)  # the echo's first 3 words
        assert got["output_tokens"] == 3 and got["ttft"] > 0, (backend, got)  # from the stream's usage chunk
        # chunks after the first: 2 gaps between 3 tokens, and for chat one more, as vLLM's own chat
        # stream opens with a role-only chunk that its client counts as the first token
        assert got["itl"] == (3 if backend == "openai-chat" else 2), (backend, got)
