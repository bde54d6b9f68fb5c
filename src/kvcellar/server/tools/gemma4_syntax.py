"""Gemma 4's tool calls as a grammar: ``<|tool_call>call:NAME{ARGS}<tool_call|>``, ARGS in the
chat template's own notation (what ``parsers/gemma4.py`` reads): keys bare and in sorted order
(the template writes a call's arguments ``dictsort``-ed, so a forced call is the text the
template writes when the call comes back in the next turn's prompt, which the prefix cache
then serves), strings between ``<|"|>`` delimiters, numbers, ``true``/``false``/``null``,
objects and arrays nested.

A parameter's schema shapes its value where it says what it is: ``type`` (one or several),
``enum``/``const``, an object's ``properties`` (its ``required`` ones always written, the
others optional), an array's ``items``, ``anyOf``/``oneOf`` branches and local ``$ref``s; any
other schema takes any value of the notation. The server checks a forced call's arguments
against the full schema afterwards, as for every family.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

QUOTE = '<|"|>'
OPEN = "<|tool_call>"
CLOSE = "<tool_call|>"
# Nesting beyond which a value takes the notation's generic rule (recursive schemas end there).
_MAX_DEPTH = 12
_INTEGER = r"/-?(0|[1-9][0-9]*)/"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


class Gemma4Rules:
    """Lark rules of Gemma 4 calls. ``tokens``: the markup's texts that are single tokens of the
    model's vocabulary (written ``<[id]>``: a special token is never matched by text)."""

    def __init__(self, tokens: Mapping[str, int] | None = None) -> None:
        self._tokens = dict(tokens or {})
        self._rules: list[str] = []
        self._count = 0

    def tok(self, text: str) -> str:
        token = self._tokens.get(text)
        return f"<[{token}]>" if token is not None else _lit(text)

    def functions(self, tools: Sequence[dict[str, Any]], relaxed: frozenset[int] = frozenset()) -> str:
        """The ``function`` rule (``NAME{ARGS}``, one branch per tool; the tools in ``relaxed``
        take any arguments) and every rule it needs, as Lark text."""
        branches = []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {}
            body = self._members(params, params, 0) if i not in relaxed else "g_members?"
            branches.append(self._new(f"{_lit(fn['name'] + '{')} {body} {_lit('}')}"))
        quote = self.tok(QUOTE)
        # A string's text: up to the closing delimiter, where the parser ends it too. Where the
        # delimiter is a token of its own (text never matches one), text without "<|", which
        # holds any spelled-out delimiter.
        text = "g_text[lazy]: /(.|\\n)*/ " + quote if QUOTE not in self._tokens else "G_TEXT: /([^<]|<+[^|<])*<*/"
        generic = [
            f"g_string: {quote} g_text" if QUOTE not in self._tokens else f"g_string: {quote} G_TEXT {quote}",
            text,
            f"g_value: g_string | {_NUMBER} | \"true\" | \"false\" | \"null\" | g_object | g_array",
            "g_object: \"{\" g_members? \"}\"",
            "g_members: g_member (\",\" g_member)*",
            "g_member: /[A-Za-z_][A-Za-z0-9_.\\-]*/ \":\" g_value",
            "g_array: \"[\" (g_value (\",\" g_value)*)? \"]\"",
        ]
        return "\n".join([f"function: {' | '.join(branches)}", *self._rules, *generic]) + "\n"

    def _new(self, body: str) -> str:
        name = f"g{self._count}"
        self._count += 1
        self._rules.append(f"{name}: {body}")
        return name

    def _resolve(self, schema: Any, root: Mapping[str, Any]) -> Any:
        ref = schema.get("$ref") if isinstance(schema, Mapping) else None
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(ref, str) and ref.startswith(prefix):
                found = (root.get(prefix[2:-1]) or {}).get(ref[len(prefix):])
                return found if isinstance(found, Mapping) else {}
        return {} if ref is not None else schema

    def value(self, schema: Any, root: Mapping[str, Any], depth: int) -> str:
        """An expression for one value valid against ``schema`` (as far as the notation's rules go)."""
        schema = self._resolve(schema, root)
        if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
            return "g_value"
        if "const" in schema:
            return self._literal_value(schema["const"])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return self._new(" | ".join(self._literal_value(v) for v in enum))
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            return self._new(" | ".join(self.value(b, root, depth + 1) for b in branches))
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
        if len(kinds) != 1:
            return self._new(" | ".join(self.value({**schema, "type": k}, root, depth) for k in kinds)) \
                if kinds else "g_value"
        kind = kinds[0]
        if kind == "string":
            return "g_string"
        if kind in ("integer", "number"):  # written as JSON writes them: its bounds apply
            bounds = {k: schema[k] for k in _NUMBER_KEYWORDS if k in schema}
            return f"%json {json.dumps({'type': kind, **bounds})}" if bounds else _INTEGER if kind == "integer" \
                else _NUMBER
        if kind == "boolean":
            return "(\"true\" | \"false\")"
        if kind == "null":
            return "\"null\""
        if kind == "array":
            item = self.value(schema.get("items", {}), root, depth + 1)
            return self._new(f"\"[\" ({item} (\",\" {item})*)? \"]\"")
        if kind == "object":
            return self._new(f"\"{{\" {self._members(schema, root, depth + 1)} \"}}\"")
        return "g_value"

    def _members(self, schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> str:
        """An object's members in sorted key order: the required ones always, the others where
        the model writes them, commas between (an empty expression where it has none)."""
        properties = schema.get("properties")
        if not isinstance(properties, Mapping) or not properties:
            return "g_members?" if schema.get("additionalProperties", True) is not False else ""
        required = set(schema.get("required") or ())
        members = [(key, f"{_lit(key + ':')} {self.value(properties[key], root, depth)}")
                   for key in sorted(properties, key=str.lower)]  # as Jinja's dictsort orders them
        # first / rest: members k.. of the object, with no member written yet / after one
        # ("": nothing left to write).
        first, rest = "", ""
        for key, member in reversed(members):
            seq_first = f"{member} {rest}".strip()
            seq_rest = f"\",\" {member} {rest}".strip()
            if key in required:
                first, rest = self._new(seq_first), self._new(seq_rest)
            else:
                first, rest = (self._new(f"{seq_first} | {first}" if first else f"({seq_first})?"),
                               self._new(f"{seq_rest} | {rest}" if rest else f"({seq_rest})?"))
        return first

    def _literal_value(self, value: Any) -> str:
        if isinstance(value, str):
            return f"{self.tok(QUOTE)} {_lit(value)} {self.tok(QUOTE)}"
        if isinstance(value, bool):
            return _lit("true" if value else "false")
        if value is None:
            return _lit("null")
        if isinstance(value, (int, float)):
            return _lit(json.dumps(value))
        return "g_value"
