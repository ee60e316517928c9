"""The floor for bench/gateway_overhead.py: a fixed OpenAI-shaped answer with no gateway logic.

/v1/completions answers NUM_CHUNKS words; /v1/chat/completions (bench/upstream_overhead.py's
tools case) one tool call whose arguments come in NUM_CHUNKS fragments (the first with the id
and name), as a server with a tool parser streams them.

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
BODY = {
    "id": "cmpl-bare", "object": "text_completion", "created": 0, "model": "echo",
    "choices": [{"index": 0, "text": " word" * NUM_CHUNKS, "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 36, "completion_tokens": NUM_CHUNKS, "total_tokens": 36 + NUM_CHUNKS},
}
CHUNK = b"data: " + json.dumps({**BODY, "choices": [{"index": 0, "text": " word", "logprobs": None,
                                                      "finish_reason": None}]}).encode() + b"\n\n"


async def completions(request):
    body = await request.json()
    if body.get("stream"):
        async def chunks():
            for _ in range(NUM_CHUNKS):
                yield CHUNK
            yield b"data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")
    return JSONResponse(BODY)


ARGUMENTS = ['{"city": "', *(["Paris"] * (NUM_CHUNKS - 2)), '"}']
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "".join(ARGUMENTS)}}
USAGE = {"prompt_tokens": 36, "completion_tokens": NUM_CHUNKS, "total_tokens": 36 + NUM_CHUNKS}
CHAT_BODY = {"id": "chatcmpl-bare", "object": "chat.completion", "created": 0, "model": "echo", "usage": USAGE,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          "logprobs": None, "finish_reason": "tool_calls"}]}


def _chat_chunk(delta: dict, finish=None, usage=None) -> bytes:
    body = {"id": "chatcmpl-bare", "object": "chat.completion.chunk", "created": 0, "model": "echo",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


CHAT_CHUNKS = [_chat_chunk({"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                            "function": {"name": "get_weather", "arguments": ARGUMENTS[0]}}]})]
CHAT_CHUNKS += [_chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}) for a in ARGUMENTS[1:]]
CHAT_CHUNKS += [_chat_chunk({}, "tool_calls", USAGE), b"data: [DONE]\n\n"]


async def chat(request):
    body = await request.json()
    if body.get("stream"):
        async def chunks():
            for chunk in CHAT_CHUNKS:
                yield chunk
        return StreamingResponse(chunks(), media_type="text/event-stream")
    return JSONResponse(CHAT_BODY)


async def ready(request):
    return Response("ok")


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health/ready", ready)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info",
                access_log=False)
