"""A vLLM engine started with a KV connector, as its OpenAI server answers the P/D flow (the
facts: ../shared/WIRE_FORMATS.md section 2). Shared by the gateway's P/D tests
(tests/plugins/test_openai_disagg.py) and the chart's (tests/charts/test_helm.py)."""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse

from tests.support.fakes.scripted_upstream import ScriptedUpstream


# The prefill hop's kv_transfer_params exactly as vLLM's own proxy sends them, written out from
# vLLM's source (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py,
# send_request_to_service, vllm-project/vllm e009930), not from the gateway's constant: the same
# function sets stream False and max_tokens 1 and deletes stream_options.
VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class VllmPDEngine(ScriptedUpstream):
    """One vLLM engine started with `--kv-transfer-config '{"kv_connector":"NixlConnector",
    "kv_role":"kv_both"}'`, as its OpenAI server answers (tests/support/fakes/scripted_upstream.py's echo for
    the text):

    - a request whose `kv_transfer_params` has `do_remote_decode` is a prefill: it answers as
      asked (one token, for the gateway's max_tokens 1) and returns `kv_transfer_params` (this
      engine's id, the block ids, its host and port, the request id from `x-request-id`) only
      when the answer stopped on length; it then holds the prompt's blocks for a remote decode;
    - one whose params have `do_remote_prefill` loads the prompt's KV from the named engine when
      that engine holds the named request's blocks for this very prompt (`loaded`); else (forged,
      stale, another prompt's) it computes the prompt itself (`recomputed`), never another's KV;
    - without params it computes the prompt (`computed`).
    `fail` answers that many next requests with a 500 before any output."""

    def __init__(self, engine_id: str, cluster: dict):
        super().__init__()
        self.engine_id, self.cluster = engine_id, cluster
        cluster[engine_id] = self
        self.reset()

    def reset(self) -> None:
        self.seen.clear()
        self.held: dict[str, str] = {}  # remote_request_id -> the prompt whose blocks it keeps
        self.loaded: list[tuple[str, str]] = []  # (engine id, request id) of KV read from elsewhere
        self.recomputed = 0
        self.computed = 0
        self.fail = 0
        self.refuse = False  # answer 400 (the prompt is over the context), as vLLM does
        self.prefill_delay_s = 0.0
        self.forged_host: str | None = None  # name this host as remote_host (a hostile or misconfigured engine)
        self.request_ids: list[str | None] = []  # x-request-id of every request

    async def chat(self, request):
        return await self._serve(request, super().chat)

    async def completions(self, request):
        return await self._serve(request, super().completions)

    async def _serve(self, request, answer):
        body = await request.json()
        self.request_ids.append(request.headers.get("x-request-id"))
        if self.fail:
            self.fail -= 1
            self.seen.append((request.url.path, body))
            return JSONResponse({"error": {"message": "engine fault", "type": "InternalServerError"}}, status_code=500)
        if self.refuse:
            self.seen.append((request.url.path, body))
            return JSONResponse({"object": "error", "message": "This model's maximum context length is 2048 tokens.",
                                 "type": "BadRequestError", "param": None, "code": 400}, status_code=400)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return await self._prefill(request, body)
        if params.get("do_remote_prefill"):
            self._load(params, body)
        else:
            self.computed += 1
        return await answer(request)

    async def _prefill(self, request, body: dict):
        self.seen.append((request.url.path, body))
        await asyncio.sleep(self.prefill_delay_s)
        chat = "messages" in body
        words = ((self.answer(body).content or "") if chat else str(body["prompt"])).split()
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or len(words)
        stopped_on_length = len(words) > limit
        text = " ".join(words[:limit])
        choice = {"index": 0, "finish_reason": "length" if stopped_on_length else "stop",
                  **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
        answer = {"id": "p", "object": "chat.completion" if chat else "text_completion", "model": self.model,
                  "choices": [choice], "usage": {"prompt_tokens": len(prompt_of(body).split()),
                                                 "completion_tokens": min(limit, len(words))}}
        if stopped_on_length:  # NixlConnector.request_finished: params only for FINISHED_LENGTH_CAPPED
            request_id = request.headers.get("x-request-id")
            self.held[request_id] = prompt_of(body)
            host, port = self.base_url.removeprefix("http://").split(":")
            host = self.forged_host or host
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
                "remote_engine_id": self.engine_id, "remote_request_id": request_id, "remote_host": host,
                "remote_port": int(port), "tp_size": 1}
        return JSONResponse(answer)

    def _load(self, params: dict, body: dict) -> None:
        source = self.cluster.get(params.get("remote_engine_id"))
        request_id = params.get("remote_request_id")
        if source is not None and source.held.get(request_id) == prompt_of(body):
            del source.held[request_id]  # read once: the prefill frees its blocks
            self.loaded.append((source.engine_id, request_id))
        else:
            self.recomputed += 1


def prompt_of(body: dict) -> str:
    if "messages" not in body:
        return str(body["prompt"])
    return "\n".join(str(m.get("content")) for m in body["messages"])
