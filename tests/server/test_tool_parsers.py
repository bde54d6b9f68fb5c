"""Tool-call output parsers (kvcellar.server.tools.parsers) on model-style outputs, whole and streamed.

The split tests check the module's central invariant: however an output is cut into pieces, the
stream says what ``parse`` says (content, call names, arguments), and markup never leaks into content.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcellar.server.tools.parsers import (
    PARSERS,
    Gemma4Parser,
    HermesParser,
    Llama3Parser,
    MistralParser,
    ParsedCall,
    ParsedOutput,
    StreamDelta,
    ToolParser,
    XmlFunctionParser,
    new_call_id,
    parser_for_template,
)

TOOLS = ["get_weather", "search", "get_time"]
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'


def calls(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def stream(parser_cls: type[ToolParser], pieces: list[str], tool_names: list[str] | None) -> ParsedOutput:
    """Feed ``pieces``, check the delta shape, and rebuild the output from the deltas."""
    parser = parser_cls(tool_names)
    deltas: list[StreamDelta] = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = ""
    rebuilt: list[list[str]] = []
    for d in deltas:
        content += d.content
        for t in d.tool_calls:
            if t.index == len(rebuilt):  # a call's first delta: id and name, nothing before it
                assert t.id is not None and re.fullmatch(r"call_[A-Za-z0-9]{24}", t.id)
                assert t.name
                rebuilt.append([t.name, ""])
            else:
                assert t.index == len(rebuilt) - 1, "deltas go in call order"
                assert t.id is None and t.name is None
            rebuilt[t.index][1] += t.arguments
    assert parser.called == bool(rebuilt)
    return ParsedOutput(content=content, tool_calls=[ParsedCall(name=n, arguments=a, id="") for n, a in rebuilt])


def assert_stream_matches(parser_cls: type[ToolParser], pieces: list[str], tool_names: list[str] | None) -> None:
    text = "".join(pieces)
    whole = parser_cls(tool_names).parse(text)
    streamed = stream(parser_cls, pieces, tool_names)
    assert streamed.content == (whole.content or ""), pieces
    assert calls(streamed) == calls(whole), pieces


def assert_all_splits(parser_cls: type[ToolParser], text: str, tool_names: list[str] | None = None) -> None:
    for i in range(len(text) + 1):
        assert_stream_matches(parser_cls, [text[:i], text[i:]], tool_names)
    assert_stream_matches(parser_cls, list(text), tool_names)


# -- hermes (Hermes, Qwen2.5/3, kvcellar's fallback) --

HERMES_SINGLE = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
HERMES_PARALLEL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
)
HERMES_TEXT_BEFORE = (
    "I'll look up the weather for you.\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
HERMES_QWEN3_THINK = (
    "<think>\nThe user wants the time in Tokyo.\n</think>\n\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>'
)
HERMES_TRICKY_ARGS = (
    '<tool_call>{"name":"search","arguments":{"query":"say \\"hi\\" } </tool_call> {","filters":'
    '{"lang":["fr","日本語"],"nested":{"deep":[{"a":null},{"b":true}]}},"emoji":"\\u00e9 ✓"}}</tool_call>'
)
HERMES_SAMPLES = [
    HERMES_SINGLE,
    HERMES_PARALLEL,
    HERMES_TEXT_BEFORE,
    HERMES_QWEN3_THINK,
    HERMES_TRICKY_ARGS,
    '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>',  # arguments first
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '<tool_call>{"name": "get_time"}</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # max_tokens mid-arguments
    '<tool_call>\n{"name": "get_weather", "argu',  # max_tokens after the name
    '<tool_call>\n{"name": "get_wea',  # max_tokens inside the name: not a call yet
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # stop string ate the close tag
    '<tool_call>\n{"name": get_weather}\n</tool_call> after',  # invalid JSON
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
    '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # unknown tool
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}, "oops"}</tool_call>Done.',
    "The capital of France is Paris. <tool and < tags and <tool_call are fine.\n",
    'I will use <tool_call> now.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"q": 1}} junk <tool_call>{"name": "get_time"}</tool_call>',
    "",
    "  \n",
    'Text <tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call> middle text\n\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n',
]


def test_hermes_single_call() -> None:
    out = HermesParser(TOOLS).parse(HERMES_SINGLE)
    assert out.content is None
    assert calls(out) == [("get_weather", WEATHER_ARGS)]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", out.tool_calls[0].id)


def test_hermes_parallel_calls_and_text_before() -> None:
    out = HermesParser(TOOLS).parse(HERMES_PARALLEL)
    assert out.content is None
    assert calls(out) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Tokyo"}')]
    assert out.tool_calls[0].id != out.tool_calls[1].id
    out = HermesParser(TOOLS).parse(HERMES_TEXT_BEFORE)
    assert out.content == "I'll look up the weather for you."
    out = HermesParser(TOOLS).parse(HERMES_QWEN3_THINK)
    assert out.content == "<think>\nThe user wants the time in Tokyo.\n</think>"
    assert calls(out) == [("get_time", '{"timezone": "Asia/Tokyo"}')]


def test_hermes_escaped_nested_unicode_arguments() -> None:
    out = HermesParser(TOOLS).parse(HERMES_TRICKY_ARGS)
    assert out.content is None
    (call,) = out.tool_calls
    assert call.name == "search"
    assert call.arguments == HERMES_TRICKY_ARGS[len('<tool_call>{"name":"search","arguments":') : -len("}</tool_call>")]
    assert json.loads(call.arguments)["query"] == 'say "hi" } </tool_call> {'


def test_hermes_empty_or_missing_arguments_and_arguments_first() -> None:
    assert calls(HermesParser().parse('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')) == [
        ("get_time", "{}")
    ]
    assert calls(HermesParser().parse('<tool_call>{"name": "get_time"}</tool_call>')) == [("get_time", "{}")]
    out = HermesParser(TOOLS).parse('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>')
    assert calls(out) == [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": get_weather}\n</tool_call> after',
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
        "<tool_call>I should call a tool here.</tool_call>",
        '<tool_call>{"name": 42, "arguments": {}}</tool_call>',
        '<tool_call>{"function": "get_time"}</tool_call>',
        '<tool_call>\n{"name": "get_wea',
    ],
)
def test_hermes_invalid_block_stays_content(text: str) -> None:
    out = HermesParser(TOOLS).parse(text)
    assert out.tool_calls == []
    assert out.content == text


def test_hermes_unknown_tool_is_content_only_when_tools_are_given() -> None:
    text = 'Ok.\n<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>'
    assert HermesParser(TOOLS).parse(text) == ParsedOutput(content=text, tool_calls=[])
    assert calls(HermesParser(None).parse(text)) == [("delete_everything", "{}")]


def test_hermes_next_open_tag_ends_a_broken_block() -> None:
    out = HermesParser(TOOLS).parse(
        'I will use <tool_call> now.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    assert out.content == "I will use <tool_call> now." and calls(out) == [("get_time", "{}")]
    # after an emitted call, junk before the close tag is dropped; the next block still counts
    text = '<tool_call>{"name": "search", "arguments": {"q": 1}} junk <tool_call>{"name": "get_time"}</tool_call>'
    out = HermesParser(TOOLS).parse(text)
    assert out.content is None and calls(out) == [("search", '{"q": 1}'), ("get_time", "{}")]


def test_hermes_no_calls_is_content_unchanged() -> None:
    for text in ["The capital of France is Paris.\n", "a <tool b <tool_call c", "", " \n "]:
        assert HermesParser(TOOLS).parse(text) == ParsedOutput(content=text, tool_calls=[])


def test_hermes_truncated_call_stands() -> None:
    out = HermesParser(TOOLS).parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert calls(out) == [("get_weather", '{"city": "Par')]
    out = HermesParser(TOOLS).parse('<tool_call>\n{"name": "get_weather", "argu')
    assert calls(out) == [("get_weather", "{}")]


def test_hermes_text_between_and_after_calls() -> None:
    out = HermesParser(TOOLS).parse(HERMES_SAMPLES[-1])
    assert out.content == "Text middle text"
    assert [c.name for c in out.tool_calls] == ["search", "get_time"]


def test_hermes_streams_name_then_arguments_before_the_close_tag() -> None:
    parser = HermesParser(TOOLS)
    first = parser.feed("Checking.\n<tool_")
    assert first.content == "Checking." and not first.tool_calls  # markup start held back
    d = parser.feed('call>\n{"name": "get_weather", ')
    assert d.content == ""
    assert [(t.index, t.name, t.arguments) for t in d.tool_calls] == [(0, "get_weather", "")]
    assert d.tool_calls[0].id is not None and parser.called
    d = parser.feed('"arguments": {"city": "Pa')
    assert [(t.index, t.id, t.name, t.arguments) for t in d.tool_calls] == [(0, None, None, '{"city": "Pa')]
    d = parser.feed('ris"}}\n</tool_')
    assert [t.arguments for t in d.tool_calls] == ['ris"}'] and d.content == ""
    d = parser.feed("call>")
    assert d == StreamDelta()
    assert parser.finish() == StreamDelta()


def test_hermes_held_back_text_is_released() -> None:
    parser = HermesParser(TOOLS)
    assert parser.feed("a <tool_").content == "a"
    assert parser.feed("box> b").content == " <tool_box> b"
    assert parser.feed(" <").content == ""
    assert parser.finish().content == " <"
    assert not parser.called


@pytest.mark.parametrize("text", HERMES_SAMPLES)
def test_hermes_every_split_agrees_with_parse(text: str) -> None:
    assert_all_splits(HermesParser, text, TOOLS)


# -- llama3 --

LLAMA_SINGLE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_SAMPLES = [
    LLAMA_SINGLE,
    '<|python_tag|>{"name": "search", "parameters": {"query": "llama \\"3.1\\" }"}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    '\n\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
    '{"name": "get_weather", "parameters": {"city": "Par',
    '{"answer": 42}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # missing brace: truncated call
    '{"name": get_weather}',
    '{"name": "unknown_tool", "parameters": {}}',
    "The weather in Paris is sunny, 21 °C.",
    "<|python_tag|>brave_search.call(query='weather paris')",
    '{"name": "get_time", "parameters": {}}; {"broken',
    '{"name": "get_time", "parameters": {}};',
    '{"name": "get_time", "parameters": {}}\n\nI called the tool.',
    " ",
    "",
]


def test_llama3_single_and_python_tag() -> None:
    out = Llama3Parser(TOOLS).parse(LLAMA_SINGLE)
    assert out.content is None
    assert calls(out) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    out = Llama3Parser(TOOLS).parse(LLAMA_SAMPLES[1])
    assert calls(out) == [("search", '{"query": "llama \\"3.1\\" }"}')]


def test_llama3_parallel_calls_and_arguments_key() -> None:
    out = Llama3Parser(TOOLS).parse(LLAMA_SAMPLES[2])
    assert calls(out) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    out = Llama3Parser(TOOLS).parse(LLAMA_SAMPLES[3])
    assert out.content is None and calls(out) == [("get_time", '{"timezone": "Europe/Paris"}')]


@pytest.mark.parametrize(
    "text",
    [
        '{"answer": 42}',
        '{"name": get_weather}',
        '{"name": "unknown_tool", "parameters": {}}',
        "The weather in Paris is sunny.",
        "<|python_tag|>brave_search.call(query='weather paris')",
        '  {"extra": 1, "name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
    ],
)
def test_llama3_not_a_call_is_content_unchanged(text: str) -> None:
    assert Llama3Parser(TOOLS).parse(text) == ParsedOutput(content=text, tool_calls=[])


def test_llama3_truncated_and_trailing() -> None:
    assert calls(Llama3Parser(TOOLS).parse(LLAMA_SAMPLES[4])) == [("get_weather", '{"city": "Par')]
    out = Llama3Parser(TOOLS).parse('{"name": "get_time", "parameters": {}}; {"broken')
    assert calls(out) == [("get_time", "{}")] and out.content == '; {"broken'
    out = Llama3Parser(TOOLS).parse('{"name": "get_time", "parameters": {}};')
    assert calls(out) == [("get_time", "{}")] and out.content is None


def test_llama3_broken_after_the_name_stays_a_call() -> None:
    # the name was streamed as a call already; parse keeps the same rule
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}, "extra": 1} tail'
    out = Llama3Parser(TOOLS).parse(text)
    assert out.content is None and calls(out) == [("get_weather", '{"city": "Paris"}')]


def test_llama3_leading_brace_is_held_until_decided() -> None:
    parser = Llama3Parser(TOOLS)
    assert parser.feed('{"answ').content == ""
    assert parser.feed('er": 42}').content == '{"answer": 42}'
    parser = Llama3Parser(TOOLS)
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(' {"name": "get_time"}').content == ' {"name": "get_time"}'
    assert not parser.finish().tool_calls


@pytest.mark.parametrize("text", LLAMA_SAMPLES)
def test_llama3_every_split_agrees_with_parse(text: str) -> None:
    assert_all_splits(Llama3Parser, text, TOOLS)


# -- mistral --

MISTRAL_SAMPLES = [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
    '"arguments": {}, "id": "a1b2c3d4e"}]',
    'Let me check that.[TOOL_CALLS][{"name": "search", "arguments": {"q": "a ] } \\" ["}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
    '[TOOL_CALLS]get_time[CALL_ID]Xy12AbC90[ARGS]{"timezone": "UTC"}',
    "Bonjour ! Il fait beau à Paris.",
    "[TOOL_CALLS]Sorry, I cannot do that.",
    '[TOOL_CALLS][{"name": "unknown", "arguments": {}}]',
    '[TOOL_CALLS]unknown[ARGS]{"a": 1}',
    "[TOOL_CALLS][not json]",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
    '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, oops]',
    "[TOOL_CALLS]get_wea",
]


def test_mistral_v3_array() -> None:
    out = MistralParser(TOOLS).parse(MISTRAL_SAMPLES[0])
    assert out.content is None and calls(out) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    out = MistralParser(TOOLS).parse(MISTRAL_SAMPLES[1])
    assert calls(out) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    out = MistralParser(TOOLS).parse(MISTRAL_SAMPLES[2])
    assert out.content == "Let me check that." and calls(out) == [("search", '{"q": "a ] } \\" ["}')]


def test_mistral_v11_calls() -> None:
    assert calls(MistralParser(TOOLS).parse(MISTRAL_SAMPLES[3])) == [("get_weather", '{"city": "Paris"}')]
    assert calls(MistralParser(TOOLS).parse(MISTRAL_SAMPLES[4])) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    assert calls(MistralParser(TOOLS).parse(MISTRAL_SAMPLES[5])) == [("get_time", '{"timezone": "UTC"}')]
    assert calls(MistralParser(TOOLS).parse(MISTRAL_SAMPLES[11])) == [("get_weather", '{"city": "Par')]


@pytest.mark.parametrize(
    "text",
    [
        "Bonjour ! Il fait beau à Paris.",
        "[TOOL_CALLS]Sorry, I cannot do that.",
        '[TOOL_CALLS][{"name": "unknown", "arguments": {}}]',
        '[TOOL_CALLS]unknown[ARGS]{"a": 1}',
        "[TOOL_CALLS][not json]",
        "[TOOL_CALLS]get_wea",
    ],
)
def test_mistral_not_a_call_is_content_unchanged(text: str) -> None:
    assert MistralParser(TOOLS).parse(text) == ParsedOutput(content=text, tool_calls=[])


@pytest.mark.parametrize("text", MISTRAL_SAMPLES)
def test_mistral_every_split_agrees_with_parse(text: str) -> None:
    assert_all_splits(MistralParser, text, TOOLS)


# -- xml_function (Qwen3-Coder, Qwen3.5) --

XML_EDIT = ("<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n"
            "<parameter=line>\n12\n</parameter>\n<parameter=text>\nfn main() {\n    println!(\"<hi>\");\n}\n"
            "</parameter>\n</function>\n</tool_call>")
XML_SCHEMAS = {"edit_file": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "text": {"type": "string"},
    "force": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}}}}
XML_SAMPLES = [
    XML_EDIT,
    "Let me fix that.\n\n" + XML_EDIT + "\n<tool_call>\n<function=search>\n</function>\n</tool_call>",
    ("<tool_call>\n<function=get_time>\n<parameter=zone>\n{\"tz\": [\"UTC\"]}\n</parameter>\n</function>\n"
     "</tool_call> done"),
    "<tool_call>\n<function=nope>\n</function>\n</tool_call> after",  # unknown tool: content
    "<tool_call>\n<function=get_time\n>oops</tool_call> text",  # a broken tag: content
    "<tool_call>\n<function=search>\n<parameter=q>\nunfinished",  # the output ended in a value
    "<tool_call>\n<function=search>\n<param broken</tool_call> after",  # broken after the call
    "no calls at all, <function= mentioned </parameter> in text",
]


def test_xml_function_values_are_typed_by_the_tools_schema() -> None:
    parsed = XmlFunctionParser(["edit_file"], XML_SCHEMAS).parse("Fixing.\n" + XML_EDIT)
    assert parsed.content == "Fixing."
    ((name, arguments),) = calls(parsed)
    assert name == "edit_file"
    assert json.loads(arguments) == {"path": "src/main.rs", "line": 12,
                                     "text": 'fn main() {\n    println!("<hi>");\n}'}
    more = ("<tool_call>\n<function=edit_file>\n<parameter=path>\n12\n</parameter>\n<parameter=force>\nTrue\n"
            "</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=line>\nnot a number\n"
            "</parameter>\n</function>\n</tool_call>")
    ((_, arguments),) = calls(XmlFunctionParser(None, XML_SCHEMAS).parse(more))
    # a string stays a string however it looks; Python's True (the template's ``| string``)
    # is true; a value of the wrong type is kept as text for the schema check to refuse
    assert json.loads(arguments) == {"path": "12", "force": True, "tags": ["a", "b"], "line": "not a number"}


def test_xml_function_without_a_schema_reads_json_values_and_keeps_text() -> None:
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\nhello world\n"
            "</parameter>\n<parameter=o>\n{\"k\": null}\n</parameter>\n</function>\n</tool_call>")
    ((_, arguments),) = calls(XmlFunctionParser().parse(text))
    assert arguments == '{"n": 3, "s": "hello world", "o": {"k": null}}'


@pytest.mark.parametrize("text", XML_SAMPLES[3:5] + XML_SAMPLES[7:])
def test_xml_function_not_a_call_is_content_unchanged(text: str) -> None:
    parsed = XmlFunctionParser(TOOLS).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_xml_function_truncated_or_broken_call_stands() -> None:
    ((name, arguments),) = calls(XmlFunctionParser(TOOLS).parse(XML_SAMPLES[5]))
    assert (name, json.loads(arguments)) == ("search", {"q": "unfinished"})
    parsed = XmlFunctionParser(TOOLS).parse(XML_SAMPLES[6])
    assert calls(parsed) == [("search", "{}")] and parsed.content == " after"


def test_xml_function_emits_the_call_at_its_function_tag() -> None:
    parser = XmlFunctionParser(TOOLS)
    first = parser.feed("Sure. <tool_call>\n<function=search>\n<parameter=q>\nkv")
    assert first.content == "Sure." and [(t.name, t.arguments) for t in first.tool_calls] == [("search", "")]
    second = parser.feed(" cache\n</parameter>\n</fun")
    assert second.content == "" and [t.arguments for t in second.tool_calls] == ['{"q": "kv cache"']
    last = parser.feed("ction>\n</tool_call>")
    assert [t.arguments for t in last.tool_calls] == ["}"]


@pytest.mark.parametrize("text", XML_SAMPLES)
def test_xml_function_every_split_agrees_with_parse(text: str) -> None:
    assert_all_splits(XmlFunctionParser, text, TOOLS)
    assert_all_splits(XmlFunctionParser, text, None)


# -- gemma4 (Gemma 4) --

Q = '<|"|>'
GEMMA_CALL = (f"<|tool_call>call:search{{filters:{{langs:[{Q}rust{Q},{Q}c{Q}],since:2024}},q:{Q}where is {{x}}, "
              f"really: [a]?{Q}}}<tool_call|>")
GEMMA_SAMPLES = [
    GEMMA_CALL,
    "Let me look.\n" + GEMMA_CALL + "<|tool_call>call:get_time{}<tool_call|>",
    f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:-1.5e2,exact:false,unit:null}}<tool_call|> done",
    "<|tool_call>call:nope{}<tool_call|> after",  # unknown tool: content
    "<|tool_call>declare:search{}<tool_call|> text",  # not a call: content
    "<|tool_call>call:search{q:" + Q + "unfinished",  # the output ended in a string
    "<|tool_call>call:get_time{}broken<tool_call|> after",  # broken after the call
    "no calls at all, call:search{q:1} in text <tool_call|>",
]


def test_gemma4_arguments_are_read_from_the_templates_notation() -> None:
    parsed = Gemma4Parser(TOOLS).parse("Let me look.\n" + GEMMA_CALL)
    assert parsed.content == "Let me look."
    ((name, arguments),) = calls(parsed)
    assert name == "search"
    assert json.loads(arguments) == {"filters": {"langs": ["rust", "c"], "since": 2024},
                                     "q": "where is {x}, really: [a]?"}
    ((_, arguments),) = calls(Gemma4Parser(TOOLS).parse(GEMMA_SAMPLES[2]))
    assert json.loads(arguments) == {"city": "Paris", "days": -150.0, "exact": False, "unit": None}


@pytest.mark.parametrize("text", GEMMA_SAMPLES[3:5] + GEMMA_SAMPLES[7:])
def test_gemma4_not_a_call_is_content_unchanged(text: str) -> None:
    parsed = Gemma4Parser(TOOLS).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_gemma4_truncated_or_broken_call_stands() -> None:
    ((name, arguments),) = calls(Gemma4Parser(TOOLS).parse(GEMMA_SAMPLES[5]))
    assert (name, json.loads(arguments)) == ("search", {"q": "unfinished"})
    parsed = Gemma4Parser(TOOLS).parse(GEMMA_SAMPLES[6])
    assert calls(parsed) == [("get_time", "{}")] and parsed.content == " after"


def test_gemma4_emits_the_call_at_its_name_and_the_arguments_at_their_close() -> None:
    parser = Gemma4Parser(TOOLS)
    first = parser.feed("Sure. <|tool_call>call:search{q:" + Q + "kv {")
    assert first.content == "Sure." and [(t.name, t.arguments) for t in first.tool_calls] == [("search", "")]
    assert parser.feed(" cache}" + Q).tool_calls == []  # a brace inside a string closes nothing
    last = parser.feed("}<tool_call|>")
    assert [t.arguments for t in last.tool_calls] == ['{"q": "kv { cache}"}']


@pytest.mark.parametrize("text", GEMMA_SAMPLES)
def test_gemma4_every_split_agrees_with_parse(text: str) -> None:
    assert_all_splits(Gemma4Parser, text, TOOLS)
    assert_all_splits(Gemma4Parser, text, None)


# -- random multi-way splits, every family --

ALL_SAMPLES = (
    [(HermesParser, t) for t in HERMES_SAMPLES]
    + [(Llama3Parser, t) for t in LLAMA_SAMPLES]
    + [(MistralParser, t) for t in MISTRAL_SAMPLES]
    + [(XmlFunctionParser, t) for t in XML_SAMPLES]
    + [(Gemma4Parser, t) for t in GEMMA_SAMPLES]
)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), tools_given=st.booleans())
def test_random_splits_agree_with_parse(data: st.DataObject, tools_given: bool) -> None:
    parser_cls, text = data.draw(st.sampled_from(ALL_SAMPLES))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert_stream_matches(parser_cls, pieces, TOOLS if tools_given else None)


# -- choosing the family --


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{% for tool in tools %}...<tools>{{ tool }}</tools> <tool_call>{...}</tool_call>{% endfor %}", "hermes"),
        ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}", "xml_function"),
        ("{{- '<|tool_call>call:' + function['name'] + '{' -}}", "gemma4"),
        ("{% if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}{% endif %}", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>{% if builtin_tools %}<|python_tag|>{% endif %}", "llama3"),
        ('<|start_header_id|>assistant<|end_header_id|> {"name": function name, "parameters": ...}', "llama3"),
        ("<|start_header_id|>user<|end_header_id|>{{ message.content }}<|eot_id|>", "hermes"),
        ("<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>", "hermes"),
        (None, "hermes"),
    ],
)
def test_parser_for_template(template: str | None, family: str) -> None:
    assert parser_for_template(template) is PARSERS[family]
    assert PARSERS[family].family == family


def test_new_call_id_shape() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
