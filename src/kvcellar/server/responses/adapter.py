"""A Responses request -> the internal request (server/internal.py).

* ``instructions`` become the first system message; ``developer`` and ``system`` messages are
  system messages; ``input_text`` / ``output_text`` parts join with newlines; images and files
  are a 400.
* ``function_call`` items join the assistant message before them as ``tool_calls``;
  ``function_call_output`` items become ``tool`` messages; ``custom_tool_call`` /
  ``custom_tool_call_output`` likewise (the call's ``input`` as its ``{"input": ...}``
  arguments). A ``reasoning`` item's ``reasoning_text`` becomes the next assistant turn's
  reasoning (rendered back where the model's template renders it); the outputs of hosted
  tools are skipped.
* Item ``id``s, ``status``, ``prompt_cache_key``, ``client_metadata`` and ``include`` are
  metadata: none of them reaches the prompt, so a client that sends new ids with the same
  conversation (Codex does, every request) still hits the cached prefix.
* Tools: ``function`` tools as they are; a ``namespace`` tool's functions are flattened to
  ``<namespace>.<name>`` (calls of them come back as ``name`` plus ``namespace``); ``custom``
  tools are offered as functions of one string ``input``, and a forced custom tool
  (``tool_choice`` naming it) makes the whole output its input, constrained by its Lark or
  regex grammar; hosted tools (``web_search``, ...) are ignored, logged once per type.
* ``previous_response_id`` continues a stored conversation (server/responses/store.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.responses import Response
from starlette.types import Receive

from kvcellar.engine import SamplingParams
from kvcellar.server import errors, tenants
from kvcellar.server.internal import InternalRequest, OutputSpec
from kvcellar.server.logs import FirstSeen
from kvcellar.server.responses.protocol import InputTokensRequest, NamedTool, ResponsesRequest
from kvcellar.server.responses.render import ResponsesRenderer, ToolNames
from kvcellar.server.responses.store import ResponseStore, StoredResponse
from kvcellar.server.serving import Serving, check_text
from kvcellar.server.tools.request import ToolPlan, check_schema, make_tool_plan

log = logging.getLogger("kvcellar.server")

SKIPPED_ITEMS = frozenset({"web_search_call", "file_search_call", "image_generation_call",
                           "code_interpreter_call", "mcp_list_tools", "compaction"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text"})
_hosted_logged = FirstSeen()


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.invalid(f"Invalid type for '{where}': expected a string or a list of content parts.",
                             param=where, code="invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        else:
            raise errors.invalid(f"Only text content parts are supported (got type '{kind}').",
                                 param=f"{where}[{j}]", code="unsupported_content")
    return "\n".join(parts)


def _required(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise errors.invalid(f"Missing required parameter: '{where}.{key}' (a string).", param=f"{where}.{key}",
                             code="missing_required_parameter")
    return value


def convert_input(items: str | list[dict[str, Any]] | None, names: ToolNames) -> list[dict[str, Any]]:
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    known_calls: set[str] = set()
    flat = {v: k for k, v in names.namespaced.items()}
    reasoning: list[str] = []  # of a reasoning item, for the assistant turn it preceded

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return message

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise errors.invalid(f"Invalid type for '{where}': an input item is an object.", param=where,
                                 code="invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise errors.invalid(f"Invalid value for '{where}.role': {role!r}.", param=f"{where}.role")
            message = {"role": "system" if role == "developer" else role,
                       "content": _text(item.get("content"), f"{where}.content")}
            out.append(assistant(message) if role == "assistant" else message)
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _required(item, "call_id", where)
            name = _required(item, "name", where)
            namespace = item.get("namespace")
            if isinstance(namespace, str):
                name = flat.get((namespace, name), f"{namespace}.{name}")
            if kind == "function_call":
                arguments = item.get("arguments")
                arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
            else:
                arguments = json.dumps({"input": _required(item, "input", where)}, ensure_ascii=False)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            known_calls.add(call_id)
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":
                prev.setdefault("tool_calls", []).append(call)
                if reasoning and "reasoning_content" not in prev:
                    assistant(prev)
            else:
                out.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _required(item, "call_id", where)
            if call_id not in known_calls:
                raise errors.invalid(f"No tool call found for {kind} with call_id '{call_id}'.",
                                     param=f"{where}.call_id")
            output = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":  # its summary and encrypted_content are not the reasoning itself
            parts = item.get("content")
            if isinstance(parts, list):
                reasoning.extend(part["text"] for part in parts if isinstance(part, dict)
                                 and part.get("type") == "reasoning_text" and isinstance(part.get("text"), str))
        elif kind in SKIPPED_ITEMS:
            continue
        else:
            raise errors.invalid(f"Input items of type '{kind}' are not supported by this server.", param=where,
                                 code="unsupported_content")
    return out


def _function(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    parameters = tool.get("parameters")
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def convert_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[str], ToolNames]:
    """OpenAI-shaped functions, the param path of each (for errors), and the name map."""
    functions: list[dict[str, Any]] = []
    params: list[str] = []
    names = ToolNames()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind == "function":
            functions.append(_function(tool, _required(tool, "name", where), where))
            params.append(where)
        elif kind == "namespace":
            ns = _required(tool, "name", where)
            for j, inner in enumerate(tool.get("tools") or []):
                at = f"{where}.tools[{j}]"
                if not isinstance(inner, dict) or inner.get("type", "function") != "function":
                    raise errors.invalid("A namespace holds function tools only.", param=at)
                name = _required(inner, "name", at)
                flat = f"{ns}.{name}"
                names.namespaced[flat] = (ns, name)
                functions.append(_function(inner, flat, at))
                params.append(at)
        elif kind == "custom":
            name = _required(tool, "name", where)
            names.custom[name] = tool
            description = tool.get("description") or ""
            functions.append({"type": "function", "function": {
                "name": name, "description": description,
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                               "required": ["input"], "additionalProperties": False}}})
            params.append(where)
        elif isinstance(kind, str):
            if _hosted_logged(kind):
                log.info("ignoring hosted tool type %r: this server runs function and custom tools only", kind)
        else:
            raise errors.invalid(f"Missing required parameter: '{where}.type'.", param=f"{where}.type",
                                 code="missing_required_parameter")
    return functions, params, names


def custom_grammar(tool: dict[str, Any], where: str) -> str | None:
    """The Lark grammar a custom tool's input must match, None for free text."""
    fmt = tool.get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    definition, syntax = fmt.get("definition"), fmt.get("syntax")
    if fmt.get("type") != "grammar" or not isinstance(definition, str) or syntax not in ("lark", "regex"):
        raise errors.invalid("A custom tool's format is {'type': 'text'} or {'type': 'grammar', 'syntax': "
                             "'lark' | 'regex', 'definition': ...}.", param=f"{where}.format")
    if syntax == "regex":
        return f"start: /{definition.replace('/', chr(92) + '/')}/\n"
    return definition


def _tool_plan(req: ResponsesRequest | InputTokensRequest, functions: list[dict[str, Any]], params: list[str],
               names: ToolNames) -> ToolPlan | None:
    choice = req.tool_choice
    named = None
    if isinstance(choice, NamedTool):
        named = choice.name
        if choice.type == "custom" or named in names.custom:
            if named not in names.custom:
                raise errors.invalid(f"Tool choice '{named}' is not a custom tool in 'tools'.", param="tool_choice")
            names.forced_custom = named
            # the tools are still shown to the model; the output is the input, not a call
            return make_tool_plan(functions, "none", None, False,
                                  schema_param=lambda i: f"{params[i]}.parameters")
    if not functions and choice in (None, "auto", "none"):
        return None
    kind = "named" if isinstance(choice, NamedTool) else choice
    return make_tool_plan(functions, kind, named, req.parallel_tool_calls is not False,
                          schema_param=lambda i: f"{params[i]}.parameters", names_param=lambda i: f"{params[i]}.name")


def _output_spec(req: ResponsesRequest | InputTokensRequest, names: ToolNames) -> OutputSpec | None:
    if names.forced_custom is not None:
        tool = names.custom[names.forced_custom]
        lark = custom_grammar(tool, "tools")
        return OutputSpec(lark=lark, param="tools") if lark is not None else None
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return OutputSpec(schema={"type": "object"}, param="text.format")
    schema = fmt.schema_ if fmt.schema_ is not None else {"type": "object"}
    check_schema(schema, "text.format.schema")
    return OutputSpec(schema=schema, param="text.format.schema")


def previous_turns(req: ResponsesRequest | InputTokensRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues (event loop thread: the store's)."""
    if req.previous_response_id is None:
        return []
    previous = store.get(req.previous_response_id, tenants.owner())
    if previous is None:
        raise errors.APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                              param="previous_response_id", code="previous_response_not_found")
    return list(previous.messages)


def to_internal(req: ResponsesRequest | InputTokensRequest, history: list[dict[str, Any]]
                ) -> tuple[InternalRequest, ToolNames, list[dict[str, Any]]]:
    """The internal request, the tool name map, and the conversation to store (without
    ``instructions``; the reply is added when it is known). Checks schemas: run it off the
    event loop."""
    functions, params, names = convert_tools(req.tools)
    conversation = history + convert_input(req.input, names)
    if not conversation:
        raise errors.invalid("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools = _tool_plan(req, functions, params, names)
    output = _output_spec(req, names)
    if isinstance(req, ResponsesRequest):
        if req.background:
            raise errors.invalid("background responses are not supported by this server.", param="background",
                                 code="unsupported_parameter")
        sampling = SamplingParams(max_tokens=1, temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p)
        ireq = InternalRequest(api="responses", model=req.model, messages=messages, params=sampling,
                               max_tokens=req.max_output_tokens, tools=tools, output=output, stream=bool(req.stream))
    else:
        ireq = InternalRequest(api="responses", model=req.model, messages=messages, params=SamplingParams(),
                               tools=tools, output=output)
    return ireq, names, conversation


def request_echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's fields a response object repeats."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedTool) else (req.tool_choice or "auto")
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature, "text": {"format": fmt},
            "tool_choice": choice, "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled", "metadata": req.metadata or {}, "reasoning": {"effort": None, "summary": None},
            "user": None, "error": None, "incomplete_details": None}


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """The API's limits on ``metadata`` (16 pairs, keys of 64 characters, string values of 512):
    it is echoed in every response object, so its size is any client's to choose otherwise."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise errors.invalid(f"metadata has {len(metadata)} keys; at most 16 are allowed.", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise errors.invalid("metadata keys are at most 64 characters.", param="metadata")
        if not isinstance(value, str) or len(value) > 512:
            raise errors.invalid(f"metadata[{key!r}] must be a string of at most 512 characters.",
                                 param="metadata")


async def responses(serving: Serving, store: ResponseStore, req: ResponsesRequest, receive: Receive) -> Response:
    """``POST /v1/responses``."""
    check_text(req)
    check_metadata(req.metadata)
    serving.check_model(req.model)
    ireq, names, conversation = await serving.on_tokenizer_thread(to_internal, req, previous_turns(req, store))
    prepared = await serving.prepare_chat(ireq)
    tracker = prepared.tracker()

    def on_done(renderer: ResponsesRenderer) -> None:
        if req.store is not False and renderer.status in ("completed", "incomplete"):
            store.put(renderer.id, StoredResponse(conversation + renderer.reply_messages(), tenants.owner()))

    renderer = ResponsesRenderer(req.model, tracker, names, request_echo(req), on_done)
    return await serving.run(renderer, [prepared.prompt], [prepared.params], ireq, receive)


async def input_tokens(serving: Serving, store: ResponseStore, req: InputTokensRequest) -> dict[str, Any]:
    """``POST /v1/responses/input_tokens``: the prompt as ``/v1/responses`` would render it."""
    check_text(req)
    serving.check_model(req.model)
    ireq, _, _ = await serving.on_tokenizer_thread(to_internal, req, previous_turns(req, store))
    return {"object": "response.input_tokens", "input_tokens": len(await serving.render_prompt(ireq))}
