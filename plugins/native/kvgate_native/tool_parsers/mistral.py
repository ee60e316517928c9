"""Mistral's tool calls (vLLM's `mistral`), in both of its tokenizers' forms:

    v3 (JSON array):  text [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {...}]
    v11+ (one marker a call):
                      text [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}
                      (mistral-common writes `name[CALL_ID]id[ARGS]{...}` when it has an id)

Text before the first `[TOOL_CALLS]` is content. After the marker, a JSON array (or a single
object) is the v3 calls: a section that does not parse as such, every element a call object, stays
content in full, the marker with it; so does one still open at the end. A function name (letters,
digits, `_`, `-`, `.`) followed by `[ARGS]` (or, as vLLM also reads it, directly by the arguments'
`{`) is a v11 call: from its `{` on it is a call, its id and name sent at once and its arguments
streamed as written (cut, at the end, where they were cut). Anything else after the marker is
content, the marker with it. Call ids are 9 letters and digits, as Mistral's chat templates
require of the ids they are given back (a model's own `[CALL_ID]` is not kept).

`[TOOL_CALLS]`, `[CALL_ID]` and `[ARGS]` are special tokens in Mistral's own tokenizers: a request
with tools keeps them in the engine's text for this parser (special_markers), out of the content.
An output that begins (after whitespace) with a JSON array is read as the calls after the marker
too (a text whose markers were left out). A v11 call whose markers were left out
(`get_weather{"city": "Oslo"}`) cannot be told from text and is content. On other models
(SmolLM2) the markers are text."""

from __future__ import annotations

import json
import secrets
import string

from gateway.backend import ToolCallDelta
from kvgate_native.tool_parsers.base import (
    BracketScanner, ToolParser, call_parts, call_schema, compact)

TAG = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"  # v11+: name[CALL_ID]id[ARGS]{...}
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")
MAX_NAME = 64  # OpenAI's limit on a function name (and on the call id read past)
ID_ALPHABET = string.ascii_letters + string.digits
SYSTEM_PROMPT = (
    "You can call these functions (JSON Schema of each below). To call them, answer with [TOOL_CALLS] "
    "followed by a JSON array of the calls, each an object of this form: {{\"name\": <function-name>, "
    "\"arguments\": <dictionary of argument names and values>}}. Use values, not variables.\n\n{tools}")


class MistralParser(ToolParser):
    name = "mistral"
    special_markers = (TAG, CALL_ID, ARGS)
    system_prompt_template = SYSTEM_PROMPT

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._pending = ""
        self._in_calls = False  # after [TOOL_CALLS], before its array closed
        self._marker = TAG  # what opened the section: TAG, or nothing for an array at the start
        self._started = False  # past the output's start (where an array alone is calls)
        self._scan: BracketScanner | None = None  # the array being read (it starts _pending)
        self._named: _NamedCall | None = None  # the v11 call being read (it starts _pending)

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
                deltas, content = deltas + found, content + text_instead
                if not done:
                    return content, deltas
                continue
            text, self._pending, opened = self.text_before(self._pending, TAG)
            content += text
            if not opened:
                return content, deltas
            self._in_calls, self._marker = True, TAG

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest, self._pending = self._pending, ""
        if self._named is not None:  # a v11 call cut by the end: its arguments as far as written
            named, self._named, self._in_calls = self._named, None, False
            return "", named.arguments(rest, len(rest))
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
        """What follows the marker: (True, deltas, text that was no call) once it is read; (False,
        deltas so far, "") while it is open (a v3 array sends its calls once it closed, a v11 call
        its arguments as they come)."""
        if self._named is not None:
            return self._named_call()
        if self._scan is None:
            stripped = self._pending.lstrip()
            if not stripped:
                return False, [], ""
            self._marker += self._pending[: len(self._pending) - len(stripped)]  # as written, if no call
            self._pending = stripped
            if stripped[0] not in "[{":
                start = named_start(stripped)
                if start is None:
                    return False, [], ""
                if start is False:
                    self._in_calls = False
                    return True, [], self._marker
                self._named = _NamedCall(self, *start)
                return self._named_call()
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

    def _named_call(self) -> tuple[bool, list[ToolCallDelta], str]:
        """A v11 call's arguments so far; done once their object closed (the rest is pending)."""
        named = self._named
        end = named.scan.end(self._pending)
        deltas = named.arguments(self._pending, len(self._pending) if end is None else end)
        if end is None:
            return False, deltas, ""
        self._named, self._in_calls, self._pending = None, False, self._pending[end:]
        return True, deltas, ""

    @classmethod
    def lark(cls, allowed: list[dict], single: bool) -> str:
        array = {"type": "array", "items": call_schema(allowed), "minItems": 1, **({"maxItems": 1} if single else {})}
        return f'start: "{TAG}" %json {compact(array)}\n'


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


class _NamedCall:
    """A v11 call (`name[ARGS]{...}`, its text starting the parser's pending text): its id and
    name go out at once, then the arguments object's text as it arrives, up to its closing brace."""

    def __init__(self, parser: MistralParser, name: str, opens: int):
        self.index = parser.start_call()  # None past max_calls: read, not sent
        self.first = [ToolCallDelta(self.index, id=parser.new_id(), name=name)] if self.index is not None else []
        self.scan = BracketScanner(start=opens)
        self.sent = opens  # text[:sent] is sent (or is the name and markers)

    def arguments(self, text: str, upto: int) -> list[ToolCallDelta]:
        deltas, self.first = self.first, []
        piece, self.sent = text[self.sent:upto], max(self.sent, upto)
        if piece and self.index is not None:
            deltas.append(ToolCallDelta(self.index, arguments=piece))
        return deltas


def named_start(text: str) -> tuple[str, int] | bool | None:
    """Whether `text` (what follows a marker) begins a v11 call, `name`, then `[CALL_ID]id`
    optionally, then `[ARGS]` (or not), then (after whitespace) `{`: (the name, where that `{` is)
    once it does; None while the text so far cannot tell; False when it does not."""
    i = _run(text, 0, NAME_CHARS)
    if i == 0 or i > MAX_NAME:
        return False
    name = text[:i]
    for tag in (CALL_ID, ARGS):
        rest = text[i:]
        if not rest or (tag.startswith(rest) and rest != tag):
            return None
        if rest.startswith(tag):
            i += len(tag)
            if tag == CALL_ID:
                end = _run(text, i, ID_ALPHABET)
                if end - i > MAX_NAME:
                    return False
                if end == len(text):
                    return None
                i = end
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i == len(text):
        return None
    return (name, i) if text[i] == "{" else False


def _run(text: str, i: int, chars) -> int:
    """Where the run of `chars` that starts at text[i] ends."""
    while i < len(text) and text[i] in chars:
        i += 1
    return i
