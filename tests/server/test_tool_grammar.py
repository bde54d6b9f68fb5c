"""The grammars behind tool calls, walked token by token with the embedded tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from kvcellar.engine.constraints import GrammarCompiler
from kvcellar.server.tools.grammar import auto_call_grammar, forced_call_grammar
from kvcellar.server.tools.parsers import HermesParser
from tests._models import embedded

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
