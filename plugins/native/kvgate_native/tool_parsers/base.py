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
    at the end; num_calls: the calls found so far. Each call becomes ToolCallDeltas: its id and
    name, then its arguments (JSON text), in one fragment or, streamed (StreamedCall), in several
    whose concatenation is that text. With max_calls (parallel_tool_calls false: 1), calls after
    the first max_calls are dropped. Text that is no call stays content."""

    name = ""  # the name it is registered under (tool_call_parser)
    # The markers it reads that a model's tokenizer may have as special tokens ([TOOL_CALLS]): the
    # engine keeps those in the text it parses (vLLM's parsers set skip_special_tokens false), and
    # HiddenMarkers takes them out of the content again.
    special_markers: tuple[str, ...] = ()
    # The system prompt that offers the tools and asks for this format, `{tools}` where the tools
    # go (one JSON function object a line): what `system_prompt` fills in.
    system_prompt_template = ""

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
        that does not render tools itself): `system_prompt_template` with the tools in it."""
        if not cls.system_prompt_template:
            raise NotImplementedError(f"{cls.__name__} has no system_prompt_template")
        return cls.system_prompt_template.format(tools=tools_json(tools))

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

    def start_call(self) -> int | None:
        """A found call's index; None past max_calls (the call is dropped)."""
        self.seen_calls += 1
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return None
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return index

    def outside_calls(self, text: str) -> str:
        """Text outside any call, as content: whitespace alone is dropped once calls were seen
        (it only separated them)."""
        return "" if self.seen_calls and not text.strip() else text

    def text_before(self, pending: str, marker: str) -> tuple[str, str, bool]:
        """Outside a call, for a format whose calls open with `marker`: (the content decided, the
        text still pending, whether the marker was found - `pending` then starts after it). With
        no marker, all but a possible start of it at the end is content once it holds more than
        whitespace; whitespace is held back (dropped later if only calls surround it)."""
        start = pending.find(marker)
        if start >= 0:
            return self.outside_calls(pending[:start]), pending[start + len(marker):], True
        decided = pending[: len(pending) - partial_tag(pending, marker)]
        if not decided.strip():
            return "", pending, False
        return decided, pending[len(decided):], False

    def emit(self, name: str, arguments: dict) -> list[ToolCallDelta]:
        """A whole call's two deltas (id and name, then its arguments); none past max_calls."""
        index = self.start_call()
        if index is None:
            return []
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


PREFIX_LIMIT = 1000  # a call whose arguments open later than this in its text is read whole (bounds rescans)


def call_start(text: str, keys: tuple[str, ...]) -> tuple[str, int] | bool | None:
    """Whether `text` (a call object's text so far, whitespace before its `{` allowed) begins
    `{"name": <string>, <one of keys>: {`, the layout a call is streamed in: (the name, where the
    arguments object begins) once it does; None while the text so far cannot tell; False when
    it cannot (another layout, or the arguments opening past PREFIX_LIMIT)."""
    found = _call_start(text, keys)
    if found is None and len(text) > PREFIX_LIMIT or found and found[1] > PREFIX_LIMIT:
        return False
    return found


def _call_start(text: str, keys: tuple[str, ...]) -> tuple[str, int] | bool | None:
    i, name = 0, None
    for step in ("{", '"name"', ":", "name", ",", "key", ":", "{"):
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if i == len(text):
            return None
        if step in ("name", "key"):
            end = _string_end(text, i)
            if end is None:
                return None
            try:
                value = json.loads(text[i:end])
            except ValueError:  # not a string, or a bad escape
                return False
            if not isinstance(value, str) or (step == "key" and value not in keys):
                return False
            name = value if step == "name" else name
            i = end
            continue
        if not text.startswith(step[: len(text) - i], i):
            return False
        if len(text) - i < len(step):
            return None
        i += len(step)
    return name, i - 1


def _string_end(text: str, i: int) -> int | None:
    """The index past the JSON string that opens at text[i]; None while it is still open
    (i + 1 when text[i] is no quote: json.loads then refuses that character)."""
    if text[i] != '"':
        return i + 1
    escaped = False
    for j in range(i + 1, len(text)):
        if escaped:
            escaped = False
        elif text[j] == "\\":
            escaped = True
        elif text[j] == '"':
            return j + 1
    return None


class StreamedCall:
    """One call object of a JSON format as its text arrives, its arguments streamed: once the
    text is certain to be a call, `{"name": "get_weather", "arguments": {` (the layout models and
    our grammars write), its id and name go out, then each piece of the arguments object's text as
    it arrives, up to and with its closing brace; their concatenation is the arguments exactly as
    the model wrote them (JSON that parses to what a whole reading gives). From that point on it
    is a call, whatever follows (a client streaming OpenAI's fragments cannot take one back): an
    end before the arguments close leaves them cut, what follows them in the object is not read.
    Any other layout (arguments first or as a string, none) is `whole`: the parser reads the
    object once it closed, as before."""

    def __init__(self, parser: ToolParser, keys: tuple[str, ...] = ("arguments", "parameters")):
        self.parser, self.keys = parser, keys
        self.whole = False
        self.started = False  # its id and name went out (or it was dropped past max_calls)
        self.index: int | None = None
        self.sent = 0  # the object's text[:sent] is sent (or, before the arguments, read)
        self.closed = False  # the arguments' closing brace was sent
        self._scan: BracketScanner | None = None

    def feed(self, text: str, stop: int | None = None) -> list[ToolCallDelta]:
        """The deltas text[:stop] adds (text: the object's text so far, which only grows between
        calls; stop: where what may still be past the call begins, a closing tag's possible start)."""
        stop = len(text) if stop is None else stop
        deltas = []
        if self.whole or self.closed:
            return deltas
        if not self.started:
            found = call_start(text[:stop], self.keys)
            if not found:
                self.whole = found is False
                return deltas
            name, self.sent = found
            self.started, self.index = True, self.parser.start_call()
            self._scan = BracketScanner(start=self.sent)
            if self.index is not None:
                deltas.append(ToolCallDelta(self.index, id=self.parser.new_id(), name=name))
        end = self._scan.end(text, stop)
        self.closed = end is not None
        return deltas + self._arguments(text, stop if end is None else end)

    def cut(self, text: str) -> list[ToolCallDelta]:
        """At the call's end before its arguments closed (end of output, a closing tag): the rest."""
        return [] if self.whole or self.closed or not self.started else self._arguments(text, len(text))

    def _arguments(self, text: str, upto: int) -> list[ToolCallDelta]:
        piece, self.sent = text[self.sent:upto], max(self.sent, upto)
        return [ToolCallDelta(self.index, arguments=piece)] if piece and self.index is not None else []


class BracketScanner:
    """Where the bracketed value that opens at text[0] closes ({...} or [...] in JSON; with
    quotes="'\"" a Python expression), across pushes: each character is looked at once, however
    the text arrives (rescanning from the start at every token would be quadratic in the call's
    length). The text between is not validated here."""

    def __init__(self, quotes: str = '"', start: int = 0):
        self.quotes = quotes
        self.opens, self.closes = ("{[(", ")]}") if "'" in quotes else ("{[", "]}")
        self.depth = 0
        self.quote = None  # the quote of the string we are in
        self.escaped = False
        self.pos = start  # text[:pos] already scanned (the value opens at text[start])

    def end(self, text: str, stop: int | None = None) -> int | None:
        """The index just past the value in `text` (which only grows between calls), or None
        while it is still open (in text[:stop], when stop is given)."""
        stop = len(text) if stop is None else stop
        for i in range(self.pos, stop):
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
        self.pos = max(self.pos, stop)
        return None


class HiddenMarkers:
    """Content with the given markers taken out, as it streams: a marker kept in the text only for
    the parser (a special token the client did not ask to see) never reaches the client, even
    where the parser leaves it in the content (a marker that opens no call). A possible start of
    one at the end is held back until the next piece decides."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers = markers
        self._pending = ""

    def push(self, text: str) -> str:
        text = self._pending + text
        for marker in self.markers:
            text = text.replace(marker, "")
        held = max(partial_tag(text, marker) for marker in self.markers)
        self._pending = text[len(text) - held:] if held else ""
        return text[:len(text) - held]

    def finish(self) -> str:
        text, self._pending = self._pending, ""
        return text


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the next piece decides)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
