"""Python-style tool calls (vLLM's `pythonic` and `llama4_pythonic`; Llama 3.2 / 4 and
ToolACE-style models):

    [get_weather(city="Oslo", unit="c"), get_time()]
    <|python_start|>[get_weather(city="Oslo")]<|python_end|>     (Llama 4 may wrap the list)

An output is calls when it begins (after whitespace, and after Llama 4's `<|python_start|>`) with
a Python list whose every element is a call of a plain name with keyword arguments only, each a
literal (JSON's true / false / null are read as True / False / None). Anything else is content,
in full, a wrapper with it: an output that begins otherwise, a list that is no such list or is
still open at the end. A `<|python_end|>` right after the list is dropped; other text after it is
content. (The two wrapper tokens are special in Llama 4's tokenizer: a request with tools keeps
them in the engine's text for this parser, out of the content; where they were left out, the list
alone is what it reads.) The calls are sent whole once the list closed:
their arguments are Python, re-written as JSON."""

from __future__ import annotations

import ast
import json

from gateway.backend import ToolCallDelta
from gateway.errors import InvalidRequestError
from kvgate_native.tool_parsers.base import BracketScanner, ToolParser
from native_backend.text.grammar_spec import JSON_LAYOUT

SYSTEM_PROMPT = (
    "You can call these functions (JSON Schema of each below). To call them, answer with nothing but a Python "
    "list of the calls, with keyword arguments: [func_name(param_name=value, ...), ...]. Use values, not "
    "variables.\n\n{tools}")
JSON_NAMES = {"true": True, "false": False, "null": None}
START, CALLS, AFTER, TEXT = "start", "calls", "after", "text"  # undecided; the list; past it; content to the end
PY_START, PY_END = "<|python_start|>", "<|python_end|>"  # Llama 4's wrapper of its calls


class PythonicParser(ToolParser):
    name = "pythonic"
    special_markers = (PY_START, PY_END)
    system_prompt_template = SYSTEM_PROMPT

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._state = START
        self._pending = ""
        self._lead = ""  # whitespace before the list: content again if it is no list of calls
        self._scan = BracketScanner(quotes="'\"")

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        deltas = []
        if self._state == START:
            body = _after_wrapper(self._pending)
            if body is None:
                return "", []
            self._state = CALLS if body[:1] == "[" else TEXT
            if self._state == CALLS:  # the list starts _pending; what is before it is no call's
                self._lead, self._pending = self._pending[: len(self._pending) - len(body)], body
        if self._state == CALLS:
            end = self._scan.end(self._pending)
            if end is None:
                return "", []
            calls = _calls(self._pending[:end])
            self._state = TEXT
            if calls is None:
                self._pending = self._lead + self._pending
            else:
                deltas = [delta for call in calls for delta in self.emit(*call)]
                self._pending, self._state = self._pending[end:], AFTER
        if self._state == AFTER:  # whitespace after the calls is dropped unless text follows
            rest = self._pending.lstrip()
            if rest.startswith(PY_END):  # the wrapper's end
                self._pending = rest = rest[len(PY_END):]
            elif rest and PY_END.startswith(rest):
                return "", deltas  # the next piece decides
            if not rest.strip():
                return "", deltas
            self._pending, self._state = self._pending.lstrip(), TEXT
        content, self._pending = self._pending, ""
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest, self._pending = self._pending, ""
        if self._state == CALLS:
            rest = self._lead + rest
        return ("" if self._state == AFTER and not rest.strip() else rest), []

    @classmethod
    def lark(cls, allowed: list[dict], single: bool) -> str:
        rules = [f"call_{i}: {_call_rule(tool['function'])}" for i, tool in enumerate(allowed)]
        call = " | ".join(f"call_{i}" for i in range(len(allowed)))
        more = "" if single else ' (", " call)*'
        return "\n".join([f'start: "[" call{more} "]"', f"call: {call}", *rules]) + "\n"


    @classmethod
    def render_calls(cls, calls: list[tuple[str, object]]) -> str:
        def argument(value) -> str:
            return repr(value) if value is None or isinstance(value, bool) else json.dumps(value)

        def call(name, arguments) -> str:
            arguments = arguments if isinstance(arguments, dict) else {}
            return f"{name}({', '.join(f'{k}={argument(v)}' for k, v in arguments.items())})"

        return f"[{', '.join(call(name, arguments) for name, arguments in calls)}]"


def _after_wrapper(text: str) -> str | None:
    """`text` (an output's start) from where its list would begin: after whitespace, and after
    `<|python_start|>` and whitespace when it opens with that; None while it cannot tell."""
    stripped = text.lstrip()
    if PY_START.startswith(stripped):  # nothing yet, or a possible start of the wrapper
        return None
    if stripped.startswith(PY_START):
        stripped = stripped[len(PY_START):].lstrip()
        if not stripped:
            return None
    return stripped


def _calls(text: str) -> list[tuple[str, dict]] | None:
    """(name, arguments) of each call in a Python list of keyword-argument calls; None when the
    text is not that."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # no Python, or nested too deep
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords}
        except (ValueError, RecursionError):
            return None
        if None in arguments:  # **kwargs
            return None
        calls.append((node.func.id, arguments))
    return calls


def _literal(node: ast.expr):
    """A literal's value, JSON's true / false / null read as Python's; ValueError otherwise."""
    class JsonNames(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name):
            if name.id in JSON_NAMES:
                return ast.copy_location(ast.Constant(JSON_NAMES[name.id]), name)
            return name

    return ast.literal_eval(JsonNames().visit(node))


def _call_rule(function: dict) -> str:
    """Lark for one tool's call: its name, then its parameters' properties as keyword arguments
    in the schema's order, the required ones always, each value JSON valid against its schema
    (a boolean written True / False; other values as JSON, which Python reads alike)."""
    parameters = function.get("parameters") or {}
    properties = list((parameters.get("properties") or {}).items())
    required = set(parameters.get("required") or ())
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    for what in [function["name"]] + [key for key, _ in properties]:
        if not what.isidentifier():
            raise InvalidRequestError(f"The pythonic tool-call format cannot write '{what}' of tool "
                                      f"'{function['name']}' (not a Python identifier).", param="tools")
    values = [_value(schema, defs) for _, schema in properties]
    args = [f'"{key}=" {value}' for (key, _), value in zip(properties, values)]
    optional = [key not in required for key, _ in properties]

    def after(i: int) -> str:  # the arguments from i on, once one was written
        if i == len(args):
            return ""
        item = f'", " {args[i]}'
        return f"({item})? {after(i + 1)}".strip() if optional[i] else f"{item} {after(i + 1)}".strip()

    def first(i: int) -> str:  # the arguments from i on, none written yet
        if i == len(args):
            return ""
        this = f"{args[i]} {after(i + 1)}".strip()
        if not optional[i]:
            return this
        rest = first(i + 1)
        return f"({this} | {rest})" if rest else f"({this})?"

    return f'"{function["name"]}(" {first(0)} ")"'.replace("  ", " ")


def _value(schema, defs: dict) -> str:
    if isinstance(schema, dict) and schema.get("type") == "boolean" and "enum" not in schema:
        return '("True" | "False")'
    schema = schema if isinstance(schema, dict) else {}
    return f"%json {json.dumps({**schema, **defs, 'x-guidance': JSON_LAYOUT})}"
