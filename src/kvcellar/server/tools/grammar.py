"""Grammars that force a valid tool call (``tool_choice: "required"`` or a named function).

The output must be exactly what the model family's parser reads back as calls, with
``arguments`` valid against the tool's ``parameters`` schema:

* ``hermes`` (and the fallback format): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  blocks separated by a newline when parallel calls are allowed;
* ``llama3``: ``{"name": ..., "parameters": {...}}``, several joined by ``; ``;
* ``mistral``: the ``[TOOL_CALLS]`` special token, then a JSON array of ``{"name", "arguments"}``.

With ``tool_choice: "auto"`` the model decides; for the Hermes markup (and so the fallback
format) ``auto_call_grammar`` still keeps what it decides well-formed: text is free, but
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
                        parallel: bool, mistral_token_id: int | None = None) -> Grammar:
    """A grammar whose every complete output is one call (or, with ``parallel``, one or
    more calls) of ``tools``."""
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
    else:  # hermes and the fallback format
        body = json.dumps(_call_schema(tools, "arguments"))
        lark = (f"start: {calls(chr(10))}\n"
                f"call: {_lit('<tool_call>' + chr(10))} body {_lit(chr(10) + '</tool_call>')}\n"
                f"body: %json {body}\n")
    return compiler.lark(lark, param="tools", description=f"tool_call:{family}")


def auto_call_grammar(compiler: GrammarCompiler, family: str, tools: Sequence[dict[str, Any]]) -> Grammar | None:
    """Free text with well-formed calls, or None where the family has no such grammar
    (llama3 and mistral outputs are parsed only). Never fails for a tool's schema: one the
    engine cannot compile takes any JSON object."""
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


def no_call_grammar(compiler: GrammarCompiler, family: str) -> Grammar | None:
    """``tool_choice: "none"`` with the tools still in the prompt (so the cached prefix is the
    one ``auto`` requests share): free text that never holds the call marker, or None where the
    family's markup is not plain text (llama3, mistral)."""
    if family != "hermes":
        return None
    lark = "start: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"
    return compiler.lark(lark, param="tool_choice", description=f"no_tool_call:{family}", steer_to_end=False)
