"""The endpoints: each turns an HTTP request into work for the layers below and its answer.

`generate` (completions, chat completions, the Responses and Messages APIs, model listing and the
intake they share: body, key, pool, SLA class), `tokens` (tokenize, detokenize, count tokens,
embeddings), `ops` (health, readiness, version, metrics, admin actions), `openapi` and `status`
(the live status page); `routes`, the table where each endpoint is declared once. May import
every package below it; nothing imports it but gateway.app.
"""
