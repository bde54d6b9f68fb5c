"""Grammars that force a valid tool call (``tool_choice: "required"`` or a named function).

The output must be exactly what the model family's parser reads back as calls, with
``arguments`` valid against the tool's ``parameters`` schema:

* ``hermes`` (and the fallback format): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  blocks separated by a newline when parallel calls are allowed;
* ``llama3``: ``{"name": ..., "parameters": {...}}``, several joined by ``; ``;
* ``mistral``: the ``[TOOL_CALLS]`` special token, then a JSON array of ``{"name", "arguments"}``;
* ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``
  then the arguments (one call: its ``<|call|>`` token ends the output);
* ``xml_function`` (Qwen3-Coder, Qwen3.5): ``<tool_call>\n<function=NAME>\n``, then per parameter
  ``<parameter=P>\nVALUE\n</parameter>\n`` in the schema's order (required ones always,
  others optional), then ``</function>\n</tool_call>``; a string value is free text up to its
  closing tag (one of its ``enum`` where it has one), any other value JSON valid against its
  schema;
* ``gemma4`` (Gemma 4): ``<|tool_call>call:NAME{ARGS}<tool_call|>``, ARGS in the template's own
  notation (tools/gemma4_syntax.py), several calls one after the other.

With ``tool_choice: "auto"`` the model decides; for the Hermes and XML markups (and so the
fallback format) ``auto_call_grammar`` still keeps what it decides well-formed: text is free, but
once ``<tool_call>`` appears (a lazy trigger: it matches wherever the text contains it),
the block must be a valid call followed by ``</tool_call>``.

Each call body is an inline JSON schema (``%json``) with one ``anyOf`` branch per allowed
function, so the name decides which arguments schema applies. Schemas are compiled leniently
and rewritten first (tools/schemas.py): a keyword the engine does not implement constrains
nothing. A forced call's schema that the engine cannot compile even so (a pattern with
look-around, a ``$ref`` to another document) is a 400 naming the tool; under ``auto`` such a
tool's calls are kept well-formed JSON objects only, and the request goes on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from kvcellar.engine.constraints import LENIENT_JSON_STYLE, Grammar, GrammarCompiler
from kvcellar.errors import InvalidRequestError
from kvcellar.server.tools import gemma4_syntax
from kvcellar.server.tools.schemas import for_grammar, standalone

log = logging.getLogger(__name__)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params is not None else EMPTY_PARAMETERS


def _call_schema(tools: Sequence[dict[str, Any]], args_key: str,
                 relaxed: frozenset[int] = frozenset()) -> dict[str, Any]:
    """One branch per tool; the tools in ``relaxed`` (indexes) take any JSON object."""
    defs: dict[str, Any] = {}
    branches = []
    for i, t in enumerate(tools):
        slot, more = ({"type": "object"}, {}) if i in relaxed else for_grammar(parameters_of(t), f"tool{i}")
        defs.update(more)
        branches.append({
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, args_key: slot},
            "required": ["name", args_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    if defs:
        schema = {**schema, "$defs": defs}
    return {**schema, "x-guidance": LENIENT_JSON_STYLE}


def _compile_each(compiler: GrammarCompiler, tools: Sequence[dict[str, Any]]) -> None:
    """Each tool's schema alone, so that a failure names its tool."""
    for i, tool in enumerate(tools):
        compiler.json_schema(standalone(parameters_of(tool)), param=f"tools[{i}].function.parameters", lenient=True)


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


def forced_call_grammar(compiler: GrammarCompiler, family: str, tools: Sequence[dict[str, Any]], *,
                        parallel: bool, mistral_token_id: int | None = None,
                        harmony_ids: tuple[int, int, int] | None = None,
                        markup_tokens: dict[str, int] | None = None) -> Grammar:
    """A grammar whose every complete output is one call (or, with ``parallel``, one or
    more calls) of ``tools``. ``harmony_ids``: gpt-oss's <|channel|>, <|constrain|> and
    <|message|> tokens (a harmony output holds one call: its end token ends the output).
    ``markup_tokens``: the family's markup texts that are single tokens (Gemma 4's)."""
    _compile_each(compiler, tools)  # blame the right tool for a schema the engine refuses

    def calls(separator: str) -> str:
        return f"call ({_lit(separator)} call)*" if parallel else "call"

    if family == "llama3":
        body = json.dumps(_call_schema(tools, "parameters"))
        lark = f"start: {calls('; ')}\ncall: %json {body}\n"
    elif family == "mistral":
        if mistral_token_id is None:
            raise InvalidRequestError("this model's tokenizer has no [TOOL_CALLS] token", param="tool_choice")
        body = json.dumps(_call_schema(tools, "arguments"))
        lark = f"start: <[{mistral_token_id}]> {_lit('[')} {calls(', ')} {_lit(']')}\ncall: %json {body}\n"
    elif family == "harmony":
        if harmony_ids is None:
            raise InvalidRequestError("this model's tokenizer has no harmony tokens", param="tool_choice")
        lark = _harmony_call(tools, *harmony_ids)
    elif family == "gemma4":
        rules = gemma4_syntax.Gemma4Rules(markup_tokens)
        lark = (f"start: {'call+' if parallel else 'call'}\n"
                f"call: {rules.tok(gemma4_syntax.OPEN)} {_lit('call:')} function {rules.tok(gemma4_syntax.CLOSE)}\n"
                + rules.functions(tools))
    elif family == "xml_function":
        lark = (f"start: {calls(chr(10))}\n"
                f"call: {_lit('<tool_call>' + chr(10))} function {_lit('</tool_call>')}\n"
                + _xml_functions(tools))
    else:  # hermes and the fallback format
        body = json.dumps(_call_schema(tools, "arguments"))
        lark = (f"start: {calls(chr(10))}\n"
                f"call: {_lit('<tool_call>' + chr(10))} body {_lit(chr(10) + '</tool_call>')}\n"
                f"body: %json {body}\n")
    return compiler.lark(lark, param="tools", description=f"tool_call:{family}")


def _harmony_call(tools: Sequence[dict[str, Any]], channel: int, constrain: int, message: int) -> str:
    """One call in gpt-oss's harmony format: ``<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>`` and the arguments, JSON valid against NAME's schema."""
    rules = [f"start: <[{channel}]> {_lit('commentary to=functions.')} function",
             f"function: {' | '.join(f'function{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        slot, defs = for_grammar(parameters_of(tool), f"tool{i}")
        schema = {**slot, **({"$defs": defs} if defs else {}), "x-guidance": LENIENT_JSON_STYLE}
        rules.append(f"function{i}: {_lit(tool['function']['name'] + ' ')} <[{constrain}]> {_lit('json')} "
                     f"<[{message}]> %json {json.dumps(schema)}")
    return "\n".join(rules) + "\n"


def _xml_functions(tools: Sequence[dict[str, Any]], relaxed: frozenset[int] = frozenset()) -> str:
    """The ``function`` rule of the XML markup (and its parts): one branch per tool; the
    tools in ``relaxed`` (indexes) take any parameters with text values."""
    rules = [f"function: {' | '.join(f'function{i}' for i in range(len(tools)))}",
             # A string value: any text up to the first closing tag, where the parser ends it too
             # (a lazy lexeme ends there); the template's newline before the tag is the value's.
             f"text_value[lazy]: /(.|\\n)*/ {_lit('</parameter>')}"]
    for i, tool in enumerate(tools):
        head = _lit(f"<function={tool['function']['name']}>\n")
        if i in relaxed:
            rules.append(f"function{i}: {head} any_parameter* {_lit('</function>' + chr(10))}")
            continue
        schema = parameters_of(tool)
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = []
        for j, (name, prop) in enumerate(properties.items()):
            rule = f"p{i}_{j}"
            rules.append(f"{rule}: {_lit(f'<parameter={name}>' + chr(10))} {_xml_value(schema, prop)}")
            parts.append(rule if name in required else f"{rule}?")
        rules.append(f"function{i}: {head} {' '.join(parts)} {_lit('</function>' + chr(10))}")
    if relaxed:
        rules.append(f"any_parameter: {_lit('<parameter=')} /[^>\\n]+/ {_lit('>' + chr(10))} text_value "
                     f"{_lit(chr(10))}")
    return "\n".join(rules) + "\n"


def _xml_value(root: dict[str, Any], prop: Any) -> str:
    """A parameter's value and closing tag: text for a string, else JSON of its schema."""
    prop = prop if isinstance(prop, dict) else {}
    enum = prop.get("enum")
    if prop.get("type") == "string" or (isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum)):
        if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            options = " | ".join(_lit(e) for e in enum)
            return f"({options}) {_lit(chr(10) + '</parameter>' + chr(10))}"
        return f"text_value {_lit(chr(10))}"
    defs: dict[str, Any] = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in prop}
    slot = standalone({**prop, **defs})
    return f"%json {json.dumps({**slot, 'x-guidance': LENIENT_JSON_STYLE})} {_lit(chr(10) + '</parameter>' + chr(10))}"


def auto_call_grammar(compiler: GrammarCompiler, family: str, tools: Sequence[dict[str, Any]],
                      markup_tokens: dict[str, int] | None = None) -> Grammar | None:
    """Free text with well-formed calls, or None where the family has no such grammar
    (llama3 and mistral outputs are parsed only, and Gemma 4's where its call tag is a token
    of its own, which free text cannot be watched for). Never fails for a tool's schema: one
    the engine cannot compile takes any JSON object (any parameters, in the XML markup)."""
    if family == "xml_function":
        return _auto_xml(compiler, tools)
    if family == "gemma4":
        return None if gemma4_syntax.OPEN in (markup_tokens or {}) else _auto_gemma4(compiler, tools)
    if family != "hermes":
        return None
    relaxed = set()
    for i, tool in enumerate(tools):
        try:
            compiler.json_schema(standalone(parameters_of(tool)), param="tools", lenient=True)
        except InvalidRequestError as exc:
            log.warning("tool %r: its calls are kept well-formed JSON only: %s", tool["function"]["name"], exc)
            relaxed.add(i)
    body = json.dumps(_call_schema(tools, "arguments", frozenset(relaxed)))
    lark = ("%llguidance {}\n"
            "start: call* TEXT\n"
            f"call: call_trigger {_lit(chr(10))} body {_lit(chr(10) + '</tool_call>')}\n"
            f"call_trigger[lazy]: TEXT {_lit('<tool_call>')}\n"
            f"body: %json {body}\n"
            "TEXT: /(.|\\n)*/\n")
    try:
        return compiler.lark(lark, param="tools", description=f"tool_call_auto:{family}", steer_to_end=False)
    except InvalidRequestError as exc:  # the tools together (each compiles alone): calls are parsed only
        log.warning("tools: calls are parsed only, the grammar engine cannot combine their schemas: %s", exc)
        return None


def _auto_xml(compiler: GrammarCompiler, tools: Sequence[dict[str, Any]]) -> Grammar | None:
    relaxed = set()
    for i, tool in enumerate(tools):
        try:
            compiler.lark(f"start: function\n{_xml_functions([tool])}", param="tools",
                          description="tool_call_check:xml_function")
        except InvalidRequestError as exc:
            log.warning("tool %r: its calls are kept well-formed markup only: %s", tool["function"]["name"], exc)
            relaxed.add(i)
    return _calls_in_text(compiler, "xml_function", "<tool_call>", "\n", _xml_functions(tools, frozenset(relaxed)),
                          "</tool_call>")


def _auto_gemma4(compiler: GrammarCompiler, tools: Sequence[dict[str, Any]]) -> Grammar | None:
    """Gemma 4 calls among free text, where its markup is plain text."""
    return _calls_in_text(compiler, "gemma4", gemma4_syntax.OPEN, "call:", gemma4_syntax.Gemma4Rules().functions(tools),
                          gemma4_syntax.CLOSE)


def _calls_in_text(compiler: GrammarCompiler, family: str, trigger: str, head: str, functions: str,
                   close: str) -> Grammar | None:
    """Free text in which ``trigger`` (wherever it appears) starts a call: ``head``, the
    ``function`` rule of ``functions``, then ``close``; None where the engine cannot compile it."""
    lark = ("%llguidance {}\n"
            "start: call* TEXT\n"
            f"call: call_trigger {_lit(head)} function {_lit(close)}\n"
            f"call_trigger[lazy]: TEXT {_lit(trigger)}\n"
            + functions +
            "TEXT: /(.|\\n)*/\n")
    try:
        return compiler.lark(lark, param="tools", description=f"tool_call_auto:{family}", steer_to_end=False)
    except InvalidRequestError as exc:
        log.warning("tools: calls are parsed only, the grammar engine cannot combine their schemas: %s", exc)
        return None


def no_call_grammar(compiler: GrammarCompiler, family: str) -> Grammar | None:
    """``tool_choice: "none"`` with the tools still in the prompt (so the cached prefix is the
    one ``auto`` requests share): free text that never holds the call marker, or None where the
    family's markup is not plain text (llama3, mistral)."""
    if family not in ("hermes", "xml_function"):
        return None
    lark = "start: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"
    return compiler.lark(lark, param="tool_choice", description=f"no_tool_call:{family}", steer_to_end=False)
