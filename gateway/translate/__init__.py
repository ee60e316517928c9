"""Other APIs served by translation onto chat completions: OpenAI's Responses API
(`responses_api`) and Anthropic's Messages API (`anthropic`).

Each module is data in, data out, with no HTTP in it: its request is validated (a 400 naming the
path in that API's own terms), then becomes an OpenAI chat request body that
`gateway.protocol.completions.parse_chat` checks against the server's limits like any chat request; the chat
answer (a whole chat.completion body, or its stream chunks one by one) becomes that API's
answer. The endpoints (`gateway.api.generate`) run the result through the same admission, routing,
key limits, traces and metrics as /v1/chat/completions. A Responses request goes as it came to
a deployment that serves that API itself (`ResponsesTranslation.routed`), and its answer comes
back as it came (`TokenEvent.raw`).
"""
