"""Tool calling pieces of the native plugin: the Hermes prompt and conversation, the grammar of
`required` / named calls (compiled by llguidance against SmolLM2's tokenizer), and the streaming
parser that turns the model's text into OpenAI tool-call fragments."""

import json

import pytest

from kvgate_native.tools import HermesParser, tool_grammar, with_tools
from native_backend.model.loader import default_gguf_path
from native_backend.text.grammar import GrammarCompiler
from native_backend.text.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: no arguments


def parse_stream(pieces: list[str], parser=None):
    parser = parser or HermesParser()
    content, deltas = "", []
    for piece in pieces:
        text, found = parser.push(piece)
        content, deltas = content + text, deltas + found
    text, found = parser.finish()
    return content + text, deltas + found


def calls(deltas):
    """The fragments put together the way a client does: by index."""
    out = {}
    for d in deltas:
        call = out.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        call["id"] = call["id"] or d.id
        call["name"] = call["name"] or d.name
        call["arguments"] += d.arguments
    return [out[i] for i in sorted(out)]


def test_a_call_split_anywhere_parses_the_same():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    whole = parse_stream([text])
    for cut in range(1, len(text)):
        content, deltas = parse_stream([text[:cut], text[cut:]])
        assert content == "Let me check.\n"
        [call] = calls(deltas)
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}
    first, second = whole[1]
    assert first.id.startswith("chatcmpl-tool-") and first.name == "get_weather" and not first.arguments
    assert second.id is None and second.name is None and second.arguments


def test_several_calls_get_their_own_index_and_parallel_false_keeps_one():
    text = ''.join(f'<tool_call>\n{{"name": "f{i}", "arguments": {{}}}}\n</tool_call>\n' for i in range(3))
    content, deltas = parse_stream(list(text))
    assert content == "" and [c["name"] for c in calls(deltas)] == ["f0", "f1", "f2"]
    assert len({c["id"] for c in calls(deltas)}) == 3
    content, deltas = parse_stream([text], HermesParser(max_calls=1))
    assert [c["name"] for c in calls(deltas)] == ["f0"]


def test_text_that_only_looks_like_a_call_stays_text():
    for text in ("I like <tool_call>s.", "a < b", "<tool_call>not json</tool_call>", "<tool_"):
        content, deltas = parse_stream([text])
        assert deltas == [] and content == text


def test_an_unterminated_call_at_the_end_still_counts():
    content, deltas = parse_stream(['<tool_call>\n{"name": "get_time", "arguments": {}}'])
    assert [c["name"] for c in calls(deltas)] == ["get_time"]


def test_the_conversation_renders_calls_and_results_as_text():
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
    ]
    rendered = with_tools(messages, [WEATHER], "auto")
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    assert with_tools(messages[:1], [WEATHER], "none") == messages[:1]  # "none": no tools in the prompt


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    tokenizer = Tokenizer.from_pretrained(default_gguf_path(), cache_dir=str(tmp_path_factory.mktemp("tok")))
    return tokenizer, GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids[0])


@pytest.mark.parametrize("choice, parallel, text, ok", [
    ("required", None, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n', True),
    ("required", None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n', True),
    ("required", False, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                        '<tool_call>\n', False),
    ("required", None, '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}', False),  # city missing
    ("required", None, 'Sure! <tool_call>', False),
    ({"type": "function", "function": {"name": "get_weather"}}, None,
     '<tool_call>\n{"name": "get_time", "arguments": {}}', False),
])
def test_the_tool_grammar_allows_valid_calls_only(compiler, choice, parallel, text, ok):
    tokenizer, grammars = compiler
    matcher = grammars.compile(tool_grammar([WEATHER, TIME], choice, parallel)).matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    accepted = all(matcher.accept(t) for t in tokens)
    assert accepted == ok, matcher.error


def test_no_grammar_for_auto_or_none():
    assert tool_grammar([WEATHER], "auto", None) is None and tool_grammar([WEATHER], "none", None) is None
    assert tool_grammar([WEATHER], None, None) is None
