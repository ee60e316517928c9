"""What every tool-call format has in common: the parser's interface, the ids and deltas of the
calls it finds, the tools a tool_choice allows, and the JSON scanning the JSON formats share.

A format is one class (a ToolParser subclass, or anything with the same methods): an instance
parses one request's streamed output; its class methods build the grammar that makes
`tool_choice: required` / a named function output what the instance reads, and the prompt text
that asks a model whose chat template does not read tools for that format."""

from __future__ import annotations

import json
import uuid

from gateway.backend import ToolCallDelta
from gateway.errors import InvalidRequestError
from native_backend.text.grammar_spec import JSON_LAYOUT, GrammarSpec

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # omitted parameters: `{}`


class ToolParser:
    """One request's output split into content and tool calls, as it streams.

    push(text) -> (content, deltas) takes the next piece of text; finish() -> (content, deltas)
    at the end; num_calls: the calls found so far. Each call becomes two ToolCallDeltas: its id
    and name, then its arguments (JSON text). With max_calls (parallel_tool_calls false: 1),
    calls after the first max_calls are dropped. Text that is no call stays content."""

    name = ""  # the name it is registered under (tool_call_parser)

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.num_calls = 0
        self.seen_calls = 0  # num_calls, and the calls max_calls dropped

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    # -------------------------------------------------------------- the format's other side

    @classmethod
    def grammar(cls, tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None) -> GrammarSpec | None:
        """For "required" or a named function: a Lark grammar (cls.lark) whose every output is
        one call (named, or parallel_tool_calls false) or several of the allowed tools, in this
        format, each with arguments valid against the tool's parameters; None otherwise."""
        allowed = allowed_tools(tools, tool_choice)
        if allowed is None:
            return None
        single = parallel_tool_calls is False or isinstance(tool_choice, dict)
        return GrammarSpec("lark", cls.lark(allowed, single), param="tools")

    @classmethod
    def lark(cls, allowed: list[dict], single: bool) -> str:
        raise NotImplementedError

    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        """The system prompt that offers `tools` and asks for this format (for a chat template
        that does not render tools itself)."""
        raise NotImplementedError

    @classmethod
    def render_calls(cls, calls: list[tuple[str, object]]) -> str:
        """An assistant message's earlier calls, (name, arguments) pairs, as the model writes them."""
        raise NotImplementedError

    @classmethod
    def render_result(cls, content: str) -> str:
        """A tool message's content as the `tool` turn shows it."""
        return content

    # -------------------------------------------------------------- for subclasses

    def new_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def emit(self, name: str, arguments: dict) -> list[ToolCallDelta]:
        """A found call's two deltas (id and name, then its arguments); none past max_calls."""
        self.seen_calls += 1
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [ToolCallDelta(index, id=self.new_id(), name=name),
                ToolCallDelta(index, arguments=json.dumps(arguments))]


def allowed_tools(tools: list[dict] | None, tool_choice) -> list[dict] | None:
    """The tools a grammar lets the output call: all for "required", the named one for a named
    function; None when nothing is constrained (no tools, "auto", "none")."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    if not isinstance(tool_choice, dict):
        return tools
    name = tool_choice["function"]["name"]
    allowed = [t for t in tools if t["function"]["name"] == name]
    if not allowed:  # the gateway checks this too
        raise InvalidRequestError(f"tool_choice names '{name}', which is not among the tools.",
                                  param="tool_choice.function.name")
    return allowed


def call_schema(allowed: list[dict], arguments_key: str = "arguments") -> dict:
    """JSON Schema of one call object {"name": ..., arguments_key: {...}} of the allowed tools,
    the arguments their parameters' schema (a tool without parameters takes exactly {})."""
    schemas = [{"type": "object",
                "properties": {"name": {"const": t["function"]["name"]},
                               arguments_key: t["function"].get("parameters") or NO_PARAMETERS},
                "required": ["name", arguments_key], "additionalProperties": False} for t in allowed]
    return {"anyOf": schemas} if len(schemas) > 1 else schemas[0]


def compact(schema: dict) -> str:
    """A schema for Lark's %json, laid out compactly (no free whitespace: JSON_LAYOUT)."""
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def tools_json(tools: list[dict]) -> str:
    """The tools' function objects, one JSON line each (for system prompts)."""
    return "\n".join(json.dumps(t["function"]) for t in tools)


def call_parts(parsed, keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict] | None:
    """(name, arguments) of a parsed call object, or None when it is none: an object with a
    string name and, under the first of `keys` present, an object (or JSON text of one;
    absent: {})."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = next((parsed[k] for k in keys if k in parsed), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser takes
            return None
    return (parsed["name"], arguments) if isinstance(arguments, dict) else None


class BracketScanner:
    """Where the bracketed value that opens at text[0] closes ({...} or [...] in JSON; with
    quotes="'\"" a Python expression), across pushes: each character is looked at once, however
    the text arrives (rescanning from the start at every token would be quadratic in the call's
    length). The text between is not validated here."""

    def __init__(self, quotes: str = '"'):
        self.quotes = quotes
        self.opens, self.closes = ("{[(", ")]}") if "'" in quotes else ("{[", "]}")
        self.depth = 0
        self.quote = None  # the quote of the string we are in
        self.escaped = False
        self.pos = 0  # text[:pos] already scanned

    def end(self, text: str) -> int | None:
        """The index just past the value in `text` (which only grows between calls), or None
        while it is still open."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == self.quote:
                    self.quote = None
            elif c in self.quotes:
                self.quote = c
            elif c in self.opens:
                self.depth += 1
            elif c in self.closes:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the next piece decides)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
