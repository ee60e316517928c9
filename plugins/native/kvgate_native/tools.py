"""Tool calling on the native engine, Hermes style (NousResearch's format, vLLM's `hermes` parser).

    request tools ──> the model's own chat template, when it renders tools (Qwen 2.5, Hermes style:
                      `Tokenizer.supports_tools`), given the tools, the calls and the tool messages;
                      otherwise (SmolLM2) a system prompt listing them, and the conversation as text:
                      assistant tool_calls as <tool_call>{"name", "arguments"}</tool_call>,
                      tool results as <tool_response>...</tool_response>
    tool_choice   ──> "required" / a named function: a grammar (Lark with the tools' parameter schemas)
                      makes the output one call (or several, with parallel_tool_calls) that parses;
                      "auto": no grammar, the model chooses; "none": no tools in the prompt
    output        ──> HermesParser: text before/between calls is content, each <tool_call> body a
                      ToolCallDelta pair (id and name, then the arguments); finish_reason tool_calls

The parser is the plugin point (vLLM's --tool-call-parser): anything with push(text) ->
(content, deltas) and finish() -> (content, deltas) and `num_calls` serves.
"""

from __future__ import annotations

import json
import uuid

from gateway.backend import ToolCallDelta
from gateway.errors import InvalidRequestError
from native_backend.text.grammar_spec import JSON_LAYOUT, GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    "follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # omitted parameters: `{}`


def uses_tools(tools: list[dict] | None, tool_choice) -> bool:
    return bool(tools) and tool_choice != "none"


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None, tool_choice,
                    add_generation_prompt: bool = True) -> list[int]:
    """A chat's prompt token ids with its tools (text.tokenizer.Tokenizer): generation and
    /tokenize both count them this way. The template's own tool rendering when it has one, else
    the Hermes system prompt; tool_choice "none" offers no tools."""
    if tokenizer.supports_tools:
        offered = tools if uses_tools(tools, tool_choice) else None
        return tokenizer.apply_chat_template(messages, tools=offered, add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(with_tools(messages, tools, tool_choice),
                                         add_generation_prompt=add_generation_prompt)


def with_tools(messages: list[dict], tools: list[dict] | None, tool_choice) -> list[dict]:
    """The conversation as the template can render it: tool calls and results as text, and the
    tools' system prompt unless tool_choice is "none"."""
    rendered = [_as_text(m) for m in messages]
    if not uses_tools(tools, tool_choice):
        return rendered
    prompt = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    if rendered and rendered[0]["role"] in ("system", "developer"):
        return [{"role": "system", "content": f"{rendered[0]['content']}\n\n{prompt}"}] + rendered[1:]
    return [{"role": "system", "content": prompt}] + rendered


def _as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        text = "".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': _arguments(c)})}\n{CLOSE}"
                       for c in calls)
        return {"role": "assistant", "content": (message.get("content") or "") + text}
    if message.get("role") == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{_plain(message.get('content'))}\n</tool_response>"}
    return message


def _arguments(call: dict):
    try:
        return json.loads(call["function"]["arguments"])
    except ValueError:
        return call["function"]["arguments"]  # as the model wrote it before


def _plain(content) -> str:
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def tool_grammar(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None) -> GrammarSpec | None:
    """For "required" or a named function: a Lark grammar whose every output is one or more
    Hermes calls of the allowed tools, their arguments valid against the parameters' schema."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    allowed = tools
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        allowed = [t for t in tools if t["function"]["name"] == name]
        if not allowed:  # the gateway checks this too
            raise InvalidRequestError(f"tool_choice names '{name}', which is not among the tools.",
                                      param="tool_choice.function.name")
    schemas = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": t["function"].get("parameters") or NO_PARAMETERS},
                "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
    call = {**({"anyOf": schemas} if len(schemas) > 1 else schemas[0]), "x-guidance": JSON_LAYOUT}  # compact
    repeat = "" if parallel_tool_calls is False or isinstance(tool_choice, dict) else "+"
    lark = f'start: call{repeat}\ncall: "{OPEN}\\n" %json {json.dumps(call)} "\\n{CLOSE}\\n"\n'
    return GrammarSpec("lark", lark, param="tools")


class HermesParser:
    """Splits streamed text into content and tool calls. A possible start of `<tool_call>` at the
    end of what came so far is held back until the next piece decides; so is whitespace, which
    is dropped when only tool calls surround it."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls  # parallel_tool_calls false: 1 (later calls are dropped)
        self.num_calls = 0
        self._pending = ""  # text not yet decided
        self._in_call = False

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content, deltas = "", []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return content, deltas
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._in_call = False
                found, text_instead = self._call(body)
                deltas += found
                content += text_instead
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                content += self._content(self._pending[:start])
                self._pending = self._pending[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_tag(self._pending)
            decided = self._pending[: len(self._pending) - keep]
            if decided.strip():
                content += decided
                self._pending = self._pending[len(decided):]
            return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end: an unterminated call is parsed if it can be; other text is content."""
        rest, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            deltas, text = self._call(rest, closed=False)
            return text, deltas
        return self._content(rest), []

    def _content(self, text: str) -> str:
        return "" if self.num_calls and not text.strip() else text

    def _call(self, body: str, closed: bool = True) -> tuple[list[ToolCallDelta], str]:
        try:
            parsed = json.loads(body)
            name = parsed["name"]
            arguments = parsed.get("arguments", parsed.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            return [], f"{OPEN}{body}{CLOSE if closed else ''}"  # not a call after all: the model's text
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return [], ""
        index, self.num_calls = self.num_calls, self.num_calls + 1
        call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        return [ToolCallDelta(index, id=call_id, name=name),
                ToolCallDelta(index, arguments=json.dumps(arguments))], ""


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that begins `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
