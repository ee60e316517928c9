"""GET /openapi.json: the HTTP API as OpenAPI 3.1, generated from the request models.

The request bodies are the pydantic models the gateway validates with (`protocol/completions.py`), with the
server's own limits (max_tokens, n, stop, ...), the names of the models it serves and what its
deployments declare (tools, response_format kinds, vendor fields: `served`) filled in, so a
client generator or a fuzzer (schemathesis) sees exactly what this gateway accepts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.capabilities import ANY_EXTRA, DEFAULT_CAPABILITIES, Capabilities
from gateway.config import RequestLimits
from gateway.protocol.completions import ChatBody, CompletionBody
from gateway.protocol.tokens import DetokenizeBody, EmbeddingsBody, TokenizeChatBody, TokenizePromptBody
from gateway.state import state_of
from gateway.translate import anthropic, responses_api

ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
REF = "#/components/schemas/{model}"
ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key", "404": "Unknown model",
                  "413": "Body too large", "429": "Rate limited", "499": "Client closed the request",
                  "502": "Backend failed", "503": "Overloaded", "504": "Backend timed out"}


@dataclass
class Context:
    """What every entry of the document is built from; `defs` gathers the schemas they share."""

    models: list[str]
    limits: RequestLimits
    served: Capabilities
    defs: dict = field(default_factory=dict)

    def body(self, model, served: Capabilities | None = None) -> dict:
        return _body_schema(model, self.defs, self.models, self.limits, self.served if served is None else served)


def openapi_document(endpoints: Sequence, models: list[str], limits: RequestLimits,
                     served: Capabilities = DEFAULT_CAPABILITIES) -> dict:
    """`endpoints`: the route table (gateway/api/routes.py), each with its `openapi` entry or None;
    `served`: what the gateway's deployments declare together (the union)."""
    ctx = Context(models, limits, served)
    paths = {}
    for endpoint in endpoints:
        operation = endpoint.openapi(ctx) if endpoint.openapi is not None else None
        if operation is not None:  # None: an endpoint no deployment serves now
            paths[endpoint.path] = {method.lower(): operation for method in endpoint.methods}
    ctx.defs["Message"] = _message_by_role(ctx.defs["Message"], "tools" in served.features)
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvgate", "version": "0.1.0",
                 "description": "OpenAI-compatible inference gateway. Errors are OpenAI-style."},
        "paths": paths,
        "components": {"schemas": {**ctx.defs, "Error": ERROR, "AnthropicError": ANTHROPIC_ERROR}},
    }


# ------------------------------------------------------------------ each endpoint's entry


def completions_entry(ctx: Context) -> dict:
    return _generation("Create a completion", ctx.body(CompletionBody))


def chat_entry(ctx: Context) -> dict:
    chat = ctx.body(ChatBody)
    _chat_features(chat["properties"], ctx.defs, ctx.limits, ctx.served)
    return _generation("Create a chat completion", chat)


def responses_entry(ctx: Context) -> dict:
    return _generation("Create a response (OpenAI Responses API, stateless)",
                       _responses_body(ctx.defs, ctx.models, ctx.limits, ctx.served))


def messages_entry(ctx: Context) -> dict:
    return _generation("Create a message (Anthropic Messages API)",
                       _messages_body(ctx.defs, ctx.models, ctx.limits, ctx.served), error="AnthropicError")


def embeddings_entry(ctx: Context) -> dict | None:
    if "embeddings" not in ctx.served.endpoints:
        return None
    body = ctx.body(EmbeddingsBody)
    for option in body["properties"]["input"]["anyOf"]:  # no empty input, text or token array
        for inner in (option, option.get("items", {})):
            if inner.get("type") == "string":
                inner["minLength"] = 1
                inner["maxLength"] = ctx.limits.max_embedding_input_chars
            elif inner.get("type") == "array":
                inner["minItems"] = 1
        if option["type"] == "array" and option["items"].get("type") != "integer":
            option["maxItems"] = ctx.limits.max_embedding_inputs
    return _call("Create embeddings", body)


def tokenize_entry(ctx: Context) -> dict | None:
    if "tokenize" not in ctx.served.endpoints:
        return None
    forms = [ctx.body(m) for m in (TokenizePromptBody, TokenizeChatBody)]
    forms[0]["properties"]["prompt"]["maxLength"] = ctx.limits.max_embedding_input_chars
    forms[1]["properties"]["messages"]["maxItems"] = ctx.limits.max_messages
    forms[1]["properties"]["chat_template"] = {"type": "null", "description": "Not supported."}
    return _call("Tokenize a prompt or chat messages (vLLM's shape)", {"anyOf": forms})


def detokenize_entry(ctx: Context) -> dict | None:
    if "tokenize" not in ctx.served.endpoints:
        return None
    detokenize = ctx.body(DetokenizeBody)
    detokenize["properties"]["tokens"]["maxItems"] = ctx.limits.max_prompt_tokens
    return _call("Turn token ids into text (vLLM's shape)", detokenize)


def count_tokens_entry(ctx: Context) -> dict | None:
    """Anthropic's count_tokens, where some deployment serves tokenize (it counts with it)."""
    if "tokenize" not in ctx.served.endpoints:
        return None
    body = _messages_body(ctx.defs, ctx.models, ctx.limits, ctx.served, anthropic.CountTokensBody)
    return {"summary": "Count a message's input tokens (Anthropic Messages API)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": _responses({"type": "object"}, error="AnthropicError")}


def summary_entry(summary: str) -> Callable[[Context], dict]:
    """An endpoint with no request body: its summary, and a JSON object answered."""
    return lambda ctx: {"summary": summary, "responses": _responses({"type": "object"})}


def _body_schema(model, defs: dict, models: list[str], limits: RequestLimits, served: Capabilities) -> dict:
    schema = copy.deepcopy(model.model_json_schema(ref_template=REF))
    defs.update(schema.pop("$defs", {}))
    _vendor_fields(schema, served.extras)
    props = schema["properties"]
    props["model"] = {"type": "string", "enum": models} if "model" in schema.get("required", ()) else \
        {"anyOf": [{"type": "string", "enum": models}, {"type": "null"}]}
    _cap(props, "max_tokens", limits.max_tokens)
    _cap(props, "max_completion_tokens", limits.max_tokens)
    _cap(props, "n", limits.max_n)
    _cap(props, "logprobs", limits.max_top_logprobs)
    _cap(props, "top_logprobs", limits.max_top_logprobs)
    if "messages" in props:
        props["messages"]["maxItems"] = limits.max_messages
    _server_rules(props, limits)
    return schema


def _call(summary: str, body: dict) -> dict:
    return {"summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": _responses({"type": "object"})}


def _vendor_fields(schema: dict, extras: frozenset[str]) -> None:
    """Unknown fields are vendor fields: any where some deployment takes any, the names
    deployments declared otherwise, none when nobody declared any."""
    if ANY_EXTRA in extras:
        schema["additionalProperties"] = True
        return
    schema["additionalProperties"] = False
    for name in sorted(extras):
        schema["properties"].setdefault(name, {"description": "Vendor field, forwarded verbatim to the "
                                                              "deployments that accept it."})


def _chat_features(props: dict, defs: dict, limits: RequestLimits, served: Capabilities) -> None:
    """Tools, response_format kinds and reasoning_effort as far as some deployment serves them."""
    if "tools" in served.features:
        props["tools"]["anyOf"][0]["maxItems"] = limits.max_tools
    else:
        props["tools"] = {"type": ["array", "null"], "maxItems": 0, "description": "No deployment serves tools."}
        props["tool_choice"] = {"enum": ["none", "auto", None]}
    kinds = ["text"] + [k for k in ("json_object", "json_schema") if k in served.features]
    props["response_format"] = {"anyOf": [{"oneOf": [{"$ref": f"#/components/schemas/{_format_def(k)}"} for k in kinds]},
                                          {"type": "null"}]}
    if "reasoning" not in served.features:
        props["reasoning_effort"] = {"type": "null"}


def _format_def(kind: str) -> str:
    return {"text": "TextFormat", "json_object": "JsonObjectFormat", "json_schema": "JsonSchemaFormat"}[kind]


# Known parameters this server refuses unless empty or off (see protocol/completions.py): say so in the schema.
REFUSED_UNLESS_EMPTY = {
    "functions": {"type": ["array", "null"], "maxItems": 0},
    "logit_bias": {"type": ["object", "null"], "maxProperties": 0},
    "function_call": {"enum": ["none", None]},
    "echo": {"type": "boolean", "const": False}, "suffix": {"type": ["string", "null"], "maxLength": 0},
    "audio": {"type": "null"}, "best_of": {"type": "null"},
}


def _server_rules(props: dict, limits: RequestLimits) -> None:
    """What the server's validators and limits add to the field types."""
    for name, rule in REFUSED_UNLESS_EMPTY.items():
        if name in props:
            props[name] = {**rule, "description": "Not supported unless empty or off."}
    if "stop" in props:
        text = {"type": "string", "maxLength": limits.max_stop_chars}
        props["stop"] = {"anyOf": [text, {"type": "array", "items": text, "maxItems": limits.max_stop},
                                   {"type": "null"}]}
    if "stop_token_ids" in props:
        props["stop_token_ids"]["anyOf"][0]["maxItems"] = limits.max_stop_token_ids
    if "anyOf" in props.get("prompt", {}):  # completions (the Responses API and /tokenize have prompts of their own)
        for option in props["prompt"]["anyOf"]:
            if option["type"] == "array" and option["items"].get("type") != "integer":
                option["maxItems"] = limits.max_prompts
            if option["type"] == "array":
                option["minItems"] = 1
            for inner in (option, option.get("items", {})):  # an empty prompt is refused: nothing to continue
                if inner.get("type") == "string":
                    inner["minLength"] = 1
                if inner.get("type") == "array":
                    inner["minItems"] = 1


def _responses_body(defs: dict, models: list[str], limits: RequestLimits, served: Capabilities) -> dict:
    """The Responses request: its items and parts are validated one by one (for errors that name
    their path), so their schemas are filled in here from the same models. No vendor fields."""
    r = responses_api
    body = _body_schema(r.ResponsesBody, defs, models, limits, DEFAULT_CAPABILITIES)
    props = body["properties"]
    props["input"] = _text_or(_one_of(r.ITEMS.values(), defs), max_items=limits.max_messages)
    defs["MessageItem"]["properties"]["content"] = _text_or(_one_of(r.PARTS.values(), defs))
    defs["FunctionCallOutputItem"]["properties"]["output"] = _text_or(_one_of([r.InputText], defs))
    props["tools"] = _tools(_one_of([r.ResponsesFunctionTool], defs), limits, served)
    props["tool_choice"] = _optional({"anyOf": [{"enum": ["none", "auto", "required"]},
                                                _one_of([r.ResponsesNamedFunction], defs)]})
    _cap(props, "max_output_tokens", limits.max_tokens)
    for name in ("previous_response_id", "conversation", "prompt", "max_tool_calls", "top_logprobs"):
        props[name] = {"type": "null", "description": "Not supported: this server keeps no responses."}
    for name in ("store", "background"):
        props[name] = {"enum": [False, None], "description": "Only false: this server keeps no responses."}
    props["include"] = {"type": ["array", "null"], "maxItems": 0}
    return body


def _messages_body(defs: dict, models: list[str], limits: RequestLimits, served: Capabilities,
                   model=anthropic.MessagesBody) -> dict:
    """The Anthropic Messages request (or `model`: count_tokens'), its blocks filled in as for
    Responses."""
    a = anthropic
    body = _body_schema(model, defs, models, limits, DEFAULT_CAPABILITIES)
    props = body["properties"]
    props["messages"]["items"] = _one_of([a.MessageParam], defs)
    defs["MessageParam"]["properties"]["content"] = _text_or(_one_of(
        [a.TextBlock, a.ToolUseBlock, a.ToolResultBlock, a.ThinkingBlock, a.RedactedThinkingBlock], defs))
    defs["ToolResultBlock"]["properties"]["content"] = _optional(_text_or(_one_of([a.TextBlock], defs)))
    props["system"] = _optional(_text_or(_one_of([a.TextBlock], defs)))
    props["tools"] = _tools(_one_of([a.AnthropicTool], defs), limits, served)
    props["tool_choice"] = _optional(_one_of([a.AnthropicToolChoice], defs))
    if "stop_sequences" in props:
        text = {"type": "string", "maxLength": limits.max_stop_chars}
        props["stop_sequences"] = _optional({"type": "array", "items": text, "maxItems": limits.max_stop})
    for name in ("container", "mcp_servers", "context_management"):
        if name in props:
            props[name] = {"type": "null", "description": "Not supported."}
    return body


def _tools(tool: dict, limits: RequestLimits, served: Capabilities) -> dict:
    if "tools" not in served.features:
        return {"type": ["array", "null"], "maxItems": 0, "description": "No deployment serves tools."}
    return _optional({"type": "array", "items": tool, "maxItems": limits.max_tools})


def _one_of(models, defs: dict) -> dict:
    """A value that is one of `models`, each schema added to the components."""
    refs = []
    for model in models:
        schema = model.model_json_schema(ref_template=REF)
        defs.update(schema.pop("$defs", {}))
        defs.setdefault(model.__name__, schema)
        refs.append({"$ref": REF.format(model=model.__name__)})
    return refs[0] if len(refs) == 1 else {"anyOf": refs}


def _text_or(items: dict, max_items: int | None = None) -> dict:
    array = {"type": "array", "items": items, "minItems": 1}
    if max_items is not None:
        array["maxItems"] = max_items
    return {"anyOf": [{"type": "string"}, array]}


def _optional(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _message_by_role(message: dict, tools: bool) -> dict:
    """Only an assistant message may leave out its content, only it has tool_calls and refusal,
    only a tool message (and it must) tool_call_id (schemas.Message's validator): one variant
    per case, so a schema-valid message is one the server takes. Without tools, no deployment
    takes tool messages or tool calls."""
    assistant = _variant(message, ["assistant"], drop=("tool_call_id",) if tools else ("tool_call_id", "tool_calls"))
    speaker = _variant(message, ["system", "developer", "user"], drop=("tool_calls", "tool_call_id", "refusal"))
    _require_content(speaker)
    variants = [speaker, assistant]
    if tools:
        tool = _variant(message, ["tool"], drop=("tool_calls", "refusal"))
        _require_content(tool, also=("tool_call_id",))
        tool["properties"]["tool_call_id"] = {"type": "string", "minLength": 1, "maxLength": 256}
        variants.append(tool)
    return {"title": "Message", "anyOf": variants}


def _variant(message: dict, roles: list[str], drop: tuple[str, ...]) -> dict:
    variant = copy.deepcopy(message)
    variant["properties"]["role"] = {"type": "string", "enum": roles}
    for name in drop:
        variant["properties"].pop(name, None)
    return variant


def _require_content(variant: dict, also: tuple[str, ...] = ()) -> None:
    content = variant["properties"]["content"]
    content["anyOf"] = [option for option in content["anyOf"] if option.get("type") != "null"]
    content.pop("default", None)
    variant["required"] = ["role", "content", *also]


def _cap(props: dict, name: str, maximum: int) -> None:
    """Set the server's limit as the maximum of an integer field (inside Optional's anyOf too)."""
    field = props.get(name)
    if field is None:
        return
    for option in field.get("anyOf", [field]):
        if option.get("type") == "integer":
            option["maximum"] = maximum


def _generation(summary: str, body: dict, error: str = "Error") -> dict:
    return {"summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": _responses({"type": "object"}, streaming=True, error=error)}


def _responses(ok: dict, streaming: bool = False, error: str = "Error") -> dict:
    content = {"application/json": {"schema": ok}}
    if streaming:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out = {"200": {"description": "OK", "content": content}}
    for status, description in ERROR_STATUSES.items():
        out[status] = {"description": description,
                       "content": {"application/json": {"schema": {"$ref": REF.format(model=error)}}}}
    return out


def serving(endpoints: Callable[[], Sequence]):
    """The GET /openapi.json handler documenting `endpoints()` (the route table, which holds it)."""

    async def openapi_json(request: Request) -> JSONResponse:
        state = state_of(request)
        names = sorted(n for p in state.registry.pools for n in [p.name, *p.aliases])
        return JSONResponse(openapi_document(endpoints(), names, state.config.server.limits, served_by(state.registry)))

    return openapi_json


def served_by(registry) -> Capabilities:
    """The union of what every deployment of every model declares."""
    declared = [caps for pool in registry.pools for _, caps in pool.declared()]
    return Capabilities(*(frozenset().union(*(getattr(c, part) for c in declared))
                          for part in ("endpoints", "features", "extras")))
