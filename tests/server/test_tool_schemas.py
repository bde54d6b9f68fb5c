"""Tool schemas with any JSON Schema keyword, through the real server on all three APIs.

Issue 42: a tool whose schema held a keyword llguidance does not implement (Claude Code
2.1.197's ``propertyNames``, ``if``/``then``, ``dependentRequired``, ``uniqueItems``, ``not``)
or pydantic's ``$defs`` + ``$ref`` made the whole request a 400, even under ``tool_choice``
``auto``; a forced call with a ``format: "uri"`` string was refused as needing more tokens
than any budget. Here each such schema, pydantic models (nesting, enums, unions, ``Optional``,
recursion, two tools with same-named definitions) and tools of the recorded agents (Claude Code
2.1.197 and 2.1.331, Codex, opencode) go through chat completions, Responses and Anthropic
Messages (each case through one of them, in turn), under
``auto`` and forced (``required``, a named function, ``any``, ``tool``). Every
request is answered; every forced call is checked with ``jsonschema`` against the tool's full
schema (formats included). The grammar enforces all but a few keywords (tools/schemas.py);
where a forced call breaks one of those, the server's own check must have counted it.

The requests go out together (the server batches them), once per module; each test reads
its cases' answers.
"""

from __future__ import annotations

import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from kvcellar.engine.constraints import GrammarCompiler
from kvcellar.server.tools.grammar import forced_call_grammar
from tests._models import embedded
from tests.helpers import MODEL, ServerProcess
from tests.server.agent_fixtures import agent_tools

APIS = ("chat", "responses", "messages")
CHOICES = ("auto", "forced")
AUTO_MAX_TOKENS = 8  # enough to show the request is served
FORCED_SLACK = 8  # tokens beyond the least a forced call needs


def function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def obj(properties: dict[str, Any], required: list[str], **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, **more}


# ---- the cases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    tools: list[dict[str, Any]]  # OpenAI-shaped
    ask: str
    named: str | None = None  # forced: this tool by name; None: any of them (required / any)


class Unit(StrEnum):
    piece = "piece"
    kg = "kg"


class Item(BaseModel):
    name: str = Field(max_length=40)
    quantity: int = Field(ge=1, le=100)
    unit: Unit


class Address(BaseModel):
    city: str = Field(max_length=40)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Card(BaseModel):
    last4: str = Field(pattern=r"^[0-9]{4}$")


class Cash(BaseModel):
    currency: str = Field(pattern=r"^[A-Z]{3}$")


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)
    ship_to: Address | None = None
    payment: Card | Cash
    note: str | None = None


class Node(BaseModel):
    label: str = Field(max_length=20)
    children: list[Node] = Field(default_factory=list, max_length=2)


class Street(BaseModel):  # another tool's "Address": a definition of the same name, another shape
    street: str = Field(max_length=40)


def pydantic_tool(name: str, description: str, model: type[BaseModel], defs_as: dict[str, str] | None = None
                  ) -> dict[str, Any]:
    schema = model.model_json_schema()
    for old, new in (defs_as or {}).items():  # rename a definition, and every reference to it
        text = json.dumps(schema).replace(f'"#/$defs/{old}"', f'"#/$defs/{new}"')
        schema = json.loads(text)
        schema["$defs"][new] = schema["$defs"].pop(old)
    return function(name, description, schema)


class Bill(BaseModel):
    to: Street
    amount: int = Field(ge=1, le=10000)


class Ship(BaseModel):
    to: Address
    weight_kg: int = Field(ge=1, le=100)


KEYWORDS = {  # one tool each: the issue's keywords and formats
    "propertyNames": Case([function("create_task", "Create a task", obj({  # Claude Code 2.1.197's TaskCreate shape
        "subject": {"type": "string", "description": "A brief title for the task"},
        "metadata": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}}},
        ["subject"], additionalProperties=False))], "Create a task to fix the login bug."),
    "if_then": Case([function("open", "Open a file or a web page", obj({
        "kind": {"type": "string", "enum": ["file", "url"]}, "path": {"type": "string"}, "url": {"type": "string"}},
        ["kind"], **{"if": {"properties": {"kind": {"const": "file"}}}, "then": {"required": ["path"]},
                     "else": {"required": ["url"]}}))], "Open the file notes.txt."),
    "dependentRequired": Case([function("set_location", "Set the user's location", obj({
        "city": {"type": "string"}, "country": {"type": "string"}}, [],
        dependentRequired={"city": ["country"]}, additionalProperties=False))], "Set my location to Paris, France."),
    "uniqueItems": Case([function("tag_post", "Tag a blog post", obj({
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "uniqueItems": True,
                 "minItems": 1, "maxItems": 3}}, ["tags"]))], "Tag my post about cooking and travel."),
    "not": Case([function("create_user", "Create a user account", obj({
        "username": {"type": "string", "maxLength": 20, "not": {"enum": ["root", "admin"]}}}, ["username"]))],
        "Create a user account for Alice."),
    "$defs_$ref": Case([pydantic_tool("place_order", "Place an order", Order)], "Order two kilograms of apples."),
    "format_uri": Case([function("fetch", "Fetch a web page", obj({  # Claude Code's WebFetch shape
        "url": {"type": "string", "format": "uri"}, "prompt": {"type": "string", "maxLength": 60}},
        ["url", "prompt"], additionalProperties=False))], "Fetch https://example.com and summarize it."),
    "format_date-time": Case([function("schedule", "Schedule a meeting", obj({
        "at": {"type": "string", "format": "date-time"}, "title": {"type": "string", "maxLength": 40}},
        ["at", "title"]))], "Schedule a team meeting on March 1st 2026 at 10:00 UTC."),
    "format_email": Case([function("invite", "Invite someone by e-mail", obj({
        "email": {"type": "string", "format": "email"}}, ["email"]))], "Invite bob@example.com to the project."),
    "format_uuid": Case([function("get_order", "Look up an order", obj({
        "id": {"type": "string", "format": "uuid"}}, ["id"]))], "Look up order 123e4567-e89b-12d3-a456-426614174000."),
}


def agent_tool(agent: str, name: str) -> dict[str, Any]:
    return next(t for t in agent_tools(agent) if t["function"]["name"] == name)


CORPUS = {
    "pydantic_tree": Case([pydantic_tool("save_tree", "Save a tree of labels", Node)],
                          "Save a tree: root with two leaves.", named="save_tree"),
    "pydantic_two_tools": Case([pydantic_tool("ship", "Ship a parcel", Ship),
                                pydantic_tool("bill", "Send a bill", Bill, defs_as={"Street": "Address"})],
                               "Ship a 3 kg parcel to Lyon, 69001."),
    "pydantic_order_named": Case([pydantic_tool("place_order", "Place an order", Order)], "Buy three pears.",
                                 named="place_order"),
    "claude_code_2.1.197_TaskCreate": Case([agent_tool("claude_code_2.1.197", "TaskCreate")],
                                           "Create a task to write the release notes.", named="TaskCreate"),
    "claude_code_2.1.197_WebFetch": Case([agent_tool("claude_code_2.1.197", "WebFetch")],
                                         "Read https://example.com/docs for me.", named="WebFetch"),
    "claude_code_2.1.331_ReportFindings": Case([agent_tool("claude_code_2.1.331", "ReportFindings")],
                                               "Report that the code has no bugs.", named="ReportFindings"),
    "codex_request_user_input": Case([agent_tool("codex_0.169.0", "request_user_input")],
                                     "Ask me which color I prefer.", named="request_user_input"),
    "opencode_todowrite": Case([agent_tool("opencode_1.18.33", "todowrite")], "Plan: write tests, then fix the bug.",
                               named="todowrite"),
    "opencode_webfetch": Case([agent_tool("opencode_1.18.33", "webfetch")], "Fetch https://example.com.",
                              named="webfetch"),
}
CASES = {**KEYWORDS, **CORPUS}
# Each case through one API, in turn: every API meets several keywords and schemas, and the
# three differ only in how a tool reaches the one grammar (tests/server/test_tool_grammar.py
# walks that grammar for every keyword); every case on all three took 140 s of the suite.
PAIRS = [(key, APIS[i % len(APIS)]) for i, key in enumerate([*sorted(KEYWORDS), *sorted(CORPUS)])]
# Keywords the grammar does not enforce (docs/structured-outputs.md): a forced call may break them.
APPROXIMATED = {"if_then", "uniqueItems", "not"}


# ---- one request on each API ---------------------------------------------------------------


def request(api: str, case: Case, choice: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """(path, body) asking ``case`` on ``api``."""
    fns = [t["function"] for t in case.tools]
    messages = [{"role": "user", "content": case.ask}]
    if api == "chat":
        forced: Any = "required" if case.named is None else {"type": "function", "function": {"name": case.named}}
        return "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": case.tools, "temperature": 0,
                                        "max_tokens": max_tokens, "tool_choice": "auto" if choice == "auto" else forced}
    if api == "responses":
        forced = "required" if case.named is None else {"type": "function", "name": case.named}
        return "/v1/responses", {"model": MODEL, "input": case.ask, "temperature": 0, "max_output_tokens": max_tokens,
                                 "tools": [{"type": "function", **f} for f in fns],
                                 "tool_choice": "auto" if choice == "auto" else forced}
    forced = {"type": "any"} if case.named is None else {"type": "tool", "name": case.named}
    return "/v1/messages", {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
                            "tools": [{"name": f["name"], "description": f["description"],
                                       "input_schema": f["parameters"]} for f in fns],
                            "tool_choice": {"type": "auto"} if choice == "auto" else forced}


@dataclass
class Answer:
    status: int
    body: dict[str, Any]
    calls: list[tuple[str, Any]]  # (tool name, arguments: JSON text, or Anthropic's object)
    called: bool  # the API's own finish reason says the output is tool calls
    seconds: float


def answer(api: str, status: int, body: dict[str, Any], seconds: float) -> Answer:
    if status != 200:
        return Answer(status, body, [], False, seconds)
    if api == "chat":
        choice = body["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
        return Answer(status, body, calls, choice["finish_reason"] == "tool_calls", seconds)
    if api == "responses":
        items = [o for o in body["output"] if o["type"] == "function_call"]
        return Answer(status, body, [(o["name"], o["arguments"]) for o in items],
                      bool(items) and body["status"] == "completed", seconds)
    blocks = [b for b in body["content"] if b["type"] == "tool_use"]
    return Answer(status, body, [(b["name"], b["input"]) for b in blocks], body["stop_reason"] == "tool_use", seconds)


def parsed(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


@pytest.fixture(scope="module")
def least() -> dict[str, int]:
    """The least max_tokens of each case's forced call, from the server's own compiler code on
    the same tokenizer (the server refuses less with max_tokens_too_small)."""
    loaded = embedded()
    compiler = GrammarCompiler(loaded.tokenizer, int(loaded.model.config.vocab_size), loaded.eos_token_ids)
    out = {}
    for key, case in CASES.items():
        tools = [t for t in case.tools if case.named in (None, t["function"]["name"])]
        found = compiler.min_tokens(forced_call_grammar(compiler, "hermes", tools, parallel=False), 1 << 20)
        assert found is not None, key
        out[key] = found
    return out


@dataclass
class Batch:
    answers: dict[tuple[str, str, str], Answer]
    checked: int  # the server's count of forced calls it checked against their schemas, in this batch
    invalid: int  # and of those that failed


def server_counts(server: ServerProcess) -> tuple[int, int]:
    stats = server.health()["server"]
    return stats["server_tool_arguments_checked"], stats["server_tool_arguments_invalid"]


@pytest.fixture(scope="module")
def batch(server: ServerProcess, least: dict[str, int]) -> Batch:
    def one(key: str, api: str, choice: str) -> Answer:
        max_tokens = AUTO_MAX_TOKENS if choice == "auto" else least[key] + FORCED_SLACK
        path, body = request(api, CASES[key], choice, max_tokens)
        t0 = time.monotonic()
        r = server.post(path, copy.deepcopy(body), timeout=600.0)
        return answer(api, r.status_code, r.json(), time.monotonic() - t0)

    keys = [(key, api, choice) for key, api in PAIRS for choice in CHOICES]
    before = server_counts(server)
    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = dict(zip(keys, pool.map(lambda k: one(*k), keys), strict=True))
    server.wait_idle()
    after = server_counts(server)
    return Batch(answers, after[0] - before[0], after[1] - before[1])


def schemas_of(case: Case) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}


def problems(case: Case, calls: list[tuple[str, Any]]) -> list[str]:
    """What ``jsonschema`` finds wrong with each call, against its tool's full schema."""
    out = []
    for name, arguments in calls:
        schema = schemas_of(case)[name]
        cls = jsonschema.validators.validator_for(schema)
        errors = cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(parsed(arguments))
        out += [f"{name}: {e.message}" for e in errors]
    return out


# ---- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "api"), PAIRS)
def test_auto_is_served(batch: Batch, key: str, api: str) -> None:
    """Under ``auto`` the schema is never a reason to refuse; a call the model starts is kept
    well-formed (a JSON object for one of the tools)."""
    a = batch.answers[(key, api, "auto")]
    assert a.status == 200, a.body
    for name, arguments in a.calls:
        assert name in schemas_of(CASES[key]), a.calls
        if a.called:  # not cut by max_tokens
            assert isinstance(parsed(arguments), dict), a.calls


@pytest.mark.parametrize(("key", "api"), PAIRS)
def test_forced_call_validates_against_the_full_schema(batch: Batch, key: str, api: str) -> None:
    a = batch.answers[(key, api, "forced")]
    case = CASES[key]
    assert a.status == 200, a.body
    assert a.called and a.calls, a.body
    assert all(name == case.named for name, _ in a.calls) if case.named else True, a.calls
    found = problems(case, a.calls)
    if key not in APPROXIMATED:
        assert not found, (a.calls, found)


def test_the_server_counts_forced_calls_that_break_a_keyword_it_does_not_enforce(batch: Batch) -> None:
    """The server checks every forced call against the full schema, as ``jsonschema`` does here."""
    forced = [(CASES[key], a) for (key, _, choice), a in batch.answers.items() if choice == "forced"]
    assert batch.checked == sum(len(a.calls) for _, a in forced)
    assert batch.invalid == sum(1 for case, a in forced for call in a.calls if problems(case, [call]))

