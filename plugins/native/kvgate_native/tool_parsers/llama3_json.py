"""Llama 3.x JSON tool calls (vLLM's `llama3_json`; Llama 3.1/3.2's JSON tool template):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}

An output is calls when it begins (after whitespace) with `{` or `<|python_tag|>`: then each
`;`-separated object with a string `name` and `parameters` (or `arguments`) is a call. An
output that begins otherwise is content throughout, as it is in vLLM; so is everything from the
first object that is no call (or from text that is neither `;` nor an object) on. An object still
open at the end is content, unless it began `{"name": "...", "parameters": {`: an object that does is
a call from there on, its arguments streamed (StreamedCall)."""

from __future__ import annotations

import json

from gateway.backend import ToolCallDelta
from kvgate_native.tool_parsers.base import (
    BracketScanner, StreamedCall, ToolParser, call_parts, call_schema, compact)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
SYSTEM_PROMPT = (
    "You can call these functions (JSON Schema of each below). To call one, answer with nothing but a JSON "
    "object of this form: {{\"name\": <function-name>, \"parameters\": <dictionary of argument names and "
    "values>}}. To call several, separate the objects with \"; \". Use values, not variables.\n\n{tools}")

KEYS = ("parameters", "arguments")  # where a call's arguments are (the first present)
START, CALLS, TEXT = "start", "calls", "text"  # undecided; reading calls; content to the end


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    special_markers = (PYTHON_TAG,)
    system_prompt_template = SYSTEM_PROMPT

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._state = START
        self._pending = ""
        self._head = ""  # what came before the first object (whitespace, the tag): content again if it is no call
        self._scan: BracketScanner | None = None  # the object being read (it starts _pending)
        self._call: StreamedCall | None = None  # the same object as a call, its arguments streamed

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content, deltas = "", []
        while True:
            if self._state == TEXT:
                content, self._pending = content + self._pending, ""
                return content, deltas
            if self._state == START and not self._start():
                return content, deltas
            if self._state == CALLS:
                found, more = self._calls()
                deltas += found
                if not more:
                    return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest, self._pending = self._pending, ""
        if self._state == START:
            return self._head + rest, []
        if self._call is not None and self._call.started:  # cut inside a call: the call, cut
            return "", self._call.cut(rest)
        if self._state == CALLS and self.seen_calls:
            rest = _next_call(rest).rstrip()
        elif self._state == CALLS:
            rest = self._head + rest
        return rest, []

    def _start(self) -> bool:
        """Decides whether the output is calls; False while the text so far cannot tell."""
        stripped = self._pending.lstrip()
        if not stripped or (PYTHON_TAG.startswith(stripped) and stripped != PYTHON_TAG):
            return False
        if stripped.startswith(PYTHON_TAG):
            cut = len(self._pending) - len(stripped) + len(PYTHON_TAG)
            self._head, self._pending = self._pending[:cut], self._pending[cut:]
            self._state = CALLS
        else:
            self._state = CALLS if stripped[0] == "{" else TEXT
        return True

    def _calls(self) -> tuple[list[ToolCallDelta], bool]:
        """The next call, if complete: (its deltas, True to go on); ([], False) to wait."""
        if self._scan is None:
            stripped = _next_call(self._pending) if self.seen_calls else self._pending.lstrip()
            if not stripped:
                return [], False
            if not self.seen_calls:
                self._head += self._pending[: len(self._pending) - len(stripped)]
            self._pending = stripped
            if stripped[0] != "{":
                self._to_text()
                return [], True
            self._scan, self._call = BracketScanner(), StreamedCall(self, keys=KEYS)
        end = self._scan.end(self._pending)
        streamed = self._call.feed(self._pending, end)
        if end is None:
            return streamed, False
        call, self._scan, self._call = self._call, None, None
        if call.started:  # its arguments closed before the object did: all sent
            self._pending = self._pending[end:]
            return streamed, True
        try:
            parts = call_parts(json.loads(self._pending[:end]), keys=KEYS)
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser takes
            parts = None
        if parts is None:
            self._to_text()
            return [], True
        self._pending = self._pending[end:]
        return self.emit(*parts), True

    def _to_text(self) -> None:
        """What is left is no call: content from here on (with the head when nothing was a call)."""
        self._state = TEXT
        self._pending = self._pending if self.seen_calls else self._head + self._pending

    @classmethod
    def lark(cls, allowed: list[dict], single: bool) -> str:
        repeat = "" if single else f' ("{SEPARATOR}" call)*'
        return f"start: call{repeat}\ncall: %json {compact(call_schema(allowed, 'parameters'))}\n"


    @classmethod
    def render_calls(cls, calls: list[tuple[str, object]]) -> str:
        return SEPARATOR.join(json.dumps({"name": name, "parameters": arguments}) for name, arguments in calls)


def _next_call(text: str) -> str:
    """The text after a call without the whitespace and `;` that separate it from the next."""
    text = text.lstrip()
    return text[1:].lstrip() if text.startswith(";") else text
