"""Stop strings across token boundaries: never emitted, held back while ambiguous, and the
result independent of how the text was split."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from native_backend.text.stop import StopStringMatcher


def feed(stop: list[str], pieces: list[str]) -> tuple[str, bool, list[str]]:
    """Run the matcher like the engine does; return (all emitted text, stopped, emitted pieces)."""
    matcher = StopStringMatcher(stop)
    emitted = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True, emitted
    emitted.append(matcher.flush())
    return "".join(emitted), False, emitted


def reference(stop: list[str], text: str) -> tuple[str, bool]:
    """On the whole text: cut before the stop string that ends first (then starts first)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s and s in text]
    if not hits:
        return text, False
    return text[:min(hits)[1]], True


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


def test_stop_string_split_over_pieces_is_not_emitted():
    assert feed(["\nUser:"], ["Hel", "lo\nUs", "er: hi"]) == ("Hello", True, ["Hel", "lo", ""])


def test_ambiguous_text_is_held_then_released():
    matcher = StopStringMatcher(["\nUser:"])
    assert matcher.push("abc\nUs") == ("abc", False)  # "\nUs" could start the stop string
    assert matcher.push("ed it") == ("\nUsed it", False)  # it did not
    assert matcher.push("\n") == ("", False)
    assert matcher.flush() == "\n"  # finished for another reason: release what was held


def test_the_stop_string_that_ends_first_wins():
    # "c" completes before "abcd" could: generation would already have stopped there.
    assert feed(["abcd", "c"], ["ab", "cd"])[:2] == ("ab", True)
    assert feed(["abcd", "c"], ["abcd"])[:2] == ("ab", True)
    # Same end: the longer (earlier-starting) one wins.
    assert feed(["bc", "abc"], ["xab", "c"])[:2] == ("x", True)


def test_finish_releases_held_text_unless_the_last_text_stops():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("a</") == ("a", False)
    assert matcher.finish("x") == ("</x", False)
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("a</") == ("a", False)
    assert matcher.finish("s>tail") == ("", True)


def test_after_a_stop_nothing_more_comes_out():
    matcher = StopStringMatcher(["END"])
    assert matcher.push("done. END and more") == ("done. ", True)
    assert matcher.matched == "END"
    assert matcher.push("still more") == ("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_pass_text_through():
    matcher = StopStringMatcher(["", ""])  # empty stop strings are ignored, not matched everywhere
    assert matcher.push("anything") == ("anything", False)
    assert matcher.flush() == ""


ALPHABET = st.text(alphabet="ab\n:", max_size=30)


@settings(max_examples=300, deadline=None)
@given(text=ALPHABET, stop=st.lists(st.text(alphabet="ab\n:", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_streaming_matches_the_whole_text_answer(text, stop, cuts):
    emitted, stopped, _ = feed(stop, split(text, cuts))
    assert (emitted, stopped) == reference(stop, text)


@settings(max_examples=300, deadline=None)
@given(text=ALPHABET, stop=st.lists(st.text(alphabet="ab\n:", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_holds_back_exactly_the_ambiguous_suffix(text, stop, cuts):
    """Before a stop, what is held is the longest suffix that could still start a stop string:
    no stop text leaks out early, and nothing else waits."""
    matcher = StopStringMatcher(stop)
    seen, emitted = "", ""
    for piece in split(text, cuts):
        out, stopped = matcher.push(piece)
        if stopped:
            return
        seen, emitted = seen + piece, emitted + out
        held = seen[len(emitted):]
        assert seen.startswith(emitted)
        assert held == max((seen[len(seen) - k:] for s in stop for k in range(len(s))
                            if seen.endswith(s[:k])), key=len)
