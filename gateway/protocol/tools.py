"""Tools, tool calls and structured outputs in a chat request: their shapes and their checks.

The shapes are OpenAI's (openai-python's `ChatCompletionToolParam`, `ResponseFormat*`): a tool is
`{type: "function", function: {name, description?, parameters?, strict?}}`, `tool_choice` is
"none" | "auto" | "required" | `{type: "function", function: {name}}`, `response_format` is
`{type: "text" | "json_object"}` or `{type: "json_schema", json_schema: {name, schema?, ...}}`.
Beyond the types, each JSON schema must be a valid JSON Schema (the metaschema of the draft it
names in `$schema`, one of drafts 4, 6, 7, 2019-09 and 2020-12, 2020-12 by default; checked by
jsonschema-rs, ~30 µs a schema where the pure-Python jsonschema took ~5 ms) within `server.limits` (bytes and depth), each tool within
`max_tool_bytes`, and a named `tool_choice` must name one of the tools. Every refusal names the
path of the bad value (`tools[1].function.parameters.properties`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import jsonschema_rs
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from gateway import fastjson
from gateway.config import RequestLimits, format_path
from gateway.errors import InvalidRequestError

NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
# The drafts whose metaschemas jsonschema-rs has built in; another `$schema` it would fetch over
# the network, so it is refused instead.
DRAFTS = {f"{scheme}://json-schema.org/{path}{end}" for scheme in ("http", "https") for end in ("", "#")
          for path in ("draft-04/schema", "draft-06/schema", "draft-07/schema", "draft/2019-09/schema",
                       "draft/2020-12/schema")}


class StrictModel(BaseModel):
    """A request schema's base: unknown fields and loose types are refused (OpenAI's 400s)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object; absent: no arguments
    strict: bool | None = None


class FunctionTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str = Field(pattern=NAME)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(StrictModel):
    name: str = Field(pattern=NAME)
    arguments: str  # JSON text, as the model wrote it (not necessarily valid JSON)


class ToolCall(StrictModel):
    """One call in an assistant message of the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class JsonSchemaSpec(StrictModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


FORMATS = {"text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaFormat}


def _format_tag(value) -> str | None:
    """`type:<kind>`: gateway.protocol.completions skips such tags in an error's path (response_format.json_schema.name)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type:{kind}" if isinstance(kind, str) and kind in FORMATS else None  # a list or object is no kind


ResponseFormat = Annotated[
    Union[tuple(Annotated[model, Tag(f"type:{kind}")] for kind, model in FORMATS.items())],
    Discriminator(_format_tag, custom_error_type="invalid_format",
                  custom_error_message=f"type must be one of {', '.join(FORMATS)}"),
]


def check_tools(tools: list[FunctionTool] | None, tool_choice, limits: RequestLimits) -> None:
    """The limits and rules pydantic's types do not say; InvalidRequestError naming the path."""
    tools = tools or []
    if len(tools) > limits.max_tools:
        raise InvalidRequestError(f"{len(tools)} tools, over this server's limit of {limits.max_tools}.",
                                  param="tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        size = len(fastjson.dumps(tool.model_dump(exclude_none=True)))
        if size > limits.max_tool_bytes:
            raise InvalidRequestError(f"The tool is {size} bytes of JSON, over this server's limit of "
                                      f"{limits.max_tool_bytes}.", param=where)
        if tool.function.name in names:
            raise InvalidRequestError(f"Two tools are named '{tool.function.name}'.", param=f"{where}.function.name")
        names.add(tool.function.name)
        if tool.function.parameters is not None:
            check_schema(tool.function.parameters, f"{where}.function.parameters", limits)
            _check_object_schema(tool.function.parameters, f"{where}.function.parameters")
    _check_choice(tool_choice, names)


def _check_object_schema(parameters: dict, where: str) -> None:
    """A call's arguments are a JSON object, so `parameters` must allow one (OpenAI refuses
    `type: "string"` there too). A schema without `type` is taken as it is; an omitted
    `parameters` means no arguments, `{}`."""
    kind = parameters.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and "object" not in kinds:
        raise InvalidRequestError(f"A tool's parameters must be a JSON schema of type 'object' (the arguments are a "
                                  f"JSON object); got type {_short(fastjson.dumps(kind).decode())}.", param=f"{where}.type")


def _check_choice(tool_choice, names: set[str]) -> None:
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise InvalidRequestError(f"tool_choice names the tool '{tool_choice.function.name}', which is not "
                                      f"among the request's tools (tools: {known}).", param="tool_choice.function.name")
    elif tool_choice == "required" and not names:
        raise InvalidRequestError("tool_choice 'required' needs at least one tool in 'tools'.", param="tool_choice")


def check_response_format(response_format, limits: RequestLimits) -> None:
    if isinstance(response_format, JsonSchemaFormat) and response_format.json_schema.schema_ is not None:
        check_schema(response_format.json_schema.schema_, "response_format.json_schema.schema", limits)


def check_schema(schema: dict, where: str, limits: RequestLimits) -> None:
    """Within the size and depth limits, and valid against its draft's metaschema."""
    size = len(fastjson.dumps(schema))
    if size > limits.max_schema_bytes:
        raise InvalidRequestError(f"The JSON schema is {size} bytes, over this server's limit of "
                                  f"{limits.max_schema_bytes}.", param=where)
    depth = json_depth(schema)
    if depth > limits.max_schema_depth:
        raise InvalidRequestError(f"The JSON schema nests {depth} levels deep, over this server's limit of "
                                  f"{limits.max_schema_depth}.", param=where)
    draft = schema.get("$schema")
    if draft is not None and draft not in DRAFTS:
        raise InvalidRequestError(f"Unknown JSON Schema draft {_short(str(draft))!r} (known: drafts 4, 6, 7, "
                                  "2019-09, 2020-12 at json-schema.org).", param=f"{where}.$schema")
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as error:
        path = format_path([where, *error.instance_path])
        raise InvalidRequestError(f"Invalid JSON Schema at '{path}': {_short(error.message)}", param=path) from None


def json_depth(value) -> int:
    """Nesting of objects and arrays: 0 for a scalar, 1 for a flat object."""
    depth, level = 0, [value]
    while True:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [child for v in containers for child in (v.values() if isinstance(v, dict) else v)]


def _short(message: str, limit: int = 200) -> str:
    return message if len(message) <= limit else message[:limit] + "..."
