"""Tool-call parsers: whole outputs, and the same outputs streamed in pieces of every size."""
from __future__ import annotations

import json
import random
import re

import pytest

from webapp.api.tool_parsers.json_calls import JsonListParser
from webapp.api.tool_parsers import (ExtractedToolCalls, ToolCallDelta, ToolParser, UnknownToolParser,
                                     get_tool_parser)

MARKUP = ("<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL_", "<|python_tag|>", "<|python_",
          "<|python_start|>", "<|python_end|>")
OPENAI_ID = re.compile(r"call_[A-Za-z0-9]{24}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def extract(parser: str, text: str) -> ExtractedToolCalls:
    return get_tool_parser(parser)(None).extract(text)


def stream(parser: str, text: str, sizes: list[int]) -> tuple[list[str], list[ToolCallDelta]]:
    """Feed ``text`` in pieces of the given sizes (cycled); the content pieces and all deltas."""
    p: ToolParser = get_tool_parser(parser)(None)
    contents, deltas, i, k = [], [], 0, 0
    while i < len(text):
        content, new = p.feed(text[i:i + sizes[k % len(sizes)]])
        contents.append(content)
        deltas += new
        i += sizes[k % len(sizes)]
        k += 1
    content, new = p.finish()
    return contents + [content], deltas + new


def assemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """``(id, name, arguments)`` per call, checking OpenAI's delta shape on the way."""
    calls: list[list[str]] = []
    for delta in deltas:
        if delta.index == len(calls):  # a call's first delta names it
            assert delta.id and delta.name, delta
            calls.append([delta.id, delta.name, delta.arguments])
        else:
            assert delta.index == len(calls) - 1 and delta.id is None and delta.name is None, delta
            assert delta.arguments, "an empty fragment after the first delta"
            calls[-1][2] += delta.arguments
    return [tuple(call) for call in calls]


def chunkings(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    return [[1], [len(text) or 1]] + [[rng.randint(1, 9) for _ in range(40)] for _ in range(6)]


def assert_streams_like_extract(parser: str, text: str) -> ExtractedToolCalls:
    """Every chunking streams the names, arguments and content that extract() gives, without markup."""
    whole = extract(parser, text)
    for sizes in chunkings(text):
        contents, deltas = stream(parser, text, sizes)
        calls = assemble(deltas)
        streamed = "".join(contents)
        assert (streamed if streamed.strip() else None) == whole.content, sizes
        assert [(name, arguments) for _, name, arguments in calls] == \
            [(c.name, c.arguments) for c in whole.tool_calls], sizes
        for _, _, arguments in calls:
            assert isinstance(json.loads(arguments), dict)
        if whole.tool_calls:
            for piece in contents:
                assert not any(m in piece for m in MARKUP), (sizes, piece)
    return whole


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


# Outputs that hold calls: (parser, text, content, [(name, arguments)])
WEATHER = {"city": "San Francisco", "unit": "celsius"}
VALID = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}\n'
               '</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"arguments": {"q": "a } \\" {[", "n": [1, {"x": '
               'null}]}, "name": "search"}\n</tool_call>\n<tool_call>\n{"name": "now"}\n</tool_call>',
     "Let me look.\n",
     [("get_weather", WEATHER), ("search", {"q": 'a } " {[', "n": [1, {"x": None}]}), ("now", {})]),
    ("hermes", 'Checking <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>\nDone, ünïcode.',
     "Checking Done, ünïcode.", [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": '
                    '"celsius"}}; {"name": "search", "arguments": {"q": "x;y"}};{"type": "function", "name": "now", '
                    '"parameters": {}}', None,
     [("get_weather", WEATHER), ("search", {"q": "x;y"}), ("now", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}]',
     None, [("get_weather", WEATHER)]),
    ("mistral", 'Sure, two calls. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "San Francisco", '
                '"unit": "celsius"}}, {"name": "search", "arguments": {"q": ["a", "b"]}}]',
     "Sure, two calls. ", [("get_weather", WEATHER), ("search", {"q": ["a", "b"]})]),
    ("pythonic", "[get_weather(city='San Francisco', unit=\"celsius\")]", None, [("get_weather", WEATHER)]),
    ("pythonic", "[get_weather(city='San Francisco', unit=\"celsius\"), search(q='a)](', n=(1, 2.5), "
                 "flags={'x': None, 'y': [True, False]}), now()]", None,
     [("get_weather", WEATHER), ("search", {"q": "a)](", "n": [1, 2.5], "flags": {"x": None, "y": [True, False]}}),
      ("now", {})]),
    ("pythonic", "<|python_start|>[get_weather(city='San Francisco', unit='celsius')]<|python_end|>", None,
     [("get_weather", WEATHER)]),
]

# Outputs that are content: (parser, text)
CONTENT = [
    ("hermes", "The weather in SF is sunny."),
    ("hermes", "A tag <tool_ that never closes"),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    ("llama3_json", "The weather in SF is sunny."),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "Bob", "age": 3}'),
    ("llama3_json", 'Here: {"name": "f", "parameters": {}}'),
    ("llama3_json", '<|python_tag|>print("hi")'),
    ("mistral", "The weather in SF is sunny [TOOL"),
    ("mistral", '[TOOL_CALLS] {"name": "f", "arguments": {}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f" "arguments": {}}]'),
    ("pythonic", "The weather in SF is sunny."),
    ("pythonic", "[1] The weather in SF is sunny."),
    ("pythonic", "[Note: sunny]"),
    ("pythonic", "[get_weather('SF')]"),  # positional
    ("pythonic", "[get_weather(city=city_name)]"),  # not a literal
    ("pythonic", "[get_weather(city='SF']"),  # malformed
    ("pythonic", "Sure: [get_weather(city='SF')]"),
]

# Outputs whose markup breaks inside the only call's arguments, after its name and their start: the
# stream has sent them (it cannot take them back), extract() gives the whole text as content.
BROKEN_AFTER_NAME = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),  # malformed JSON
    ("llama3_json", '{"name": "f", "parameters": {"a": tru}}'),  # malformed JSON
    ("hermes", 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [2'),  # cut off
]

# Outputs whose markup breaks or is cut off after whole calls: (parser, text, content, calls), streamed or not.
BROKEN_AFTER_CALLS = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {x}}',
     None, [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g', None,
     [("f", {"a": 1})]),  # cut off
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", '
               '"arguments": {"b": "tr', None, [("f", {"a": 1})]),  # cut inside the second call's arguments
    ("hermes", 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}', "Hi ", [("f", {"a": 1})]),  # arguments whole
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}', None, [("f", {"a": 1})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b', None,
     [("f", {"a": 1})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}} {"name": "g"}]', None, [("f", {"a": 1})]),  # no comma
    ("pythonic", "[f(city='SF'), ]", None, [("f", {"city": "SF"})]),
    # max_tokens cut a tag after a whole call: the piece of markup is not content
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', None, [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call', None, [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<', None, [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_', None, [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nSo <tool_', "So ", [("f", {"a": 1})]),
]


@pytest.mark.parametrize("parser,text,content,calls", VALID, ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None)
def test_extract_finds_the_calls(parser, text, content, calls):
    result = extract(parser, text)
    assert result.content == content
    assert calls_of(result) == calls
    id_shape = MISTRAL_ID if parser == "mistral" else OPENAI_ID
    assert all(id_shape.fullmatch(c.id) for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)


@pytest.mark.parametrize("parser,text,content,calls", VALID, ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None)
def test_streaming_reassembles_the_extracted_calls(parser, text, content, calls):
    whole = assert_streams_like_extract(parser, text)
    assert calls_of(whole) == calls


@pytest.mark.parametrize("parser,text", CONTENT)
def test_text_that_is_not_calls_is_content(parser, text):
    assert extract(parser, text) == ExtractedToolCalls(text, [])
    assert_streams_like_extract(parser, text)


@pytest.mark.parametrize("parser,text", BROKEN_AFTER_NAME)
def test_markup_broken_after_the_name_is_content_whole_and_never_leaks_streamed(parser, text):
    assert extract(parser, text) == ExtractedToolCalls(text, [])
    for sizes in chunkings(text):
        contents, deltas = stream(parser, text, sizes)
        if not deltas:  # the piece that broke it also held the name: not sent, all content
            assert "".join(contents) == text, sizes
            continue
        assert "".join(contents) == ("Hi " if text.startswith("Hi ") else ""), sizes
        assert assemble(deltas)[0][1] == "f"
    contents, deltas = stream(parser, text, [1])
    assert deltas, "fed a character at a time, the name goes out before the break"


def test_arguments_stream_in_fragments_after_the_name():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco"}}\n</tool_call>'
    p = get_tool_parser("hermes")(None)
    seen = []
    for ch in text:
        content, deltas = p.feed(ch)
        assert content == ""
        seen += deltas
    assert p.finish() == ("", [])
    assert seen[0].name == "get_weather" and seen[0].arguments == ""
    assert len(seen) == 1 + len('{"city": "San Francisco"}')  # one fragment a character
    assert "".join(d.arguments for d in seen) == '{"city": "San Francisco"}'


def test_partial_marker_is_held_until_clear():
    p = get_tool_parser("hermes")(None)
    assert p.feed("Hi <tool_") == ("Hi ", [])
    assert p.feed("box> there") == ("<tool_box> there", [])
    assert p.finish() == ("", [])
    p = get_tool_parser("mistral")(None)
    assert p.feed("ok [TOOL_CAL") == ("ok ", [])
    assert p.finish() == ("[TOOL_CAL", [])


def test_plain_content_streams_without_waiting():
    p = get_tool_parser("llama3_json")(None)
    assert p.feed("Hello") == ("Hello", [])
    p = get_tool_parser("hermes")(None)
    assert p.feed("Hello, world") == ("Hello, world", [])


@pytest.mark.parametrize("parser,text,content,calls", BROKEN_AFTER_CALLS)
def test_markup_broken_after_whole_calls_leaves_those_calls_and_no_markup_streamed_or_not(parser, text, content,
                                                                                          calls):
    """Seen: ``max_tokens`` cut a second call; the stream sent the first call, the whole response sent no call and
    the raw markup as content. Both now give the whole calls and drop the broken rest."""
    result = extract(parser, text)
    assert result.content == content and calls_of(result) == calls
    for sizes in ([1], [3], [len(text)]):
        contents, deltas = stream(parser, text, sizes)
        assert "".join(contents) == (content or ""), sizes
        assert [(name, json.loads(arguments)) for _, name, arguments in assemble(deltas)[:len(calls)]] == calls


def test_a_required_list_cut_by_max_tokens_gives_its_whole_calls():
    text = '[{"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {}}, {"name": "ping",'
    result = JsonListParser(None).extract(text)
    assert result.content is None and calls_of(result) == [("ping", {}), ("ping", {})]


def test_pythonic_arguments_are_json():
    result = extract("pythonic", "[f(s='caf\u00e9 \"q\"', t=(1,), n=None, b=True, x=-1.5e3)]")
    assert result.tool_calls[0].arguments == '{"s": "caf\u00e9 \\"q\\"", "t": [1], "n": null, "b": true, "x": -1500.0}'


@pytest.mark.parametrize("text", ["[f(s={1, 2})]", "[f(b=b'x')]", "[f(c=1j)]", "[f(x=1e999)]", "[f(d={1: 2})]",
                                  "[f(**kw)]", "[f(a=1, a=2)]", "[obj.f(a=1)]"])
def test_pythonic_rejects_what_json_cannot_say(text):
    assert extract("pythonic", text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_registry_gives_parser_classes(name):
    parser_cls = get_tool_parser(name)
    assert issubclass(parser_cls, ToolParser) and parser_cls.name == name


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(KeyError) as info:
        get_tool_parser("qwen_xml")
    assert isinstance(info.value, ValueError) and isinstance(info.value, UnknownToolParser)
    assert str(info.value) == "Unknown tool parser 'qwen_xml'; known parsers: hermes, llama3_json, mistral, pythonic."


def test_empty_output():
    for name in ("hermes", "llama3_json", "mistral", "pythonic"):
        assert extract(name, "") == ExtractedToolCalls(None, [])
        assert extract(name, "  \n") == ExtractedToolCalls(None, [])
