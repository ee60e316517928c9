"""Hermes (NousResearch's format, vLLM's `hermes`; Qwen 2.5 and Hermes 2/3 templates ask for it):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

Text before and between calls is content; a body that is no call object stays text, tags and all;
an unterminated call at the end counts when its body parses. A body that begins
`{"name": "...", "arguments": {` is a call from there on, its arguments streamed (StreamedCall)."""

from __future__ import annotations

import json

from gateway.backend import ToolCallDelta
from kvgate_native.tool_parsers.base import (
    StreamedCall, ToolParser, call_parts, call_schema, compact, partial_tag)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    "follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


class HermesParser(ToolParser):
    """A possible start of `<tool_call>` at the end of what came so far is held back until the
    next piece decides; so is whitespace, which is dropped when only tool calls surround it."""

    name = "hermes"
    special_markers = (OPEN, CLOSE)
    system_prompt_template = SYSTEM_PROMPT

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._pending = ""  # text not yet decided
        self._call: StreamedCall | None = None  # the block we are in (its body starts _pending)
        self._searched = 0  # in a call: _pending[:_searched] holds no </tool_call>

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content, deltas = "", []
        while True:
            if self._call is not None:
                end = self._pending.find(CLOSE, self._searched)
                if end < 0:  # the next search starts where the tag could still begin
                    self._searched = max(0, len(self._pending) - len(CLOSE) + 1)
                    stop = len(self._pending) - partial_tag(self._pending, CLOSE)
                    return content, deltas + self._call.feed(self._pending, stop)
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._searched = 0
                found, text_instead = self._end_call(body)
                deltas += found
                content += text_instead
                continue
            text, self._pending, opened = self.text_before(self._pending, OPEN)
            content += text
            if not opened:
                return content, deltas
            self._call = StreamedCall(self)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end: an unterminated call is parsed if it can be; other text is content."""
        rest, self._pending = self._pending, ""
        if self._call is not None:
            deltas, text = self._end_call(rest, closed=False)
            return text, deltas
        return self.outside_calls(rest), []

    def _end_call(self, body: str, closed: bool = True) -> tuple[list[ToolCallDelta], str]:
        """The block's last deltas (or text, when it was no call), its body complete."""
        call, self._call = self._call, None
        if not call.whole:
            deltas = call.feed(body)
            if call.started:
                return deltas + call.cut(body), ""
        try:
            parts = call_parts(json.loads(body))
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser takes
            parts = None
        if parts is None:
            return [], f"{OPEN}{body}{CLOSE if closed else ''}"  # not a call after all: the model's text
        return self.emit(*parts), ""

    @classmethod
    def lark(cls, allowed: list[dict], single: bool) -> str:
        repeat = "" if single else "+"
        return f'start: call{repeat}\ncall: "{OPEN}\\n" %json {compact(call_schema(allowed))} "\\n{CLOSE}\\n"\n'


    @classmethod
    def render_calls(cls, calls: list[tuple[str, object]]) -> str:
        return "".join(f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"
                       for name, arguments in calls)

    @classmethod
    def render_result(cls, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
