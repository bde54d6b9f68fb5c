"""A Messages request -> the internal request (server/internal.py).

* ``system`` (a string or text blocks) becomes the first system message. Lines of the form
  ``x-anthropic-<name>: ...`` in it are dropped first: Claude Code sends a billing
  pseudo-header as its first system block whose value changes with every invocation, and
  rendered as the first tokens of the prompt it would make every request miss the cached
  system prompt and tools behind it (``server_anthropic_pseudo_headers_dropped`` counts them).
* ``user`` turns: ``tool_result`` blocks become ``tool`` messages (in block order, before the
  turn's text); text blocks join with newlines; ``image``/``document`` are a 400.
* ``assistant`` turns: text, and ``tool_use`` blocks as ``tool_calls`` (arguments as
  ``json.dumps`` of the input); ``thinking`` blocks as the turn's reasoning (rendered back
  where the model's template renders it); ``redacted_thinking`` and server-tool blocks are
  skipped.
* ``system`` entries inside ``messages`` stay system messages where they are.
* Client tools become functions (``input_schema`` as ``parameters``); server tools
  (``web_search`` and the like: a ``type`` and no schema) are ignored, logged once.
* ``output_config.format`` (a JSON schema) constrains the reply as ``response_format`` does.
* ``tool_choice``: ``auto`` / ``any`` (-> required) / ``tool`` (-> named) / ``none``;
  ``disable_parallel_tool_use`` -> one call at most.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from starlette.responses import Response
from starlette.types import Receive

from kvcellar.engine import SamplingParams
from kvcellar.server import errors
from kvcellar.server.anthropic.protocol import (
    SKIPPED_BLOCKS,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from kvcellar.server.anthropic.render import MessagesRenderer
from kvcellar.server.internal import InternalRequest, OutputSpec
from kvcellar.server.logs import FirstSeen
from kvcellar.server.serving import Serving, check_text
from kvcellar.server.tools.request import ToolPlan, check_schema, make_tool_plan

log = logging.getLogger("kvcellar.server")

PSEUDO_HEADER = re.compile(r"^x-anthropic-[A-Za-z0-9-]+:[^\n]*(\n|$)", re.MULTILINE)
_server_tool_logged = FirstSeen()


def strip_pseudo_headers(text: str) -> tuple[str, int]:
    """``text`` without its ``x-anthropic-*:`` lines, and how many there were."""
    return PSEUDO_HEADER.subn("", text)


def system_text(system: str | list[TextBlock] | None) -> tuple[str, int]:
    if system is None:
        return "", 0
    blocks = [system] if isinstance(system, str) else [b.text for b in system]
    kept, dropped = [], 0
    for block in blocks:
        text, n = strip_pseudo_headers(block)
        dropped += n
        if text.strip() or not n:
            kept.append(text)
    return "\n".join(t for t in kept if t), dropped


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise errors.invalid(f"Only text blocks are supported inside a tool_result (got type '{kind}').",
                                     param=f"{where}.content[{j}]", code="unsupported_content")
            parts.append(part["text"])
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def convert_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    tool_names: dict[str, str] = {}  # tool_use id -> name, for the results that answer it
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        thoughts: list[str] = []
        for j, block in enumerate(m.content):
            at = f"{where}.content[{j}]"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ThinkingBlock):
                if m.role == "assistant":
                    thoughts.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise errors.invalid("tool_use blocks belong in assistant turns.", param=at)
                tool_names[block.id] = block.name
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise errors.invalid("tool_result blocks belong in user turns.", param=at)
                if block.tool_use_id not in tool_names:
                    raise errors.invalid(f"tool_result refers to tool_use id '{block.tool_use_id}', which no "
                                         "earlier assistant turn holds.", param=f"{at}.tool_use_id")
                results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "name": tool_names[block.tool_use_id], "content": _tool_result_text(block, at)})
            elif block.type in SKIPPED_BLOCKS:
                continue
            else:
                raise errors.invalid(f"Content blocks of type '{block.type}' are not supported by this server "
                                     "(text, tool_use and tool_result are).", param=at, code="unsupported_content")
        out.extend(results)
        if calls:
            out.append({"role": "assistant", "content": "\n".join(texts), "tool_calls": calls})
        elif texts or thoughts or not results:
            out.append({"role": m.role, "content": "\n".join(texts)})
        if thoughts and out and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = "".join(thoughts)
    return out


def plan_tools(req: MessagesRequest | CountTokensRequest) -> ToolPlan | None:
    functions: list[dict[str, Any]] = []
    origin: list[int] = []  # each function's index in req.tools, for errors
    for k, tool in enumerate(req.tools or []):
        if tool.input_schema is None:
            if _server_tool_logged(str(tool.type)):
                log.info("ignoring server tool %r (type %s): this server runs client tools only", tool.name, tool.type)
            continue
        fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        functions.append({"type": "function", "function": fn})
        origin.append(k)
    choice = req.tool_choice
    kind = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[choice.type] if choice else None
    if kind == "named" and not (choice and choice.name):
        raise errors.invalid("tool_choice of type 'tool' needs a 'name'.", param="tool_choice.name",
                             code="missing_required_parameter")
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if not functions and kind in ("auto", "none"):
        return None  # only server tools (or none): nothing to call
    return make_tool_plan(functions, kind, choice.name if kind == "named" and choice else None, parallel,
                          schema_param=lambda i: f"tools[{origin[i]}].input_schema",
                          names_param=lambda i: f"tools[{origin[i]}].name")


def to_internal(req: MessagesRequest | CountTokensRequest) -> tuple[InternalRequest, int]:
    """The internal request, and how many pseudo-header lines were dropped from ``system``."""
    system, dropped = system_text(req.system)
    messages = convert_messages(req.messages)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    if isinstance(req, MessagesRequest):
        params = SamplingParams(
            max_tokens=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            stop=tuple(req.stop_sequences or ()),
        )
        fmt = req.output_config.format if req.output_config else None
        if fmt is not None:
            check_schema(fmt.schema_, "output_config.format.schema")
        ireq = InternalRequest(api="messages", model=req.model, messages=messages, params=params,
                               max_tokens=req.max_tokens, tools=plan_tools(req), stream=bool(req.stream),
                               output=OutputSpec(schema=fmt.schema_, param="output_config.format.schema")
                               if fmt is not None else None)
    else:
        ireq = InternalRequest(api="messages", model=req.model, messages=messages, params=SamplingParams(),
                               tools=plan_tools(req))
    return ireq, dropped


async def messages(serving: Serving, req: MessagesRequest, receive: Receive) -> Response:
    """``POST /v1/messages``."""
    check_text(req)
    serving.check_model(req.model)
    ireq, dropped = await serving.on_tokenizer_thread(to_internal, req)  # schema checks: off the event loop
    if dropped:
        serving.metrics.stats.anthropic_pseudo_headers_dropped += dropped
    prepared = await serving.prepare_chat(ireq)
    tracker = prepared.tracker()
    renderer = MessagesRenderer(req.model, tracker, tuple(req.stop_sequences or ()))
    return await serving.run(renderer, [prepared.prompt], [prepared.params], ireq,
                             receive)


async def count_tokens(serving: Serving, req: CountTokensRequest) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: the prompt as ``/v1/messages`` would render it."""
    check_text(req)
    serving.check_model(req.model)
    ireq, _ = await serving.on_tokenizer_thread(to_internal, req)
    return {"input_tokens": len(await serving.render_prompt(ireq))}
