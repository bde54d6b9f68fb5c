"""Tool schemas as the grammar sees them, and the check of a forced call's arguments.

Any valid JSON Schema (2020-12, 2019-09, draft-07 and older, as ``$schema`` says; 2020-12
without one) may describe a tool's parameters; one that is not valid JSON Schema is a 400
naming its field (tools/request.py). The grammar that keeps calls well-formed (tools/grammar.py)
enforces what the engine implements, after these rewrites (``for_grammar``):

* ``$ref``: several tools share one grammar, whose root is not theirs, so a schema that refers
  within itself moves under the grammar's ``$defs`` and its local references with it (``#``,
  ``#/...`` pointers, ``$anchor`` names); a schema with its own ``$id`` resolves against that.
* ``dependentRequired``, ``dependentSchemas`` (draft-07's ``dependencies``): each entry is
  "the property is absent, or present with these", an ``anyOf`` the engine enforces exactly,
  for up to ``MAX_DEPENDENCIES`` entries on one object (each doubles the object's branches).
* draft-07 and older: keywords beside a ``$ref`` are ignored, as those drafts say.

The grammar compiles leniently: every other keyword the engine does not implement constrains
nothing there (``not``, ``if``/``then``/``else``, ``uniqueItems``, ``contains``, ``propertyNames``,
``unevaluated*``, ``$dynamicRef``, a ``format`` it does not know). A forced call's arguments
are then checked against the full schema, formats included (``ArgumentsCheck``);
docs/structured-outputs.md says what follows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema

MAX_DEPENDENCIES = 3

# Where subschemas sit: one schema, a list of them, a map of them.
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "if", "then", "else", "not",
        "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_DEPENDENCY_KEYWORDS = ("dependentRequired", "dependentSchemas", "dependencies")
_OLD_DRAFTS = (jsonschema.Draft3Validator, jsonschema.Draft4Validator, jsonschema.Draft6Validator,
               jsonschema.Draft7Validator)


def for_grammar(schema: dict[str, Any], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` as one slot of a grammar that holds others: (what to put in the slot, the
    entries it needs in the grammar's root ``$defs``, under ``key`` only)."""
    cls = jsonschema.validators.validator_for(schema)
    rewrite = _Rewrite(cls, key if "$id" not in schema and _refers_to_itself(schema) else None)
    out = rewrite.schema(schema, root=True)
    if rewrite.key is None:
        return out, {}
    return {"$ref": f"#/$defs/{key}"}, {key: out}


def standalone(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` rewritten for a grammar of its own (its refs resolve against itself)."""
    slot, defs = for_grammar(schema, "tool")
    return {**slot, "$defs": defs} if defs else slot


class _Rewrite:
    def __init__(self, cls: type[Any], key: str | None) -> None:
        self.key = key  # None: references stay as they are
        self.keywords = cls.VALIDATORS
        self.old_refs = issubclass(cls, _OLD_DRAFTS)

    def schema(self, node: Any, *, root: bool = False, key: str | None = None) -> Any:
        if not isinstance(node, dict):
            return node
        if not root and "$id" in node:
            key = None  # a resource of its own: its references resolve against it
        elif root:
            key = self.key
        out: dict[str, Any] = {}
        for name, value in node.items():
            if name in _ONE and isinstance(value, dict | bool):
                out[name] = self.schema(value, key=key)
            elif name in _LIST and isinstance(value, list):
                out[name] = [self.schema(v, key=key) for v in value]
            elif name in _MAP and isinstance(value, dict):
                out[name] = {k: self.schema(v, key=key) if isinstance(v, dict | bool) else v for k, v in value.items()}
            elif name == "$ref" and isinstance(value, str) and key is not None:
                out[name] = _moved_ref(value, key)
            elif name == "$anchor" and isinstance(value, str) and key is not None:
                out[name] = f"{key}_{value}"
            else:
                out[name] = value
        if self.old_refs and "$ref" in out:  # draft-07 and older ignore a $ref's siblings
            out = {k: v for k, v in out.items() if k in ("$ref", "$id", "$schema", "definitions", "$defs")}
        return self._dependencies(out)

    def _dependencies(self, node: dict[str, Any]) -> dict[str, Any]:
        """Each dependency entry as ``anyOf: [present with it, absent]``, if there are few."""
        entries: list[tuple[str, Any]] = []
        for keyword in _DEPENDENCY_KEYWORDS:
            value = node.get(keyword)
            if keyword in self.keywords and isinstance(value, dict):
                entries += value.items()
        if not entries or len(entries) > MAX_DEPENDENCIES:
            return node
        out = {k: v for k, v in node.items() if k not in _DEPENDENCY_KEYWORDS or k not in self.keywords}
        branches: list[dict[str, Any]] = []
        for name, then in entries:
            if then is True or then == []:
                continue
            present: dict[str, Any] = {"required": [name, *then]} if isinstance(then, list) else \
                {"required": [name], "allOf": [then]}
            branches.append({"anyOf": [present, {"properties": {name: False}}]})
        if branches:
            out["allOf"] = [*out.get("allOf", []), *branches]
        return out


def _moved_ref(ref: str, key: str) -> str:
    if ref == "#" or ref.startswith("#/"):
        return f"#/$defs/{key}{ref[1:]}"
    if ref.startswith("#"):  # an anchor name
        return f"#{key}_{ref[1:]}"
    return ref  # another document: unresolvable here whatever we do


def _refers_to_itself(schema: dict[str, Any]) -> bool:
    """Whether a local ``$ref`` (``#...``) appears outside nested ``$id`` resources."""
    return any(isinstance(n.get("$ref"), str) and n["$ref"].startswith("#") for n in _nodes(schema))


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``node`` and every subschema in it that is an object, but not those of nested ``$id`` resources."""
    yield node
    for name, value in node.items():
        values: list[Any] = []
        if name in _ONE:
            values = [value]
        elif name in _LIST and isinstance(value, list):
            values = value
        elif name in _MAP and isinstance(value, dict):
            values = list(value.values())
        for v in values:
            if isinstance(v, dict) and "$id" not in v:
                yield from _nodes(v)


class ArgumentsCheck:
    """Checks a call's arguments against its tool's full schema (formats included)."""

    def __init__(self, schemas: Mapping[str, dict[str, Any]]) -> None:
        self._schemas = dict(schemas)
        self._validators: dict[str, Any] = {}

    def problem(self, name: str, arguments: str) -> str | None:
        """None if ``arguments`` (JSON text) is valid for tool ``name``, else what is wrong."""
        schema = self._schemas.get(name)
        if schema is None:
            return None
        try:
            value = json.loads(arguments)
        except ValueError:
            return "the arguments are not JSON"
        validator = self._validators.get(name)
        if validator is None:
            cls = jsonschema.validators.validator_for(schema)
            validator = self._validators[name] = cls(schema, format_checker=cls.FORMAT_CHECKER)
        try:
            error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        except Exception as exc:  # a $ref to another document: nothing to check it against
            return f"the schema cannot be checked: {exc}"
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"at {where}: {error.message} ({error.validator})"

