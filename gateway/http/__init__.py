"""HTTP around the endpoints, as pure-ASGI pieces: body limits, error rendering (Anthropic's
shape on its paths), disconnect-aware streaming, the hot routes past Starlette's stack, slow
clients, the auth middleware and the status page's sign-in.

May import the seam, keys/, translate/ (an error's Anthropic shape) and gateway.state.
"""
