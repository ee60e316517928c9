"""Mistral's tool calls (vLLM's `mistral`, the JSON-array form of Mistral's v3 tokenizers):

    text [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]

Text before `[TOOL_CALLS]` is content; the JSON array after it (or a single object) is the calls.
A section that does not parse as such, every element a call object, stays content in full, the
marker with it; so does one still open at the end. Call ids are 9 letters and digits, as Mistral's
chat templates require of the ids they are given back. The newer `[TOOL_CALLS]name[ARGS]{...}`
form (tokenizer v11+) is not read.

`[TOOL_CALLS]` is a special token in Mistral's own tokenizers, which the engine's text skips
(it decodes without special tokens); so an output that begins (after whitespace) with a JSON
array is read as the calls after the marker too. On other models (SmolLM2) the marker is text."""

from __future__ import annotations

import json
import secrets
import string

from gateway.backend import ToolCallDelta
from kvgate_native.tool_parsers.base import (
    BracketScanner, ToolParser, call_parts, call_schema, compact, tools_json)

TAG = "[TOOL_CALLS]"
ID_ALPHABET = string.ascii_letters + string.digits
SYSTEM_PROMPT = (
    "You can call these functions (JSON Schema of each below). To call them, answer with [TOOL_CALLS] "
    "followed by a JSON array of the calls, each an object of this form: {{\"name\": <function-name>, "
    "\"arguments\": <dictionary of argument names and values>}}. Use values, not variables.\n\n{tools}")


class MistralParser(ToolParser):
    name = "mistral"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._pending = ""
        self._in_calls = False  # after [TOOL_CALLS], before its array closed
        self._marker = TAG  # what opened the section: TAG, or nothing for an array at the start
        self._started = False  # past the output's start (where an array alone is calls)
        self._scan: BracketScanner | None = None  # the array being read (it starts _pending)

    def new_id(self) -> str:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content, deltas = "", []
        if not self._started and not self._start():
            return "", []
        while True:
            if self._in_calls:
                done, found, text_instead = self._section()
                if not done:
                    return content, deltas
                deltas, content = deltas + found, content + text_instead
                continue
            text, self._pending, opened = self.text_before(self._pending, TAG)
            content += text
            if not opened:
                return content, deltas
            self._in_calls, self._marker = True, TAG

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest, self._pending = self._pending, ""
        if self._in_calls:
            self._in_calls, self._scan = False, None
            return self._marker + rest, []
        return self.outside_calls(rest), []

    def _start(self) -> bool:
        """At the output's start: an array there (not the marker) opens the calls; False while
        the text so far cannot tell."""
        stripped = self._pending.lstrip()
        if not stripped or (len(stripped) < len(TAG) and TAG.startswith(stripped)):
            return False
        self._started = True
        if stripped[0] == "[" and not stripped.startswith(TAG):
            self._in_calls, self._marker = True, ""
        return True

    def _section(self) -> tuple[bool, list[ToolCallDelta], str]:
        """The calls after the marker, once their JSON closed: (True, deltas, text that was no
        call); (False, ...) while it is open."""
        if self._scan is None:
            stripped = self._pending.lstrip()
            if not stripped:
                return False, [], ""
            self._marker += self._pending[: len(self._pending) - len(stripped)]  # as written, if no call
            self._pending = stripped
            if stripped[0] not in "[{":
                self._in_calls = False
                return True, [], self._marker
            self._scan = BracketScanner()
        end = self._scan.end(self._pending)
        if end is None:
            return False, [], ""
        self._in_calls, self._scan = False, None
        calls = _calls(self._pending[:end])
        written, self._pending = self._pending[:end], self._pending[end:]
        if calls is None:
            return True, [], self._marker + written
        return True, [delta for call in calls for delta in self.emit(*call)], ""

    @classmethod
    def lark(cls, allowed: list[dict], single: bool) -> str:
        array = {"type": "array", "items": call_schema(allowed), "minItems": 1, **({"maxItems": 1} if single else {})}
        return f'start: "{TAG}" %json {compact(array)}\n'

    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        return SYSTEM_PROMPT.format(tools=tools_json(tools))

    @classmethod
    def render_calls(cls, calls: list[tuple[str, object]]) -> str:
        return TAG + json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls])


def _calls(text: str) -> list[tuple[str, dict]] | None:
    """(name, arguments) of each call in a JSON array of call objects (or one object); None
    when it is not that."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past what the parser takes
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [call_parts(item) for item in items]
    return calls if items and None not in calls else None
