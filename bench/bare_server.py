"""The floor for bench/gateway_overhead.py: a fixed OpenAI-shaped answer with no gateway logic.

    python bench/bare_server.py PORT NUM_CHUNKS
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


async def ready(request):
    return Response("ok")


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health/ready", ready)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
