"""What a request constrains its output with, as plain data (no grammar library imported here:
the gateway side builds these, the engine process compiles them with text.grammar)."""

from __future__ import annotations

import json
from dataclasses import dataclass

# OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs (json, regex,
# choice, grammar: GBNF/EBNF or Lark, json_object), and Lark the plugin writes itself (tool calls).
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")


# How constrained JSON is laid out (llguidance's JSON options; for a schema inside a Lark grammar,
# its "x-guidance" key): Python's separators and no other whitespace, since free whitespace lets a
# small model pad its output with newlines until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint the grammar library refuses; the message is `param: the library's reason`."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint as plain data (it crosses the engine process's pipe).

    kind: one of KINDS. text: the JSON schema (JSON text), the regex, the choices (a JSON list of
    strings), the grammar (Lark or GBNF/EBNF; lark: Lark only); empty for json_object. param: the request
    parameter it came from (`response_format`, `structured_outputs.regex`, ...), named by errors.
    JSON is written with Python's separators (", " and ": ") and no other whitespace: free
    whitespace lets a small model pad its output with newlines until max_tokens."""

    kind: str
    text: str = ""
    param: str = "response_format"

    @property
    def key(self) -> tuple[str, str]:
        """What makes two constraints compile to the same grammar (the compile cache's key)."""
        return (self.kind, self.text)

    def check(self, max_bytes: int) -> None:
        """Refuse (GrammarError) a spec that is malformed or larger than max_bytes, before any work."""
        if self.kind not in KINDS:
            raise GrammarError(f"{self.param}: unknown constraint kind {self.kind!r} (known: {', '.join(KINDS)})")
        size = len(self.text.encode())
        if size > max_bytes:
            raise GrammarError(f"{self.param}: the constraint is {size} bytes, over this server's limit of "
                               f"{max_bytes} for a constraint to compile")
        if self.kind == "choice":
            try:
                choices = json.loads(self.text)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise GrammarError(f"{self.param}: choice must be a non-empty list of non-empty strings")


LIMIT_WORDS = ("lexer error", "fuel", "too many", "max_items", "limit")  # llguidance's limit errors say so


def is_limit_error(message: str) -> bool:
    """Whether a matcher's error is one of llguidance's work limits (the constraint is too complex
    for this server: the client's to simplify), not a bug."""
    lowered = message.lower()
    return any(word in lowered for word in LIMIT_WORDS)


def limit_message(param: str, error: str) -> str:
    return (f"{param}: the constraint is too complex for this server's grammar limits (simplify the "
            f"pattern or schema): {short(error)}")


def short(message: str, limit: int = 300) -> str:
    """A library message cut to `limit` characters: it may quote the client's whole schema."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
