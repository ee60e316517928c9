"""Incremental detokenization with the real SmolLM2 tokenizer: streamed text == full decode,
and no streamed piece ever ends inside a multi-byte character."""

from __future__ import annotations

import os

import pydoc_data.topics
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native_backend.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from native_backend.text.stop import StopStringMatcher
from native_backend.config.default_model import default_gguf_path
from native_backend.text.tokenizer import Tokenizer, gguf_tokenizer_dir

TEXT = "\n".join(pydoc_data.topics.topics[t] for t in ("assert", "class", "formatstrings", "lambda"))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(request, tmp_path_factory) -> Tokenizer:
    """The GGUF's tokenizer (extracted once into pytest's cache; see test_tokenizer.py)."""
    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("kvgate-tokenizer") if cache else tmp_path_factory.mktemp("tokenizer")
    backend = tokenizers.Tokenizer.from_file(
        os.path.join(gguf_tokenizer_dir(default_gguf_path(), cache_dir), "tokenizer.json"))
    return Tokenizer(backend, chat_template=None, special_tokens_map={}, eos_token_ids=[2])


def stream(tok: Tokenizer, ids: list[int], chunk_sizes: list[int], prompt: list[int] = ()) -> list[str]:
    """Push ids in chunks (sizes cycle); return the pieces, the flush last."""
    detok = IncrementalDetokenizer(tok, prompt)
    pieces, position, i = [], 0, 0
    while position < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)] if chunk_sizes else 1
        pieces.append(detok.push(ids[position:position + size]))
        position, i = position + size, i + 1
    pieces.append(detok.flush())
    return pieces


@SETTINGS
@given(data=st.data())
def test_streamed_text_equals_full_decode_on_real_text(tok, data):
    ids = tok.encode(TEXT)
    start = data.draw(st.integers(0, len(ids) - 1))
    window = ids[start:start + data.draw(st.integers(1, 200))]
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=5))
    assert "".join(stream(tok, window, chunks)) == tok.decode(window)


# Clusters of 1-4 byte characters (emoji ZWJ sequences, flags, combining accents included).
MULTIBYTE = st.lists(
    st.sampled_from(list("日本語の漢字한국어中文ไทยΩé") + ["🦙", "🔥", "👩‍👩‍👧", "🇫🇷", "e\u0301", " ", "\n", "a"]),
    min_size=1, max_size=30).map("".join)


@SETTINGS
@given(text=MULTIBYTE, chunks=st.lists(st.integers(1, 3), max_size=4))
def test_split_characters_are_held_back_until_complete(tok, text, chunks):
    ids = tok.encode(text)
    pieces = stream(tok, ids, chunks)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_emoji_bytes_arrive_over_several_tokens(tok):
    ids = tok.encode("🦙")
    assert len(ids) > 1  # byte-level BPE splits it: the case this module exists for
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in ids] == [""] * (len(ids) - 1) + ["🦙"]
    assert detok.flush() == ""


@SETTINGS
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=60), chunks=st.lists(st.integers(1, 3), max_size=4))
def test_streamed_text_equals_full_decode_on_random_ids(tok, ids, chunks):
    # Random ids include specials (skipped) and stray UTF-8 fragments that never complete.
    pieces = stream(tok, ids, chunks)
    assert "".join(pieces) == tok.decode(ids)
    assert not any(piece.endswith(REPLACEMENT_CHAR) for piece in pieces[:-1])


def test_dangling_partial_character_is_released_at_finish(tok):
    partial = tok.encode("🦙")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("ok ")) == "ok "
    assert detok.push(partial) == ""
    assert detok.flush() == tok.decode(partial) and detok.flush() == ""


def test_prompt_tail_gives_context_to_the_first_output_token(tok):
    prompt = tok.encode("The quick brown fox")
    output = tok.encode("The quick brown fox jumps over")[len(prompt):]
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.push([t]) for t in output) + detok.flush() == " jumps over"


def test_special_tokens_are_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>", parse_special=True)
    assert "".join(stream(tok, ids, [1])) == "hi"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "<|im_start|>hi<|im_end|>"


def test_memory_stays_bounded_on_long_outputs(tok):
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == TEXT
    assert len(detok._window) <= 8  # only the last emitted tokens are kept as context


@pytest.mark.parametrize("stop, expected", [
    ("lo wor", "Hel"),  # spans the tokens "Hello" and " world"
    ("🦙", "Hello world, "),  # inside one character's bytes, spread over several tokens
    ("nowhere", "Hello world, 🦙 llama"),
])
def test_stop_strings_spanning_tokens_through_the_detokenizer(tok, stop, expected):
    """The engine's text path: token ids -> detokenizer -> stop matcher, one token per step."""
    ids = tok.encode("Hello world, 🦙 llama")
    detok, stops = IncrementalDetokenizer(tok), StopStringMatcher([stop])
    emitted, stopped = [], False
    for token in ids:
        text, stopped = stops.push(detok.push([token]))
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        text, stopped = stops.finish(detok.flush())
        emitted.append(text)
    assert "".join(emitted) == expected
    assert stopped == (stop != "nowhere")
