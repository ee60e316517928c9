"""kvgate's gateway: the OpenAI HTTP API, config, plugins and routing. Never imports torch.

At this root stands the plugin-facing seam, what a backend or policy plugin imports: `backend`
(the Backend protocol and the data crossing it), `policy` (the RoutingPolicy protocol),
`capabilities`, `errors`, `hookspecs`, `plugins`, `config`, and the helpers plugins share with
the gateway (`fastjson`, `idle`). Beside it, on top: `state` (the typed shared state), `app` (the
ASGI app) and `cli`. Everything else lives in a package by concern; tests/gateway/test_layering.py
holds the table of which may import which, and docs/design/architecture.md draws it.
"""

__version__ = "0.1.0"
