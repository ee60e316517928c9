"""Tool-call parsers of the native engine, chosen per deployment (`settings.tool_call_parser`,
like vLLM's --tool-call-parser) from the `kvgate.tool_parsers` entry-point group.

kvgate's own (hermes, llama3_json, mistral, pythonic) are declared in that group by the native plugin's
pyproject.toml, as a third party declares one:

    [project.entry-points."kvgate.tool_parsers"]
    my_format = "my_package.module:MyParser"     # a ToolParser subclass (base.py)

BUILTIN repeats our declarations so that an install whose metadata predates them (an editable
install not reinstalled since) still finds ours; tests check the two agree."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from kvgate_native.tool_parsers.base import ToolParser

ENTRY_POINT_GROUP = "kvgate.tool_parsers"
DEFAULT = "hermes"
BUILTIN = {
    "hermes": "kvgate_native.tool_parsers.hermes:HermesParser",
    "llama3_json": "kvgate_native.tool_parsers.llama3_json:Llama3JsonParser",
    "mistral": "kvgate_native.tool_parsers.mistral:MistralParser",
    "pythonic": "kvgate_native.tool_parsers.pythonic:PythonicParser",
}
REQUIRED = ("push", "finish", "grammar", "system_prompt", "render_calls", "render_result")

__all__ = ["DEFAULT", "ENTRY_POINT_GROUP", "ToolParser", "known_parsers", "tool_parser"]


def known_parsers() -> dict[str, list[EntryPoint]]:
    """Every registered name and the entry points that claim it (ours first)."""
    known = {name: [EntryPoint(name, value, ENTRY_POINT_GROUP)] for name, value in BUILTIN.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        claims = known.setdefault(ep.name, [])
        if all(ep.value != other.value for other in claims):
            claims.append(ep)
    return known


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the known ones otherwise (and
    when two distributions register different parsers under one name, or it lacks a method)."""
    known = known_parsers()
    claims = known.get(name)
    if not claims:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(known))}")
    if len(claims) > 1:
        raise ValueError(f"tool call parser {name!r} is registered twice ({', '.join(ep.value for ep in claims)}); "
                         "uninstall one of them")
    try:
        parser = claims[0].load()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tool call parser {name!r} ({claims[0].value}) cannot be loaded: {exc}") from None
    missing = [method for method in REQUIRED if not callable(getattr(parser, method, None))]
    if missing:
        raise ValueError(f"tool call parser {name!r} ({claims[0].value}) lacks {', '.join(missing)} "
                         "(see kvgate_native.tool_parsers.base.ToolParser)")
    return parser
