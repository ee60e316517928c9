"""The native engine's tool-call parsers (settings.tool_call_parser, like vLLM's --tool-call-parser):
each format streamed in every split gives the calls of the whole text; text that is no call stays
content; parallel_tool_calls false keeps one call; each parser's grammar (compiled by llguidance
against SmolLM2's tokenizer) admits what that parser reads and refuses the rest; the registry finds
ours and a third party's through the `kvgate.tool_parsers` entry-point group."""

import json
import textwrap
from importlib.metadata import entry_points

import pydantic
import pytest

from gateway.errors import InvalidRequestError

from kvgate_native.backend import NativeBackend, make_native_backend
from kvgate_native.settings import NativeSettings
from kvgate_native.tool_parsers import BUILTIN, ENTRY_POINT_GROUP, tool_parser
from kvgate_native.tool_parsers.hermes import HermesParser
from kvgate_native.tool_parsers.llama3_json import Llama3JsonParser
from kvgate_native.tool_parsers.mistral import MistralParser
from kvgate_native.tool_parsers.pythonic import PythonicParser
from kvgate_native.tools import with_tools
from native_backend.model.loader import default_gguf_path
from native_backend.text.grammar import GrammarCompiler
from native_backend.text.tokenizer import Tokenizer, gguf_tokenizer_dir
from tests.support.tool_calls import parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: no arguments
OSLO = ("get_weather", {"city": "Oslo; {not} [a] \"call\""})  # separators and brackets inside a string
NOW = ("get_time", {})


def calls(deltas):
    """The fragments put together the way a client does: by index; each call's first fragment
    carries its id and name and no arguments, the later ones arguments alone."""
    out = {}
    for d in deltas:
        if d.index not in out:
            assert d.id and d.name and not d.arguments
            out[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
            out[d.index][1] += d.arguments
    return [(name, json.loads(arguments)) for name, arguments in (out[i] for i in sorted(out))]


def every_split(cls, text):
    """The whole text, every cut in two, and one character at a time: (content, calls) of each."""
    ways = [[text], list(text)] + [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    results = []
    for pieces in ways:
        content, deltas = parse(cls(), pieces)
        results.append((content, calls(deltas)))
    return results


def hermes(*found):
    return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n' for n, a in found)


def llama(*found):
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in found)


def mistral(*found):
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in found])


def mistral11(*found):
    """Mistral's v11+ form: each call its own marker, its name, [ARGS] and its arguments."""
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in found)


def pythonic(*found):
    return PythonicParser.render_calls(list(found))


# (parser, text, content, calls): what each format reads
CASES = [
    (HermesParser, "Let me see. " + hermes(OSLO, NOW), "Let me see. ", [OSLO, NOW]),
    (Llama3JsonParser, llama(OSLO, NOW), "", [OSLO, NOW]),
    (Llama3JsonParser, "<|python_tag|>" + llama(OSLO), "", [OSLO]),
    (Llama3JsonParser, '\n {"name": "get_time", "arguments": {}};\n' + llama(OSLO), "", [NOW, OSLO]),
    (Llama3JsonParser, llama(NOW) + "\n\nThat is all.", "That is all.", [NOW]),
    (MistralParser, "Let me see. " + mistral(OSLO, NOW), "Let me see. ", [OSLO, NOW]),
    (MistralParser, '[TOOL_CALLS] {"name": "get_time", "arguments": "{}"}', "", [NOW]),  # one object, text args
    (MistralParser, mistral(OSLO) + " " + mistral(NOW), "", [OSLO, NOW]),
    (MistralParser, " " + mistral(OSLO).removeprefix("[TOOL_CALLS]"), "", [OSLO]),  # the marker skipped as special
    (MistralParser, "Let me see. " + mistral11(OSLO, NOW), "Let me see. ", [OSLO, NOW]),
    (MistralParser, '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS] {}' + mistral11(OSLO), "", [NOW, OSLO]),
    (MistralParser, '[TOOL_CALLS]get_time{}\n' + mistral(OSLO), "", [NOW, OSLO]),  # no [ARGS] (vLLM reads it so)
    (MistralParser, mistral11(NOW) + " Done.", " Done.", [NOW]),
    (PythonicParser, pythonic(OSLO, NOW), "", [OSLO, NOW]),
    (PythonicParser, "\n[get_weather(city='Oslo', unit=\"c\", days=[1, 2], hot=True, cold=false, x=None)]  \n",
     "", [("get_weather", {"city": "Oslo", "unit": "c", "days": [1, 2], "hot": True, "cold": False, "x": None})]),
    (PythonicParser, "[get_time()]\n\nDone.", "Done.", [NOW]),
    (PythonicParser, "<|python_start|>" + pythonic(OSLO, NOW) + "<|python_end|>", "", [OSLO, NOW]),  # Llama 4
    (PythonicParser, " <|python_start|>\n[get_time()] <|python_end|>\n\nDone.", "Done.", [NOW]),
]
# (parser, text): no call, all content, as the model wrote it
NOT_CALLS = [
    (HermesParser, "<tool_call>not json</tool_call>"),
    (HermesParser, '<tool_call>{"name": "get_time", "argu'),  # cut before its arguments began
    (Llama3JsonParser, 'I would call {"name": "get_time", "parameters": {}} now.'),  # not at the start
    (Llama3JsonParser, '{"city": "Oslo"} is a city.'),  # no name
    (Llama3JsonParser, '<|python_tag|>print("hi")'),  # code, not JSON
    (Llama3JsonParser, '  {"name": "get_time", "parame'),  # still open at the end, before its arguments
    (Llama3JsonParser, '{"name": "get_time", "parameters": [1]}'),  # arguments no object
    (Llama3JsonParser, "<|python"),
    (MistralParser, "Use [TOOL_CALLS] like this: nothing."),
    (MistralParser, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"no": "name"}]'),  # one bad: all text
    (MistralParser, '[TOOL_CALLS][{"name": "get_time"'),  # still open at the end
    (MistralParser, "[TOOL_"),
    (MistralParser, "[1, 2] are numbers, [TOOL_CALLS] a marker."),
    (MistralParser, 'I would say [{"name": "get_time", "arguments": {}}]'),  # an array not at the start
    (MistralParser, "[TOOL_CALLS]hello there"),  # no name followed by [ARGS] or {
    (MistralParser, "[TOOL_CALLS]get_time[ARGS] nothing"),
    (MistralParser, "[TOOL_CALLS]get_time[CALL_ID]"),  # still open at the end, before its arguments
    (PythonicParser, "Call [get_time()] now."),  # not at the start
    (PythonicParser, "[1, 2] are numbers."),
    (PythonicParser, "[get_time(), 5]"),  # one element no call
    (PythonicParser, "[get_time('positional')]"),
    (PythonicParser, "[get_weather(city=input())]"),  # no literal
    (PythonicParser, "[os.system(cmd='x')]"),  # no plain name
    (PythonicParser, "[get_weather(city=')]'"),  # still open at the end
    (PythonicParser, "<|python_start|>print('hi')<|python_end|>"),  # Llama 4's wrapper around no list
    (PythonicParser, "<|python_start|>[get_time(), 5]<|python_end|>"),
    (PythonicParser, "<|python_start|>"),
]


@pytest.mark.parametrize("cls, text, content, expected", CASES, ids=lambda v: getattr(v, "name", None))
def test_every_split_of_the_stream_gives_the_calls_of_the_whole(cls, text, content, expected):
    for result in every_split(cls, text):
        assert result == (content, expected)


@pytest.mark.parametrize("cls, text", NOT_CALLS, ids=lambda v: getattr(v, "name", None))
def test_text_that_is_no_call_stays_content(cls, text):
    for result in every_split(cls, text):
        assert result == (text, [])


@pytest.mark.parametrize("cls, text", [
    (Llama3JsonParser, '{"name": "get_time", "parameters": {}}; {"broken'),
    (Llama3JsonParser, '{"name": "get_time", "parameters": {}}; {"name": 5}'),
])
def test_after_a_call_what_is_no_call_is_content(cls, text):
    for content, found in every_split(cls, text):
        assert found == [NOW] and content == text.split("; ", 1)[1]


@pytest.mark.parametrize("cls, text", [
    (HermesParser, hermes(NOW, OSLO, NOW)), (Llama3JsonParser, llama(NOW, OSLO, NOW)),
    (MistralParser, mistral(NOW, OSLO, NOW)), (MistralParser, mistral11(NOW, OSLO, NOW)),
    (PythonicParser, pythonic(NOW, OSLO, NOW)),
], ids=lambda v: getattr(v, "name", None))
def test_parallel_tool_calls_false_keeps_the_first_call(cls, text):
    content, deltas = parse(cls(max_calls=1), list(text))
    assert content == "" and calls(deltas) == [NOW]
    content, deltas = parse(cls(), [text])
    assert calls(deltas) == [NOW, OSLO, NOW] and len({d.id for d in deltas if d.id}) == 3


LONG = {"city": "Oslo", "note": "a " * 200 + "}{ \\\" </tool_call", "days": [[1, 2], {"x": None}]}


def arguments_text(deltas):
    return "".join(d.arguments for d in deltas)


@pytest.mark.parametrize("cls, text", [
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_weather", "parameters": %s}; {"name": "get_time"'),
    (MistralParser, "[TOOL_CALLS]get_weather[ARGS]%s"),
], ids=lambda v: getattr(v, "name", None))
def test_arguments_stream_as_they_are_written(cls, text):
    """Pieces of 7 characters (a model's tokens): the id and name as soon as the arguments begin,
    then their text in many fragments before the call closes, exactly the model's text (no closing
    brace or tag of the call in it: those are held back until the next piece decides)."""
    written = json.dumps(LONG, indent=1)  # newlines and spaces as the model wrote them
    text = text % written
    parser, before_close, deltas = cls(), None, []
    for cut in range(0, len(text), 7):
        deltas += parser.push(text[cut:cut + 7])[1]
        if before_close is None and len(arguments_text(deltas)) == len(written):
            before_close = len(deltas)
    deltas += parser.finish()[1]
    assert deltas[0].name == "get_weather" and deltas[0].id and arguments_text(deltas) == written
    assert before_close > 30 and all(d.arguments for d in deltas[1:])
    assert calls(deltas) == [("get_weather", LONG)]


@pytest.mark.parametrize("cls, text, content", [
    (HermesParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Os', ""),
    (HermesParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Os</tool_call>Hi', "Hi"),
    (HermesParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Os"}, x}</tool_call>', ""),
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Os', ""),
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Os"}, x}', ""),
    (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Os', ""),
], ids=lambda v: getattr(v, "name", None))
def test_once_its_arguments_began_a_call_is_a_call(cls, text, content):
    """What streamed cannot be taken back, so from its arguments' `{` on the text is that call:
    cut (the end, a closing tag) it has the arguments written so far; what follows them in the
    object is not read. Any split gives the same."""
    for pieces in [[text], list(text)]:
        got, deltas = parse(cls(), pieces)
        assert got == content and deltas[0].name == "get_weather"
        assert arguments_text(deltas) == '{"city": "Os' + ('"}' if "x}" in text else "")


def test_mistral_call_ids_are_nine_letters_and_digits():
    _, deltas = parse(MistralParser(), [mistral(NOW)])
    assert len(deltas[0].id) == 9 and deltas[0].id.isalnum()


# ------------------------------------------------------------------------------ the grammars


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    tokenizer = Tokenizer.from_pretrained(gguf_tokenizer_dir(default_gguf_path(), tmp_path_factory.mktemp("tok")))
    return tokenizer, GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids[0])


def accepts(compiler, cls, choice, parallel, text) -> bool:
    tokenizer, grammars = compiler
    matcher = grammars.compile(cls.grammar([WEATHER, TIME], choice, parallel)).matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = {"city": "Oslo", "unit": "c"}
# (parser, tool_choice, parallel_tool_calls, text, accepted)
GRAMMAR_CASES = [
    (Llama3JsonParser, "required", None, llama(("get_weather", ARGS), NOW), True),
    (Llama3JsonParser, "required", False, llama(NOW), True),
    (Llama3JsonParser, "required", False, llama(NOW, NOW), False),
    (Llama3JsonParser, NAMED, None, llama(NOW), False),
    (Llama3JsonParser, "required", None, '{"name": "get_weather", "parameters": {"unit": "c"}}', False),  # city
    (Llama3JsonParser, "required", None, '{"name": "get_time", "arguments": {}}', False),  # its key: parameters
    (Llama3JsonParser, "required", None, "Sure! " + llama(NOW), False),
    (MistralParser, "required", None, mistral(("get_weather", ARGS), NOW), True),
    (MistralParser, NAMED, None, mistral(("get_weather", {"city": "Rome"})), True),
    (MistralParser, NAMED, None, mistral(("get_weather", {"city": "Rome"}), NOW), False),
    (MistralParser, "required", False, mistral(NOW, NOW), False),
    (MistralParser, "required", None, "[TOOL_CALLS][]", False),
    (MistralParser, "required", None, '[TOOL_CALLS][{"name": "get_time", "arguments": {"x": 1}}]', False),
    (MistralParser, "required", None, llama(NOW), False),
    (PythonicParser, "required", None, '[get_weather(city="Oslo", unit="c"), get_time()]', True),
    (PythonicParser, "required", None, '[get_weather(unit="c", city="Oslo")]', False),  # the schema's order
    (PythonicParser, "required", None, '[get_weather(unit="c")]', False),  # city is required
    (PythonicParser, "required", None, '[get_weather(city=5)]', False),
    (PythonicParser, "required", None, '[get_time(zone="UTC")]', False),  # takes none
    (PythonicParser, NAMED, None, '[get_weather(city="Rome")]', True),
    (PythonicParser, NAMED, None, '[get_weather(city="Rome"), get_time()]', False),
    (PythonicParser, "required", False, '[get_time(), get_time()]', False),
]


@pytest.mark.parametrize("cls, choice, parallel, text, ok", GRAMMAR_CASES, ids=lambda v: getattr(v, "name", None))
def test_each_parsers_grammar_admits_its_own_format_only(compiler, cls, choice, parallel, text, ok):
    assert accepts(compiler, cls, choice, parallel, text) is ok
    if ok:  # what the grammar lets out, the same parser reads as calls, no content
        content, deltas = parse(cls(), [text])
        assert content == "" and calls(deltas) and all(name in ("get_weather", "get_time") for name, _ in calls(deltas))


def test_no_grammar_without_a_tool_choice_that_requires_a_call():
    for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser):
        assert all(cls.grammar([WEATHER], choice, None) is None for choice in ("auto", "none", None))


# ------------------------------------------------------------------------------ the prompt side

MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
]


@pytest.mark.parametrize("cls, call, asks", [
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', '"parameters"'),
    (MistralParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "[TOOL_CALLS]"),
    (PythonicParser, '[get_weather(city="Oslo")]', "Python list"),
])
def test_without_a_tool_template_the_prompt_asks_for_the_parsers_format(cls, call, asks):
    system, user, assistant, tool = with_tools(MESSAGES, [WEATHER], "auto", cls)
    assert asks in system["content"] and json.dumps(WEATHER["function"]) in system["content"]
    assert "<tool_call>" not in system["content"] and assistant["content"] == call
    assert tool == {"role": "tool", "content": "12 C"}
    content, deltas = parse(cls(), [call])  # what it shows the model, the parser reads back
    assert content == "" and calls(deltas) == [("get_weather", {"city": "Oslo"})]


# ------------------------------------------------------------------------------ the registry


def test_ours_are_registered_as_entry_points():
    declared = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert {name: declared.get(name) for name in BUILTIN} == BUILTIN
    assert tool_parser("llama3_json") is Llama3JsonParser and tool_parser("mistral") is MistralParser
    assert tool_parser("pythonic") is PythonicParser


def test_the_setting_picks_the_deployments_parser():
    assert NativeSettings().tool_call_parser == "hermes"
    backend = NativeBackend(NativeSettings(tool_call_parser="llama3_json"), name="native-0")
    try:
        assert backend.tool_parser is Llama3JsonParser
    finally:
        backend._tokenize_pool.shutdown()


def test_an_unknown_parser_is_a_settings_error_naming_the_known_ones():
    with pytest.raises(ValueError) as info:
        make_native_backend({"tool_call_parser": "hermes2"}, "native-0")
    assert str(info.value) == ("settings.tool_call_parser: unknown tool call parser 'hermes2'; "
                               "known: hermes, llama3_json, mistral, pythonic")


ACME = '''
from kvgate_native.tool_parsers.llama3_json import Llama3JsonParser


class AcmeParser(Llama3JsonParser):
    name = "acme"


class NotAParser:
    pass
'''


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """A third party's distribution on sys.path: a module and its dist-info declaring parsers."""
    (tmp_path / "acme_tools.py").write_text(textwrap.dedent(ACME))
    info = tmp_path / "acme_tools-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tools\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nacme = acme_tools:AcmeParser\nbroken = acme_tools:NotAParser\n"
        "missing = acme_tools:Nowhere\nhermes = acme_tools:AcmeParser\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield


def test_a_third_party_parser_is_found_through_its_entry_point(acme):
    parser = tool_parser("acme")
    assert parser.__name__ == "AcmeParser" and NativeSettings(tool_call_parser="acme").tool_call_parser == "acme"
    known = "known: acme, broken, hermes, llama3_json, missing, mistral, pythonic"
    with pytest.raises(pydantic.ValidationError, match=known):
        NativeSettings(tool_call_parser="nope")
    with pytest.raises(ValueError, match="'broken' .* lacks push, finish, grammar"):
        tool_parser("broken")
    with pytest.raises(ValueError, match="'missing' .* cannot be loaded"):
        tool_parser("missing")
    with pytest.raises(ValueError, match="'hermes' is registered twice"):  # never one of two at random
        tool_parser("hermes")


def test_pythonic_refuses_tools_it_cannot_write():
    bad = {"type": "function", "function": {"name": "get-time"}}
    with pytest.raises(InvalidRequestError, match="get-time") as info:
        PythonicParser.grammar([bad], "required", None)
    assert info.value.param == "tools"


@pytest.mark.parametrize("cls, text", [
    (HermesParser, "<tool_call>{}</tool_call>"), (MistralParser, "[TOOL_CALLS]{}"), (PythonicParser, "[{}]"),
    (Llama3JsonParser, '{"parameters": {}, "name": "f"}'),  # its arguments first: read whole, not streamed
], ids=lambda v: getattr(v, "name", None))
def test_nesting_deeper_than_the_json_parser_takes_is_content(cls, text):
    """(json.loads and ast.parse raise RecursionError, not ValueError, on such text.)"""
    deep = "[" * 100_000 + "]" * 100_000
    text = text.replace("{}", "{\"a\": " + deep + "}", 1)
    content, deltas = parse(cls(), [text[:500], text[500:]])
    assert content == text and deltas == []


# ------------------------------------------------------------------------------ markers that are special tokens

MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_start|>", "<|python_end|>"]


@pytest.fixture(scope="module")
def marker_tokenizer(compiler) -> Tokenizer:
    """SmolLM2's tokenizer with Mistral's and Llama 4's call markers added as special tokens, as
    those models' tokenizers have them (SmolLM2's own has them as plain text)."""
    import tokenizers

    smollm2 = compiler[0]
    backend = tokenizers.Tokenizer.from_str(smollm2.backend.to_str())
    backend.add_special_tokens(MARKERS)
    return Tokenizer(backend, chat_template=None, special_tokens_map={}, eos_token_ids=smollm2.eos_token_ids)


def engine_then_parser(tokenizer, cls, text, skip_special_tokens=True, tools=True):
    """`text` (the model's output, its markers and <|im_end|> written as special tokens) through the
    engine's output processor one token a step, then the backend's tool-call split, as
    NativeBackend.generate wires them: (content, deltas, the engine's text)."""
    from gateway.backend import TokenEvent
    from kvgate_native.mapping import hidden_markers, with_tool_calls
    from native_backend.core.interface import CoreOutput, EngineRequest
    from native_backend.process.output_processor import OutputProcessor

    class Core:
        def add_request(self, request):
            pass

    parser = cls()
    hidden = hidden_markers(parser, tokenizer) if tools and skip_special_tokens else None
    processor = OutputProcessor(Core(), tokenizer)
    processor.add_request(EngineRequest("r", tokenizer.encode("Hi", add_special_tokens=False),
                                        skip_special_tokens=skip_special_tokens,
                                        kept_special_tokens=hidden.markers if hidden else ()))
    ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False, parse_special=True)
    content, deltas, engine_text = "", [], ""
    for i, token_id in enumerate(ids):
        out = processor._to_output(CoreOutput("r", [token_id], finish_reason="stop" if i == len(ids) - 1 else None))
        engine_text += out.new_text
        event = with_tool_calls(TokenEvent(text=out.new_text, finish_reason=out.finish_reason), parser, hidden)
        content, deltas = content + event.text, deltas + list(event.tool_calls)
    return content, deltas, engine_text


@pytest.mark.parametrize("cls, text, content, found", [
    (MistralParser, "Sure." + mistral11(OSLO, NOW), "Sure.", [OSLO, NOW]),
    (MistralParser, '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}', "", [NOW]),
    (MistralParser, "[TOOL_CALLS]hello there", "hello there", []),  # a marker that opens no call: hidden
    (PythonicParser, "<|python_start|>" + pythonic(OSLO, NOW) + "<|python_end|>", "", [OSLO, NOW]),
    (PythonicParser, "<|python_start|>print('hi')<|python_end|> ok", "print('hi') ok", []),
], ids=lambda v: getattr(v, "name", None))
def test_markers_that_are_special_tokens_reach_the_parser_and_not_the_content(marker_tokenizer, cls, text,
                                                                               content, found):
    assert all(marker_tokenizer.special_token_id(m) is not None for m in MARKERS)
    got, deltas, engine_text = engine_then_parser(marker_tokenizer, cls, text)
    assert (got, calls(deltas)) == (content, found)
    assert engine_text == text  # the parser's markers kept, <|im_end|> (a special token it does not read) not


def test_without_the_parsers_markers_a_special_token_call_is_lost(marker_tokenizer):
    """What the engine gave the parser before: a v11 call's markers skipped, the call read as text."""
    got, deltas, _ = engine_then_parser(marker_tokenizer, MistralParser, mistral11(NOW), tools=False)
    assert deltas == [] and got == "get_time{}"


def test_skip_special_tokens_false_shows_every_special_token_but_the_stop(marker_tokenizer):
    text = "Sure.<|im_start|>" + mistral11(NOW)
    got, deltas, engine_text = engine_then_parser(marker_tokenizer, MistralParser, text, skip_special_tokens=False)
    assert engine_text == text and got == "Sure.<|im_start|>" and calls(deltas) == [NOW]
    # with tools and the default, the markers are read and no other special token shows
    got, deltas, engine_text = engine_then_parser(marker_tokenizer, MistralParser, text)
    assert engine_text == "Sure." + mistral11(NOW) and got == "Sure." and calls(deltas) == [NOW]


def test_hidden_markers_hold_back_a_possible_start_only():
    from kvgate_native.tool_parsers.base import HiddenMarkers

    hidden = HiddenMarkers(("[TOOL_CALLS]",))
    assert [hidden.push(p) for p in ["a [TOOL", "_CALLS]b [T", "x"]] + [hidden.finish()] == ["a ", "b ", "[Tx", ""]
    assert hidden.push("end [TOOL") + hidden.finish() == "end [TOOL"
