"""Grammars for constrained decoding, compiled against the model's own tokenizer (llguidance).

    GrammarSpec ──GrammarCompiler.compile()──> Grammar ──.matcher()──> GrammarMatcher (one per request)
    (kind, text, the request         (compiled once; a      fill_bitmask(row) before each sampled token,
     parameter it came from)          cache holds it)        accept(token) after it

Why llguidance (measured on SmolLM2's tokenizer, docs/engine/structured-outputs.md): no compile
step worth caching beyond the parser itself (~1 ms for a JSON schema, where xgrammar spends tens
of ms precomputing token masks), masks in tens of microseconds per row, no dependency (xgrammar
pulls torch, transformers and triton into this torch-free layer), and a matcher that reports
errors as state instead of raising mid-batch.

Bitmask layout (llguidance's and xgrammar's): int32 words, token t allowed iff bit t % 32 of word
t // 32 is set. Tokens past the tokenizer's vocabulary (padding rows of the LM head) are never
allowed. Torch-free: the core fills masks, execution applies them to the logits.
"""

from __future__ import annotations

import llguidance
import numpy as np

from native_backend.text.grammar_spec import JSON_LAYOUT, GrammarError, GrammarSpec, is_limit_error, limit_message, short
from native_backend.text.tokenizer import Tokenizer

# Bounds on the work one grammar may cost the engine, per parser step and to build (llguidance's
# fuel units). The lexer's fuel is a tenth of llguidance's defaults (1M initial, 200k per step):
# ^((x{100}){100}){100}$ compiled in milliseconds, then its first mask built the lexer for 5.3 s and
# ~170 MB on the step loop (SmolLM2's tokenizer, a loaded 2-core box); at 100k / 20k it takes
# ~0.3-0.4 s and ~13 MB in the compile worker and fails on its lexer limit, while the structured
# battery (bench/structured_battery.py) and the tests' schemas compile and mask as before.
PARSER_LIMITS = dict(step_lexer_fuel=20_000, step_max_items=50_000, initial_lexer_fuel=100_000,
                     max_grammar_size=500_000)


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and what came."""

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int, spec: GrammarSpec | None = None):
        self._matcher = matcher
        self.num_words = num_words  # int32 words of a bitmask row: ceil(vocab / 32)
        self.spec = spec  # what it was compiled from (its cache key and the parameter it names)

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (num_words int32, C-contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it (the matcher is
        then in its error state: `error`)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and can take nothing more (its output ends here)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


class Grammar:
    """A compiled constraint; `matcher()` starts a request at its beginning (cheap: a copy)."""

    def __init__(self, spec: GrammarSpec, pristine: llguidance.LLMatcher, num_words: int):
        self.spec = spec
        self._pristine = pristine
        self._num_words = num_words
        self.nbytes = 0  # what the cache charges for it (GrammarService: measured by warm())

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy(), self._num_words, self.spec)

    def warm(self) -> None:
        """Build what the first token's mask needs, here (the compile worker, under its deadline),
        not on the step loop: llguidance builds the lexer lazily, on the first mask, and the copies
        `matcher()` makes share what the pristine matcher built. Then one step down the first
        allowed token, on a copy: a lexer that blows its limit there fails the compile (a 400
        naming the parameter) instead of the request's first token (a 500)."""
        row = np.zeros(self._num_words, dtype=np.int32)
        self._pristine.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._raise_on_error(self._pristine)
        words = np.flatnonzero(row)
        if not len(words) or self._pristine.is_stopped():
            return
        word = int(words[0])
        probe = self._pristine.deep_copy()
        probe.consume_token(word * 32 + (int(row[word]) & -int(row[word])).bit_length() - 1)
        if not probe.is_error():
            probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._raise_on_error(probe)

    def _raise_on_error(self, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_error():
            error = matcher.get_error()
            raise GrammarError(limit_message(self.spec.param, error) if is_limit_error(error)
                               else f"{self.spec.param}: {short(error)}")


class GrammarCompiler:
    """Compiles specs against one tokenizer. Thread-safe (llguidance drops the GIL while it
    builds a parser, so compiles on a worker thread do not hold the engine's step loop)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int):
        """vocab_size: the LM head's rows (the logits' width), which may exceed the tokenizer's."""
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                 eos_token=eos_token_id)
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The spec as a grammar, or GrammarError naming spec.param and the library's reason."""
        try:
            source = _llguidance_grammar(spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{spec.param}: {short(str(exc))}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0, limits=self._limits)
        if matcher.is_error():
            error = matcher.get_error()
            raise GrammarError(limit_message(spec.param, error) if is_limit_error(error)
                               else f"{spec.param}: {short(error)}")
        return Grammar(spec, matcher, self.num_words)


def _llguidance_grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar text for a spec (raises ValueError for text it cannot read)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_LAYOUT)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    # vLLM's `grammar`: GBNF / EBNF (rules with ::=) or Lark.
    return llguidance.grammar_from("gbnf" if "::=" in spec.text else "lark", spec.text)
