"""Engine events -> a Responses API response object, or its event stream.

Output items in the order the model wrote them: a ``reasoning`` item (one ``reasoning_text``
part) for a thinking model's reasoning, a ``message`` (one ``output_text`` part) for text, a
``function_call`` (``call_id``, ``name``, ``arguments``; plus ``namespace`` for a flattened
namespace tool) or ``custom_tool_call`` (``input``) per call. ``status`` is
``completed``, or ``incomplete`` with ``incomplete_details.reason: max_output_tokens`` when the
budget or the context ran out. ``usage.input_tokens_details.cached_tokens`` counts the prompt
tokens served from any cache tier.

Stream (every event with ``type`` and a ``sequence_number``): ``response.created``,
``response.in_progress``, then per item ``response.output_item.added``, for a message
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.content_part.done``, for reasoning ``response.reasoning_text.delta`` ... ``.done``,
for a call ``response.function_call_arguments.delta`` ...
``.done`` (``response.custom_tool_call_input.*`` for custom tools), then
``response.output_item.done``; last ``response.completed`` or ``response.incomplete``. A
failure after the start is ``response.failed`` with the error, and the stream ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcellar.engine import TokenEvent
from kvcellar.server.errors import APIError
from kvcellar.server.internal import CallArgs, CallStart, OutputTracker, Piece, Reasoning, Text
from kvcellar.server.streaming import sse_event
from kvcellar.server.tools.parsers import random_id


@dataclass
class ToolNames:
    """How names the model sees map back to the API's items."""

    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat -> (namespace, name)
    custom: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> the custom tool
    forced_custom: str | None = None  # the whole output is this custom tool's input


class ResponsesRenderer:
    def __init__(self, model: str, tracker: OutputTracker, names: ToolNames, echo: dict[str, Any],
                 on_done: Callable[[ResponsesRenderer], None]) -> None:
        self.id = random_id("resp_")
        self.created_at = int(time.time())
        self.model = model
        self.tracker = tracker
        self.names = names
        self.echo = echo
        self.on_done = on_done
        self.items: list[dict[str, Any]] = []
        self.status = "in_progress"
        self._seq = 0
        self._open = -1  # index of the item being streamed
        self._item_of_call: dict[int, int] = {}
        if names.forced_custom is not None:  # the whole output is one custom call's input
            self.items.append(self._custom_item(random_id("call_"), names.forced_custom))

    # ---- items --------------------------------------------------------------------------

    def _custom_item(self, call_id: str, name: str) -> dict[str, Any]:
        return {"type": "custom_tool_call", "id": random_id("ctc_"), "call_id": call_id, "name": name, "input": "",
                "status": "in_progress"}

    def _apply(self, piece: Piece) -> tuple[bool, int]:
        """Add ``piece`` to the items; (whether it opened a new item, the item's index)."""
        last = self.items[-1] if self.items else None
        if isinstance(piece, Reasoning):
            if last is not None and last["type"] == "reasoning":
                last["content"][0]["text"] += piece.text
                return False, len(self.items) - 1
            self.items.append({"type": "reasoning", "id": random_id("rs_"), "summary": [], "status": "in_progress",
                               "content": [{"type": "reasoning_text", "text": piece.text}]})
            return True, len(self.items) - 1
        if isinstance(piece, Text):
            if self.names.forced_custom is not None and last is not None:
                last["input"] += piece.text
                return False, len(self.items) - 1
            if last is not None and last["type"] == "message":
                last["content"][0]["text"] += piece.text
                return False, len(self.items) - 1
            self.items.append({"type": "message", "id": random_id("msg_"), "status": "in_progress", "role": "assistant",
                               "content": [{"type": "output_text", "text": piece.text, "annotations": [],
                                            "logprobs": []}]})
            return True, len(self.items) - 1
        if isinstance(piece, CallStart):
            if piece.name in self.names.custom:
                self.items.append({**self._custom_item(piece.id, piece.name), "_args": ""})
            else:
                item = {"type": "function_call", "id": random_id("fc_"), "call_id": piece.id, "name": piece.name,
                        "arguments": "", "status": "in_progress"}
                if piece.name in self.names.namespaced:
                    item["namespace"], item["name"] = self.names.namespaced[piece.name]
                self.items.append(item)
            self._item_of_call[piece.index] = len(self.items) - 1
            return True, len(self.items) - 1
        at = self._item_of_call[piece.index]
        call = self.items[at]
        if call["type"] == "custom_tool_call":
            call["_args"] += piece.text
        else:
            call["arguments"] += piece.text
        return False, at

    @staticmethod
    def _custom_input(arguments: str) -> str:
        try:
            value = json.loads(arguments or "{}")
        except ValueError:
            return arguments
        return value.get("input", "") if isinstance(value, dict) and isinstance(value.get("input"), str) \
            else arguments

    def _final(self, item: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in item.items() if not k.startswith("_")}
        out["status"] = "completed" if self.status != "incomplete" or item is not self.items[-1] else "incomplete"
        if item["type"] == "function_call" and not out["arguments"]:
            out["arguments"] = "{}"
        if "_args" in item:
            out["input"] = self._custom_input(item["_args"])
        return out

    def _finish(self) -> None:
        self.status = "incomplete" if self.tracker.cut_short else "completed"
        self.on_done(self)

    # ---- bodies -------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        t = self.tracker
        # cache_write_tokens 0: blocks are cached as a side effect, at no charge (as on Anthropic's API)
        return {"input_tokens": t.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": t.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens": t.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": t.num_prompt_tokens + t.num_output_tokens}

    def body(self, final: bool = True) -> dict[str, Any]:
        output = [self._final(i) for i in self.items] if final else []
        text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "model": self.model, **self.echo, "output": output, "output_text": text,
                "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                "usage": self.usage() if final else None}

    def reply_messages(self) -> list[dict[str, Any]]:
        """The reply as internal chat messages, for the next turn (``previous_response_id``)."""
        content, calls, reasoning = [], [], []
        for item in (self._final(i) for i in self.items):
            if item["type"] == "message":
                content.append(item["content"][0]["text"])
            elif item["type"] == "reasoning":
                reasoning.append(item["content"][0]["text"])
            else:
                name = item["name"] if "namespace" not in item else f"{item['namespace']}.{item['name']}"
                arguments = item["arguments"] if item["type"] == "function_call" else \
                    json.dumps({"input": item["input"]}, ensure_ascii=False)
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": name, "arguments": arguments}})
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        return [message]

    def add(self, index: int, ev: TokenEvent) -> None:
        for piece in self.tracker.feed(ev):
            self._apply(piece)
        if ev.finish_reason in ("stop", "length"):
            self._finish()

    def response(self) -> dict[str, Any]:
        return self.body()

    # ---- streaming ----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, payload)

    def open_stream(self) -> list[bytes]:
        start = self.body(final=False)
        out = [self._event("response.created", response=start), self._event("response.in_progress", response=start)]
        if self.items:  # a forced custom call: its item opens at once
            out.extend(self._opened(0))
        return out

    def _opened(self, at: int) -> list[bytes]:
        self._open = at
        item = self.items[at]
        first = {k: v for k, v in item.items() if not k.startswith("_")}
        if item["type"] == "message":
            first = {**first, "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [self._event("response.output_item.added", output_index=at, item=first),
                    self._event("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                                part=part)]
        if item["type"] == "reasoning":
            return [self._event("response.output_item.added", output_index=at,
                                item={**first, "content": [{"type": "reasoning_text", "text": ""}]})]
        first = {**first, "arguments": ""} if item["type"] == "function_call" else {**first, "input": ""}
        return [self._event("response.output_item.added", output_index=at, item=first)]

    def _closed(self) -> list[bytes]:
        if self._open < 0:
            return []
        at, self._open = self._open, -1
        item = self._final(self.items[at])
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                part=part)]
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                   content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                   name=item["name"], arguments=item["arguments"]))
        else:
            out.append(self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=at,
                                   input=item["input"]))
        out.append(self._event("response.output_item.done", output_index=at, item=item))
        return out

    def stream(self, index: int, ev: TokenEvent) -> list[bytes]:
        out: list[bytes] = []
        for piece in self.tracker.feed(ev):
            if isinstance(piece, Text) and not piece.text:
                continue
            opened, at = self._apply(piece)
            if opened:
                out += self._closed() + self._opened(at)
            item = self.items[at]
            if isinstance(piece, Reasoning):
                out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=at,
                                       content_index=0, delta=piece.text))
            elif isinstance(piece, Text) and item["type"] == "message":
                out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=at,
                                       content_index=0, delta=piece.text, logprobs=[]))
            elif isinstance(piece, Text):  # a forced custom call's input
                out.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=at,
                                       delta=piece.text))
            elif isinstance(piece, CallArgs) and item["type"] == "function_call":
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=at, delta=piece.text))
            # a custom call offered as a function streams its input once decoded, at the end
        return out

    def close_stream(self) -> list[bytes]:
        if self.status == "in_progress":
            self._finish()
        out = self._closed()
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=self.body())]

    def fail_stream(self, err: APIError) -> list[bytes]:
        self.status = "failed"
        failed = {**self.body(), "error": {"code": err.code or err.type, "message": err.message}}
        return [self._event("response.failed", response=failed)]

    def log_fields(self) -> dict[str, Any]:
        return self.tracker.log_fields()
