"""The grammars behind tool calls, walked token by token with the embedded tokenizer."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvcellar.engine.constraints import GrammarCompiler
from kvcellar.errors import InvalidRequestError
from kvcellar.server.tools.grammar import auto_call_grammar, forced_call_grammar
from kvcellar.server.tools.parsers import HermesParser
from tests._models import embedded
from tests.server.agent_fixtures import AGENT_REQUESTS, agent_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping"}}]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    loaded = embedded()
    return GrammarCompiler(loaded.tokenizer, int(loaded.model.config.vocab_size), loaded.eos_token_ids)


def walk(compiler: GrammarCompiler, grammar: Any, text: str) -> tuple[bool, Any]:
    """(every token accepted, the constraint after them)."""
    constraint = compiler.constraint(grammar, max_tokens=10_000)
    ids = embedded().tokenizer(text, add_special_tokens=False).input_ids
    return all(constraint.accept(t) for t in ids), constraint


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_auto_grammar_lets_text_through_and_keeps_calls_well_formed(compiler: GrammarCompiler) -> None:
    grammar = auto_call_grammar(compiler, "hermes", TOOLS)
    assert grammar is not None and not grammar.steer_to_end
    for ok_text in ("Hello! It is sunny, {not json} and <b>bold</b>.", f"Let me check.\n{CALL}", CALL + "\n" + CALL):
        accepted, _ = walk(compiler, grammar, ok_text)
        assert accepted, ok_text
    for bad in ('<tool_call>\n{"name": "get_time"', '<tool_call>\n{"name": "get_weather", "arguments": {"town": ',
                "<tool_call>\nplain words"):
        accepted, _ = walk(compiler, grammar, bad)
        assert not accepted, bad
    assert auto_call_grammar(compiler, "llama3", TOOLS) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_grammar_accepts_exactly_calls(compiler: GrammarCompiler, parallel: bool) -> None:
    grammar = forced_call_grammar(compiler, "hermes", TOOLS, parallel=parallel)
    accepted, constraint = walk(compiler, grammar, CALL)
    assert accepted and not constraint.error
    two = CALL + '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert walk(compiler, grammar, two)[0] is parallel
    assert not walk(compiler, grammar, "Sure, " + CALL)[0]
    parsed = HermesParser(["get_weather", "ping"]).parse(two)
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "ping"] and parsed.content is None


def test_llama3_forced_grammar_is_the_json_the_parser_reads(compiler: GrammarCompiler) -> None:
    grammar = forced_call_grammar(compiler, "llama3", TOOLS, parallel=True)
    assert walk(compiler, grammar, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                   '{"name": "ping", "parameters": {}}')[0]
    assert not walk(compiler, grammar, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')[0]


# ---- tool schemas with any JSON Schema keyword (issue 42) ------------------------------------


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def complete(compiler: GrammarCompiler, grammar: Any, text: str) -> bool:
    """``text`` is a whole output of ``grammar``."""
    accepted, constraint = walk(compiler, grammar, text)
    return accepted and constraint.accepting


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def validate(arguments: Any, schema: dict[str, Any]) -> None:
    """Against the full schema, formats included (jsonschema's format extras)."""
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(arguments)


def shortest_call(compiler: GrammarCompiler, one: dict[str, Any]) -> Any:
    """The forced call the planner ends soonest with (what max_tokens_too_small says a call needs)."""
    grammar = forced_call_grammar(compiler, "hermes", [one], parallel=False)
    plan = compiler.start_plan(grammar)
    assert plan is not None, one["function"]["name"]
    [parsed] = HermesParser([one["function"]["name"]]).parse(embedded().tokenizer.decode(list(plan))).tool_calls
    return json.loads(parsed.arguments), len(plan)


@pytest.mark.parametrize("agent", sorted(AGENT_REQUESTS))
def test_agent_tool_sets_compile_under_auto_and_forced(compiler: GrammarCompiler, agent: str) -> None:
    """Claude Code 2.1.197's tools (``propertyNames``) failed both; every recorded agent's tool set
    now compiles whole, as the server combines it."""
    tools = agent_tools(agent)
    assert auto_call_grammar(compiler, "hermes", tools) is not None
    assert compiler.min_tokens(forced_call_grammar(compiler, "hermes", tools, parallel=True), 1 << 20) is not None


@pytest.mark.parametrize("agent", sorted(AGENT_REQUESTS))
def test_each_agent_tools_shortest_forced_call_is_valid(compiler: GrammarCompiler, agent: str) -> None:
    """For every tool of every recorded agent, the shortest call of its forced grammar is a
    complete call whose arguments validate against the tool's full schema (``format: uri``
    included, e.g. Claude Code's WebFetch)."""
    for one in agent_tools(agent):
        arguments, _ = shortest_call(compiler, one)
        validate(arguments, one["function"]["parameters"])


# A short valid value of each format: what a call needs at most beyond an empty string's.
FORMATS = {"uri": "a:", "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z",
           "email": "a@a", "uuid": "00000000-0000-0000-0000-000000000000", "hostname": "a", "ipv4": "0.0.0.0",
           "ipv6": "::", "duration": "P0D"}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_strings_need_what_a_valid_value_takes(compiler: GrammarCompiler, fmt: str) -> None:
    """A forced call with one string of ``format`` is planned with a valid value, in no more
    tokens than a short valid value of it takes. The planner used to walk a URI's scheme or an
    e-mail's local part to its cap, and call any such request's max_tokens too small."""
    schema = {"type": "object", "properties": {"value": {"type": "string", "format": fmt}}, "required": ["value"]}
    arguments, least = shortest_call(compiler, tool("put", schema))
    validate(arguments, schema)
    _, plain = shortest_call(compiler, tool("put", {**schema, "properties": {"value": {"type": "string"}}}))
    example = len(embedded().tokenizer(FORMATS[fmt], add_special_tokens=False).input_ids)
    assert least <= plain + example + 1, (fmt, arguments, least, plain, example)  # +1: '""' is one token


def address(**fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": fields, "required": sorted(fields), "additionalProperties": False}


SHIP = tool("ship", {  # pydantic's shape: a nested model under $defs, referred to by $ref
    "$defs": {"Address": address(zip={"type": "string", "pattern": "^[0-9]{5}$"})},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"]})
BILL = tool("bill", {  # another tool's Address, another shape
    "$defs": {"Address": address(street={"type": "string"})},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"]})
TREE = tool("tree", {  # recursion through the root and through a definition's anchor
    "$defs": {"Leaf": {"$anchor": "leaf", "type": "integer"}},
    "type": "object", "properties": {"value": {"$ref": "#leaf"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["value"], "additionalProperties": False})
OLD = tool("old", {  # draft-07: definitions, and a $ref's siblings are ignored
    "$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"N": {"type": "integer"}},
    "type": "object", "properties": {"n": {"$ref": "#/definitions/N", "type": "string"}}, "required": ["n"]})


@pytest.mark.parametrize("forced", [False, True])
def test_refs_resolve_against_each_tools_own_schema(compiler: GrammarCompiler, forced: bool) -> None:
    """``$defs`` + ``$ref`` in several tools of one grammar: each resolves against its own tool,
    also where two tools use the same definition name for different shapes."""
    tools = [SHIP, BILL, TREE, OLD]
    grammar = forced_call_grammar(compiler, "hermes", tools, parallel=False) if forced else \
        auto_call_grammar(compiler, "hermes", tools)
    good = [call("ship", {"to": {"zip": "75001"}}), call("bill", {"to": {"street": "Main"}}),
            call("tree", {"value": 1, "children": [{"value": 2, "children": []}]}), call("old", {"n": 3})]
    bad = [call("ship", {"to": {"street": "Main"}}), call("ship", {"to": {"zip": "7500"}}),
           call("bill", {"to": {"zip": "75001"}}), call("tree", {"value": 1, "children": [{"value": "x"}]}),
           call("old", {"n": "3"})]
    for text in good:
        assert complete(compiler, grammar, text), text
    for text in bad:
        assert not walk(compiler, grammar, text)[0], text


def test_dependent_required_is_enforced_exactly(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "zone": {"type": "string"}},
              "dependentRequired": {"city": ["country"]}}
    grammar = forced_call_grammar(compiler, "hermes", [tool("where", schema)], parallel=False)
    for arguments in ({"city": "Oslo", "country": "NO"}, {"country": "NO"}, {"zone": "CET"}, {}):
        assert complete(compiler, grammar, call("where", arguments)), arguments
    assert not complete(compiler, grammar, call("where", {"city": "Oslo"}))
    assert not complete(compiler, grammar, call("where", {"zone": "CET", "city": "Oslo"}))


def closed(properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "additionalProperties": False, **more}


APPROXIMATED = {  # keywords the engine does not implement: compiled leniently, they constrain nothing
    "propertyNames": closed({"m": {"type": "object", "propertyNames": {"pattern": "^a"}}}),
    "if_then": closed({"a": {"type": "string"}, "b": {"type": "integer"}},
                      **{"if": {"properties": {"a": {"const": "x"}}, "required": ["a"]}, "then": {"required": ["b"]}}),
    "uniqueItems": closed({"m": {"type": "array", "uniqueItems": True}}),
    "not": closed({"m": {"not": {"const": "x"}}}),
}


@pytest.mark.parametrize("keyword", sorted(APPROXIMATED))
@pytest.mark.parametrize("forced", [False, True])
def test_keywords_the_engine_lacks_are_accepted(compiler: GrammarCompiler, keyword: str, forced: bool) -> None:
    one = tool("f", APPROXIMATED[keyword])
    grammar = forced_call_grammar(compiler, "hermes", [one], parallel=False) if forced else \
        auto_call_grammar(compiler, "hermes", [one])
    assert grammar is not None
    assert complete(compiler, grammar, call("f", {}))
    assert not walk(compiler, grammar, call("f", {"z": 1}))[0]  # the other keywords still hold


LOOKBEHIND = tool("odd", {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?<=x)y"}}})


def test_a_schema_the_engine_cannot_compile(compiler: GrammarCompiler) -> None:
    """Under ``auto`` the request goes on (that tool's calls are any JSON object, the others
    keep their schemas); forced, it is a 400 naming the tool."""
    grammar = auto_call_grammar(compiler, "hermes", [TOOLS[0], LOOKBEHIND])
    assert grammar is not None
    assert complete(compiler, grammar, call("odd", {"s": 1, "t": [True]}))
    assert not walk(compiler, grammar, call("get_weather", {"town": "Oslo"}))[0]
    with pytest.raises(InvalidRequestError) as err:
        forced_call_grammar(compiler, "hermes", [TOOLS[0], LOOKBEHIND], parallel=False)
    assert err.value.param == "tools[1].function.parameters"


# ---- Qwen3-Coder's and Qwen3.5's markup (xml_function) --------------------------------------

EDIT = tool("edit", {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
    "mode": {"type": "string", "enum": ["replace", "insert"]}, "dry_run": {"type": "boolean"},
    "range": {"$ref": "#/$defs/Range"}},
    "required": ["path", "line"], "$defs": {"Range": {"type": "object", "properties": {
        "start": {"type": "integer"}, "end": {"type": "integer"}}, "required": ["start", "end"]}}})


def xml_call(name: str, **values: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_xml_forced_grammar_is_the_markup_the_parser_reads(compiler: GrammarCompiler) -> None:
    from kvcellar.server.tools.parsers import XmlFunctionParser

    grammar = forced_call_grammar(compiler, "xml_function", [EDIT, TOOLS[1]], parallel=True)
    good = xml_call("edit", path="src/lib.rs\nwith a newline </param>", line="12", mode="insert",
                    range='{"start": 1, "end": 2}')
    assert complete(compiler, grammar, good)
    assert complete(compiler, grammar, good + "\n" + xml_call("ping"))
    for bad in (xml_call("edit", line="12", path="a"),  # out of the schema's order
                xml_call("edit", path="a"),  # a required parameter missing
                xml_call("edit", path="a", line="zero"),  # not an integer
                xml_call("edit", path="a", line="0"),  # below the minimum
                xml_call("edit", path="a", line="3", mode="append"),  # not one of the enum
                xml_call("edit", path="a", line="3", range='{"start": 1}'),  # the $ref's required
                xml_call("nope"), "Sure. " + good):
        assert not complete(compiler, grammar, bad), bad
    parser = XmlFunctionParser(["edit", "ping"], {"edit": EDIT["function"]["parameters"]})
    ((name, arguments),) = [(c.name, c.arguments) for c in parser.parse(good).tool_calls]
    assert name == "edit"
    validate(json.loads(arguments), EDIT["function"]["parameters"])
    assert json.loads(arguments)["path"] == "src/lib.rs\nwith a newline </param>"
    plan = compiler.start_plan(forced_call_grammar(compiler, "xml_function", [EDIT], parallel=False))
    assert plan is not None
    (shortest,) = parser.parse(embedded().tokenizer.decode(list(plan))).tool_calls
    validate(json.loads(shortest.arguments), EDIT["function"]["parameters"])


def test_xml_auto_grammar_lets_text_through_and_keeps_calls_well_formed(compiler: GrammarCompiler) -> None:
    from kvcellar.server.tools.grammar import no_call_grammar

    grammar = auto_call_grammar(compiler, "xml_function", [EDIT, TOOLS[1]])
    assert grammar is not None and not grammar.steer_to_end
    call_text = xml_call("edit", path="a.py", line="3")
    for ok_text in ("Plain text with <function=x> and {json}.", f"Let me edit.\n{call_text}", call_text + call_text):
        assert walk(compiler, grammar, ok_text)[0], ok_text
    for bad in ("<tool_call>\n<function=nope>", "<tool_call>\n<function=edit>\n<parameter=line>\n",
                "<tool_call>\nplain words"):
        assert not walk(compiler, grammar, bad)[0], bad
    none = no_call_grammar(compiler, "xml_function")
    assert none is not None and not walk(compiler, none, "text " + call_text)[0]


# ---- Gemma 4's markup (gemma4) -----------------------------------------------------------------

Q = '<|"|>'


def gemma_call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


def test_gemma4_forced_grammar_is_the_notation_the_parser_reads(compiler: GrammarCompiler) -> None:
    from kvcellar.server.tools.parsers import Gemma4Parser

    grammar = forced_call_grammar(compiler, "gemma4", [EDIT, TOOLS[1]], parallel=True)
    # keys in the order the template's dictsort writes them; strings hold any text, braces too
    good = gemma_call("edit", f"dry_run:false,line:12,mode:{Q}insert{Q},path:{Q}src/{{lib}}.rs, \"x\"{Q},"
                              "range:{end:2,start:1}")
    assert complete(compiler, grammar, good)
    assert complete(compiler, grammar, good + gemma_call("ping", "") + gemma_call("edit", f"line:1,path:{Q}a{Q}"))
    for bad in (gemma_call("edit", f"path:{Q}a{Q},line:12"),  # out of the template's order
                gemma_call("edit", f"path:{Q}a{Q}"),  # a required parameter missing
                gemma_call("edit", f"line:zero,path:{Q}a{Q}"),  # not an integer
                gemma_call("edit", f"line:0,path:{Q}a{Q}"),  # below the minimum
                gemma_call("edit", f"line:3,mode:{Q}append{Q},path:{Q}a{Q}"),  # not one of the enum
                gemma_call("edit", f"line:3,path:{Q}a{Q},range:{{start:1}}"),  # the $ref's required
                gemma_call("edit", 'line:3,path:"a"'),  # JSON's quotes are not the notation's
                gemma_call("nope", ""), "Sure. " + good):
        assert not complete(compiler, grammar, bad), bad
    parser = Gemma4Parser(["edit", "ping"])
    ((name, arguments),) = [(c.name, c.arguments) for c in parser.parse(good).tool_calls]
    assert name == "edit"
    validate(json.loads(arguments), EDIT["function"]["parameters"])
    plan = compiler.start_plan(forced_call_grammar(compiler, "gemma4", [EDIT], parallel=False))
    assert plan is not None
    (shortest,) = parser.parse(embedded().tokenizer.decode(list(plan))).tool_calls
    validate(json.loads(shortest.arguments), EDIT["function"]["parameters"])


def test_gemma4_auto_grammar_lets_text_through_and_keeps_calls_well_formed(compiler: GrammarCompiler) -> None:
    grammar = auto_call_grammar(compiler, "gemma4", [EDIT, TOOLS[1]])
    assert grammar is not None and not grammar.steer_to_end
    call_text = gemma_call("edit", f"line:3,path:{Q}a.py{Q}")
    for ok_text in ("Plain text with call:x{} and {json}.", f"Let me edit.\n{call_text}", call_text + call_text):
        assert walk(compiler, grammar, ok_text)[0], ok_text
    for bad in ("<|tool_call>call:nope{", "<|tool_call>call:edit{line:x", "<|tool_call>plain words"):
        assert not walk(compiler, grammar, bad)[0], bad
    # where the call tag is a token of the vocabulary, calls are parsed only
    assert auto_call_grammar(compiler, "gemma4", [EDIT], {"<|tool_call>": 7}) is None
