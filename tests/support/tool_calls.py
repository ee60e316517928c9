"""Driving a tool-call parser as the engine's stream does: pieces pushed in turn, then finish."""

from __future__ import annotations


def parse(parser, pieces):
    """(content, deltas) of `pieces` pushed one after another and the parser's finish."""
    content, deltas = "", []
    for piece in pieces:
        text, found = parser.push(piece)
        content, deltas = content + text, deltas + found
    text, found = parser.finish()
    return content + text, deltas + found
