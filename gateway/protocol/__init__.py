"""The OpenAI wire format: request models and their validation (`completions`, `tokens`,
`tools`), strict JSON bodies (`json_body`), response bodies and stream chunks (`bodies`).

Data in, data out: no HTTP, no routing. May import the seam only.
"""
