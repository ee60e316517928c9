"""Tool calling on the native engine: the prompt side, for whichever tool-call format the
deployment's parser reads (`settings.tool_call_parser`: tool_parsers/, like vLLM's --tool-call-parser).

    request tools ──> the model's own chat template, when it renders tools (Qwen 2.5, Hermes style:
                      `Tokenizer.supports_tools`), given the tools, the calls and the tool messages;
                      otherwise (SmolLM2) the parser's system prompt listing them and asking for its
                      format, and the conversation as text: assistant tool_calls as the parser
                      writes them (Hermes: <tool_call>{"name", "arguments"}</tool_call>), tool
                      results as it shows them (Hermes: <tool_response>...</tool_response>)
    tool_choice   ──> "required" / a named function: the parser's grammar (Lark with the tools'
                      parameter schemas) makes the output one call (or several, with
                      parallel_tool_calls) in its format that parses; "auto": no grammar, the model
                      chooses; "none": no tools in the prompt
    output        ──> the parser: text that is no call is content, each call a ToolCallDelta pair
                      (id and name, then the arguments); finish_reason tool_calls
"""

from __future__ import annotations

import json

from kvgate_native.tool_parsers import ToolParser
from kvgate_native.tool_parsers.hermes import HermesParser


def uses_tools(tools: list[dict] | None, tool_choice) -> bool:
    return bool(tools) and tool_choice != "none"


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None, tool_choice,
                    add_generation_prompt: bool = True, parser: type[ToolParser] = HermesParser) -> list[int]:
    """A chat's prompt token ids with its tools (text.tokenizer.Tokenizer): generation and
    /tokenize both count them this way. The template's own tool rendering when it has one, else
    the parser's system prompt; tool_choice "none" offers no tools."""
    if tokenizer.supports_tools:
        offered = tools if uses_tools(tools, tool_choice) else None
        return tokenizer.apply_chat_template(messages, tools=offered, add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(with_tools(messages, tools, tool_choice, parser),
                                         add_generation_prompt=add_generation_prompt)


def with_tools(messages: list[dict], tools: list[dict] | None, tool_choice,
               parser: type[ToolParser] = HermesParser) -> list[dict]:
    """The conversation as the template can render it: tool calls and results as text in the
    parser's format, and its system prompt for the tools unless tool_choice is "none"."""
    rendered = [_as_text(m, parser) for m in messages]
    if not uses_tools(tools, tool_choice):
        return rendered
    prompt = parser.system_prompt(tools)
    if rendered and rendered[0]["role"] in ("system", "developer"):
        return [{"role": "system", "content": f"{rendered[0]['content']}\n\n{prompt}"}] + rendered[1:]
    return [{"role": "system", "content": prompt}] + rendered


def _as_text(message: dict, parser: type[ToolParser]) -> dict:
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        text = parser.render_calls([(c["function"]["name"], _arguments(c)) for c in calls])
        return {"role": "assistant", "content": (message.get("content") or "") + text}
    if message.get("role") == "tool":
        return {"role": "tool", "content": parser.render_result(_plain(message.get("content")))}
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
