"""Engine events -> an Anthropic message, or its event stream.

Usage: ``input_tokens`` counts the prompt tokens that were computed, ``cache_read_input_tokens``
those served from any cache tier (RAM, SSD, Redis), so their sum is the prompt;
``cache_creation_input_tokens`` is 0 (blocks are cached as a side effect, at no charge).

``stop_reason``: ``tool_use`` when the reply holds calls, ``stop_sequence`` (with
``stop_sequence``) when one of the request's ended it, ``max_tokens`` when the budget (or the
context) ran out, else ``end_turn``.

A thinking model's reasoning is a ``thinking`` block before the text it came before (its
``signature`` is empty: nothing here can sign it).

Stream: ``message_start`` and a ``ping`` once the first token exists, then per content block
``content_block_start`` / ``content_block_delta`` (``thinking_delta`` and a closing
``signature_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop``. A failure after the start is an
``error`` event, and the stream ends.
"""

from __future__ import annotations

import json
from typing import Any

from kvcellar.engine import TokenEvent
from kvcellar.server.errors import APIError
from kvcellar.server.internal import CallArgs, CallStart, OutputTracker, Piece, Reasoning, Text
from kvcellar.server.streaming import sse_event
from kvcellar.server.tools.parsers import random_id


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def parse_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` must be ({} if they are not one:
    only an ``auto`` call cut by max_tokens can be)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesRenderer:
    def __init__(self, model: str, tracker: OutputTracker, stop_sequences: tuple[str, ...] = ()) -> None:
        self.id = random_id("msg_")
        self.model = model
        self.tracker = tracker
        self.stop_sequences = stop_sequences  # the request's own; a server-wide stop is a normal end
        self.blocks: list[dict[str, Any]] = []  # text: {"type", "text"}; tool_use: arguments in "_args"
        self._started = False
        self._block_of_call: dict[int, int] = {}
        self._open = -1  # index of the block being streamed

    # ---- shared -------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        t = self.tracker
        return {"input_tokens": t.num_prompt_tokens - t.num_cached_tokens, "output_tokens": t.num_output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": t.num_cached_tokens}

    def stop_reason(self) -> tuple[str, str | None]:
        t = self.tracker
        if t.called and t.finish_reason == "stop":
            return "tool_use", None
        if t.finish_reason == "length":
            return "max_tokens", None
        if t.stop_string is not None and t.stop_string in self.stop_sequences:
            return "stop_sequence", t.stop_string
        return "end_turn", None

    def _apply(self, piece: Piece) -> tuple[bool, int]:
        """Add ``piece`` to the blocks; (whether it opened a new block, the block's index)."""
        if isinstance(piece, Reasoning):
            if self.blocks and self.blocks[-1]["type"] == "thinking":
                self.blocks[-1]["thinking"] += piece.text
                return False, len(self.blocks) - 1
            self.blocks.append({"type": "thinking", "thinking": piece.text, "signature": ""})
            return True, len(self.blocks) - 1
        if isinstance(piece, Text):
            if self.blocks and self.blocks[-1]["type"] == "text":
                self.blocks[-1]["text"] += piece.text
                return False, len(self.blocks) - 1
            self.blocks.append({"type": "text", "text": piece.text})
            return True, len(self.blocks) - 1
        if isinstance(piece, CallStart):
            self.blocks.append({"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name, "_args": ""})
            self._block_of_call[piece.index] = len(self.blocks) - 1
            return True, len(self.blocks) - 1
        at = self._block_of_call[piece.index]
        self.blocks[at]["_args"] += piece.text
        return False, at

    @staticmethod
    def _final_block(block: dict[str, Any]) -> dict[str, Any]:
        if block["type"] in ("text", "thinking"):
            return dict(block)
        return {"type": "tool_use", "id": block["id"], "name": block["name"],
                "input": parse_input(block["_args"] or "{}")}

    def message(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None
                ) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self.usage()}

    # ---- non-streaming ------------------------------------------------------------------

    def add(self, index: int, ev: TokenEvent) -> None:
        for piece in self.tracker.feed(ev):
            self._apply(piece)

    def response(self) -> dict[str, Any]:
        reason, sequence = self.stop_reason()
        return self.message([self._final_block(b) for b in self.blocks], reason, sequence)

    # ---- streaming ----------------------------------------------------------------------

    def open_stream(self) -> list[bytes]:
        return []  # message_start waits for the first event: it carries the prompt's usage

    def stream(self, index: int, ev: TokenEvent) -> list[bytes]:
        pieces = list(self.tracker.feed(ev))
        out: list[bytes] = []
        if not self._started:
            self._started = True
            start = self.message([], None, None)
            start["usage"]["output_tokens"] = min(1, start["usage"]["output_tokens"])
            out.append(sse_event("message_start", {"type": "message_start", "message": start}))
            out.append(sse_event("ping", {"type": "ping"}))
        for piece in pieces:
            if isinstance(piece, Text) and not piece.text:
                continue
            opened, at = self._apply(piece)
            if opened:
                out.extend(self._close_open())
                self._open = at
                block = self.blocks[at]
                first = {"type": "text", "text": ""} if block["type"] == "text" else \
                    {"type": "thinking", "thinking": "", "signature": ""} if block["type"] == "thinking" else \
                    {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                out.append(sse_event("content_block_start",
                                     {"type": "content_block_start", "index": at, "content_block": first}))
            if isinstance(piece, Reasoning):
                delta = {"type": "thinking_delta", "thinking": piece.text}
            elif isinstance(piece, Text):
                delta = {"type": "text_delta", "text": piece.text}
            elif isinstance(piece, CallArgs):
                delta = {"type": "input_json_delta", "partial_json": piece.text}
            else:
                continue
            out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": at, "delta": delta}))
        return out

    def _close_open(self) -> list[bytes]:
        if self._open < 0:
            return []
        at, self._open = self._open, -1
        out = []
        if self.blocks[at]["type"] == "thinking":
            out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": at,
                                                         "delta": {"type": "signature_delta", "signature": ""}}))
        return [*out, sse_event("content_block_stop", {"type": "content_block_stop", "index": at})]

    def close_stream(self) -> list[bytes]:
        reason, sequence = self.stop_reason()
        usage = self.usage()
        return [*self._close_open(),
                sse_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": usage}),
                sse_event("message_stop", {"type": "message_stop"})]

    def fail_stream(self, err: APIError) -> list[bytes]:
        return [sse_event("error", err.anthropic_body())]

    def log_fields(self) -> dict[str, Any]:
        return self.tracker.log_fields()
