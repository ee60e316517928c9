"""The floor of a Python gateway on this machine: a relay with no gateway logic at all.

It forwards each POST's body to the upstream and the upstream's answer back, bytes in and bytes
out (one ASGI send per upstream read), over kvgate's own HTTP/1.1 client (kvgate_openai/h1.py)
under uvicorn, as `kvgate serve` runs: no parsing, validation, routing, admission, metrics or
tracing. What it adds over `direct` is what the extra hop itself costs here (two more hand-offs
between processes per request, on shared cores); what kvgate adds beyond it is its own work.

    python bench/bare_relay.py PORT UPSTREAM_BASE_URL      (e.g. http://127.0.0.1:8001)

PORT 0 binds a free port; uvicorn's "Uvicorn running on" line says which (no access log).
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "openai"))
from kvgate_openai.h1 import H1Client  # noqa: E402


def relay(upstream: str):
    client: list[H1Client] = []  # made on the server's loop, at the first request

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()  # startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            if client:
                await client[0].aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health/ready":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if not client:
            client.append(H1Client(256, 30.0, connect_s=5.0, headers={"content-type": "application/json"}))
        response = await client[0].send("POST", upstream + scope["path"], body, {})
        try:
            content_type = response.headers.get("content-type", "application/json").encode()
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(b"content-type", content_type)]})
            async for part in response.aiter_bytes():
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    return app


if __name__ == "__main__":
    uvicorn.run(relay(sys.argv[2].rstrip("/")), host="127.0.0.1", port=int(sys.argv[1]), log_level="info",
                access_log=False)
