"""Incremental detokenization: turn each step's new token ids into the new text they add.

Decoding one token at a time is wrong twice over: a byte-level token can hold half of a UTF-8
character (decoding it alone gives U+FFFD), and sentencepiece decoders drop the leading space
of the first token they see. So, as vLLM does, decode a small window that starts a few tokens
back and keep only what the newest tokens added:

    ids:   ... | prefix_offset ........ read_offset | new tokens ........ |
                 [ prefix_text: already emitted   ]
                 [ window_text = decode(ids[prefix_offset:])               ]
    emit window_text[len(prefix_text):] unless it ends in U+FFFD (a character still arriving);
    then slide: prefix_offset = read_offset, read_offset = len(ids).
    (Here the window list starts at prefix_offset, so prefix_offset is always 0.)

Held-back text is not lost: the window keeps growing until the character completes, and
flush() releases whatever remains when the request finishes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens (vLLM uses 5 too).
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed it each step's token ids; it returns text that will not change any more.

    It keeps only the window: the tokens of the last emitted text (prefix) and the tokens not
    yet emitted, so memory does not grow with the output.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (),
                 *, skip_special_tokens: bool = True, dropped_ids: Collection[int] | None = None):
        """dropped_ids: the tokens left out of the text, all others decoded special tokens included
        (the special tokens but those a tool parser reads); it overrides skip_special_tokens."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens if dropped_ids is None else False
        self._dropped_ids = None if dropped_ids is None else frozenset(dropped_ids)
        # The tail of the prompt is the context of the first output tokens.
        self._window: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._num_prefix_tokens = len(self._window)
        self._prefix_text = self._decode(self._window)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new tokens; return the text that is now certain (possibly empty)."""
        self._window.extend(token_ids)
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (e.g. a skipped special), or a character still incomplete
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of the request: the text still held back (a dangling U+FFFD included)."""
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        new_text = window_text[len(self._prefix_text):]
        # Slide: the tokens just emitted become the prefix, older ones are never decoded again.
        del self._window[:self._num_prefix_tokens]
        self._num_prefix_tokens = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        if self._dropped_ids is not None:
            token_ids = [t for t in token_ids if t not in self._dropped_ids]
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
