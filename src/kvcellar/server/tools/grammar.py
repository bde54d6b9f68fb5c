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
function, so the name decides which arguments schema applies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvcellar.engine.constraints import JSON_STYLE, Grammar, GrammarCompiler
from kvcellar.errors import InvalidRequestError

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params is not None else EMPTY_PARAMETERS


def _call_schema(tools: Sequence[dict[str, Any]], args_key: str) -> dict[str, Any]:
    branches = [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]}, args_key: parameters_of(t)},
        "required": ["name", args_key],
        "additionalProperties": False,
    } for t in tools]
    schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {**schema, "x-guidance": JSON_STYLE}


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


def forced_call_grammar(compiler: GrammarCompiler, family: str, tools: Sequence[dict[str, Any]], *,
                        parallel: bool, mistral_token_id: int | None = None) -> Grammar:
    """A grammar whose every complete output is one call (or, with ``parallel``, one or
    more calls) of ``tools``."""
    for i, tool in enumerate(tools):  # blame the right tool for a schema the engine refuses
        compiler.json_schema(parameters_of(tool), param=f"tools[{i}].function.parameters")

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
    (llama3 and mistral outputs are parsed only)."""
    if family != "hermes":
        return None
    for i, tool in enumerate(tools):
        compiler.json_schema(parameters_of(tool), param=f"tools[{i}].function.parameters")
    body = json.dumps(_call_schema(tools, "arguments"))
    lark = ("%llguidance {}\n"
            "start: call* TEXT\n"
            f"call: call_trigger {_lit(chr(10))} body {_lit(chr(10) + '</tool_call>')}\n"
            f"call_trigger[lazy]: TEXT {_lit('<tool_call>')}\n"
            f"body: %json {body}\n"
            "TEXT: /(.|\\n)*/\n")
    return compiler.lark(lark, param="tools", description=f"tool_call_auto:{family}", steer_to_end=False)


def no_call_grammar(compiler: GrammarCompiler, family: str) -> Grammar | None:
    """``tool_choice: "none"`` with the tools still in the prompt (so the cached prefix is the
    one ``auto`` requests share): free text that never holds the call marker, or None where the
    family's markup is not plain text (llama3, mistral)."""
    if family != "hermes":
        return None
    lark = "start: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/\n"
    return compiler.lark(lark, param="tool_choice", description=f"no_tool_call:{family}", steer_to_end=False)
