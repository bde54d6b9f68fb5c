"""A recording stand-in for kvcellar's HTTP API, for driving the real coding agents without a model.

``RecordingServer`` listens on 127.0.0.1 (a free port), logs every request it gets (method, path,
query, headers, JSON body) in order, optionally to a folder (``NNN-METHOD-path.json``), and answers
each with a minimal *valid* reply that carries a canned text, so an agent proceeds and exits:

- ``POST /v1/messages`` (Anthropic Messages; JSON or, with ``"stream": true``, the SSE events
  ``message_start`` .. ``message_stop``), ``POST /v1/messages/count_tokens``;
- ``POST /v1/responses`` (OpenAI Responses; JSON or the ``response.created`` ..
  ``response.completed`` SSE events);
- ``POST /v1/chat/completions`` (JSON or chunk stream, a usage chunk when asked);
- ``GET /v1/models`` (a list shaped for both OpenAI and Anthropic clients);
- ``HEAD`` on anything: 200; anything else: 404 (logged too).

``replies`` scripts tool calls (``ToolCall``) for requests that offer tools; ``delay`` makes each
model reply slow. It is what tests/server/fixtures/agents/ was recorded with
(``python -m tests.coding_agents --record``), and a test can use it to check an agent's invocation
without a model. ``python -m tests.agent_recorder [PORT]`` serves and logs into
./recorded-requests until Ctrl-C.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

CANNED_TEXT = "kvcellar-canned-answer"


@dataclass
class ToolCall:
    """A scripted reply that calls tool ``name`` with ``arguments`` (see ``RecordingServer.replies``)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:20]}")


def _sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"{head}data: {payload}\n\n".encode()


def _count(body: Any) -> int:
    """A rough input token count (characters / 4), enough for usage fields."""
    return max(1, len(json.dumps(body)) // 4)


def anthropic_message(model: str, text: str, input_tokens: int) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 5,
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def anthropic_stream(model: str, text: str, input_tokens: int) -> Iterator[bytes]:
    message = anthropic_message(model, "", input_tokens)
    message.update(content=[], stop_reason=None)
    message["usage"]["output_tokens"] = 1
    yield _sse("message_start", {"type": "message_start", "message": message})
    yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}})
    yield _sse("ping", {"type": "ping"})
    half = len(text) // 2
    for piece in (text[:half], text[half:]):
        yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": piece}})
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield _sse("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                 "usage": {"output_tokens": 5}})
    yield _sse("message_stop", {"type": "message_stop"})


def responses_object(model: str, text: str, input_tokens: int, status: str = "completed",
                     request: dict[str, Any] | None = None) -> dict[str, Any]:
    item = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}
    done = status == "completed"
    request = request or {}
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": int(time.time()),
        "status": status, "model": model, "output": [item] if done else [],
        "output_text": text if done else "", "error": None, "incomplete_details": None,
        "instructions": request.get("instructions"), "metadata": {}, "parallel_tool_calls": True,
        "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input_tokens + 5} if done else None,
    }


def responses_stream(model: str, text: str, input_tokens: int,
                     request: dict[str, Any]) -> Iterator[bytes]:
    seq = itertools.count()
    final = responses_object(model, text, input_tokens, request=request)
    started = dict(final, status="in_progress", output=[], output_text="", usage=None)
    item = final["output"][0]
    item_id = item["id"]
    yield _sse("response.created", {"type": "response.created", "sequence_number": next(seq),
                                    "response": started})
    yield _sse("response.in_progress", {"type": "response.in_progress", "sequence_number": next(seq),
                                        "response": started})
    yield _sse("response.output_item.added", {
        "type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0,
        "item": dict(item, status="in_progress", content=[])})
    yield _sse("response.content_part.added", {
        "type": "response.content_part.added", "sequence_number": next(seq), "item_id": item_id,
        "output_index": 0, "content_index": 0,
        "part": {"type": "output_text", "text": "", "annotations": []}})
    half = len(text) // 2
    for piece in (text[:half], text[half:]):
        yield _sse("response.output_text.delta", {
            "type": "response.output_text.delta", "sequence_number": next(seq), "item_id": item_id,
            "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []})
    yield _sse("response.output_text.done", {
        "type": "response.output_text.done", "sequence_number": next(seq), "item_id": item_id,
        "output_index": 0, "content_index": 0, "text": text, "logprobs": []})
    yield _sse("response.content_part.done", {
        "type": "response.content_part.done", "sequence_number": next(seq), "item_id": item_id,
        "output_index": 0, "content_index": 0, "part": item["content"][0]})
    yield _sse("response.output_item.done", {
        "type": "response.output_item.done", "sequence_number": next(seq), "output_index": 0,
        "item": item})
    yield _sse("response.completed", {"type": "response.completed", "sequence_number": next(seq),
                                      "response": final})


def anthropic_tool_message(model: str, call: ToolCall, input_tokens: int) -> dict[str, Any]:
    message = anthropic_message(model, "", input_tokens)
    message.update(content=[{"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}],
                   stop_reason="tool_use")
    return message


def anthropic_tool_stream(model: str, call: ToolCall, input_tokens: int) -> Iterator[bytes]:
    message = anthropic_message(model, "", input_tokens)
    message.update(content=[], stop_reason=None)
    yield _sse("message_start", {"type": "message_start", "message": message})
    yield _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
        "type": "tool_use", "id": call.id, "name": call.name, "input": {}}})
    yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
        "type": "input_json_delta", "partial_json": json.dumps(call.arguments)}})
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield _sse("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                 "usage": {"output_tokens": 5}})
    yield _sse("message_stop", {"type": "message_stop"})


def responses_tool_item(call: ToolCall) -> dict[str, Any]:
    return {"id": f"fc_{uuid.uuid4().hex[:24]}", "type": "function_call", "status": "completed",
            "call_id": call.id, "name": call.name, "arguments": json.dumps(call.arguments)}


def responses_tool_stream(model: str, call: ToolCall, input_tokens: int,
                          request: dict[str, Any]) -> Iterator[bytes]:
    seq = itertools.count()
    item = responses_tool_item(call)
    final = responses_object(model, "", input_tokens, request=request)
    final.update(output=[item], output_text="")
    started = dict(final, status="in_progress", output=[], usage=None)
    yield _sse("response.created", {"type": "response.created", "sequence_number": next(seq),
                                    "response": started})
    yield _sse("response.output_item.added", {
        "type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0,
        "item": dict(item, status="in_progress", arguments="")})
    yield _sse("response.function_call_arguments.delta", {
        "type": "response.function_call_arguments.delta", "sequence_number": next(seq),
        "item_id": item["id"], "output_index": 0, "delta": item["arguments"]})
    yield _sse("response.function_call_arguments.done", {
        "type": "response.function_call_arguments.done", "sequence_number": next(seq),
        "item_id": item["id"], "output_index": 0, "arguments": item["arguments"]})
    yield _sse("response.output_item.done", {"type": "response.output_item.done",
                                             "sequence_number": next(seq), "output_index": 0, "item": item})
    yield _sse("response.completed", {"type": "response.completed", "sequence_number": next(seq),
                                      "response": final})


def chat_tool_completion(model: str, call: ToolCall, input_tokens: int) -> dict[str, Any]:
    body = chat_completion(model, "", input_tokens)
    body["choices"][0].update(finish_reason="tool_calls", message={
        "role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}]})
    return body


def chat_tool_stream(model: str, call: ToolCall, input_tokens: int, usage: bool) -> Iterator[bytes]:
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    first = {"role": "assistant", "content": None, "tool_calls": [{
        "index": 0, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]}
    rest = {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(call.arguments)}}]}
    for delta in (first, rest):
        yield _sse(None, dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": None}]))
    yield _sse(None, dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]))
    if usage:
        yield _sse(None, dict(base, choices=[], usage={
            "prompt_tokens": input_tokens, "completion_tokens": 5, "total_tokens": input_tokens + 5}))
    yield _sse(None, "[DONE]")


def chat_completion(model: str, text: str, input_tokens: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": input_tokens, "completion_tokens": 5,
                  "total_tokens": input_tokens + 5},
    }


def chat_stream(model: str, text: str, input_tokens: int, usage: bool) -> Iterator[bytes]:
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    half = len(text) // 2
    deltas = [{"role": "assistant", "content": ""}, {"content": text[:half]}, {"content": text[half:]}]
    for delta in deltas:
        yield _sse(None, dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": None}]))
    yield _sse(None, dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    if usage:
        yield _sse(None, dict(base, choices=[], usage={
            "prompt_tokens": input_tokens, "completion_tokens": 5, "total_tokens": input_tokens + 5}))
    yield _sse(None, "[DONE]")


class RecordingServer:
    """``with RecordingServer(model, text=..., record_dir=...) as server:`` ``server.url`` is
    ``http://127.0.0.1:PORT``; ``server.requests`` the logged requests, in arrival order."""

    def __init__(self, model: str = "kvcellar-model", text: str = CANNED_TEXT,
                 record_dir: Path | None = None, port: int = 0,
                 replies: Iterable[str | ToolCall] = (), delay: float = 0.0) -> None:
        """``replies``: what the next model requests that offer tools (messages, responses, chat
        completions, in arrival order) answer, a text or a ``ToolCall`` each; once used up, and
        for requests without tools (title generation), ``text``.
        ``delay``: seconds each model request waits before its reply (a slow model)."""
        self.model = model
        self.text = text
        self.replies: list[str | ToolCall] = list(replies)
        self.delay = delay
        self.record_dir = Path(record_dir) if record_dir else None
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                recorder._log(self, None)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self.do_POST()

            def do_POST(self) -> None:
                try:
                    recorder._handle(self)
                except (BrokenPipeError, ConnectionResetError):  # the agent went away (killed)
                    self.close_connection = True

            do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_POST

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> RecordingServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # -- internals --

    def _read_body(self, handler: BaseHTTPRequestHandler) -> tuple[Any, str | None]:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = b""
            while True:
                size = int(handler.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    handler.rfile.readline()
                    break
                raw += handler.rfile.read(size)
                handler.rfile.readline()
        else:
            raw = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        encoding = (handler.headers.get("Content-Encoding") or "").lower()
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "deflate":
            raw = zlib.decompress(raw)
        elif encoding == "zstd":
            try:
                import zstandard  # type: ignore[import-not-found]
                raw = zstandard.ZstdDecompressor().decompress(raw)
            except ImportError:
                return None, f"<{len(raw)} bytes zstd>"
        if not raw:
            return None, None
        try:
            return json.loads(raw), None
        except ValueError:
            return None, raw.decode("utf-8", "replace")

    def _log(self, handler: BaseHTTPRequestHandler, body: Any, raw: str | None = None) -> dict[str, Any]:
        parts = urlsplit(handler.path)
        entry = {"t": round(time.monotonic() - self._t0, 3), "method": handler.command,
                 "path": parts.path, "query": parse_qs(parts.query),
                 "headers": dict(handler.headers.items()), "body": body}
        if raw is not None:
            entry["raw_body"] = raw
        with self._lock:
            entry["index"] = len(self.requests)
            self.requests.append(entry)
            if self.record_dir:
                self.record_dir.mkdir(parents=True, exist_ok=True)
                name = re.sub(r"[^A-Za-z0-9]+", "_", parts.path).strip("_") or "root"
                path = self.record_dir / f"{entry['index']:03d}-{handler.command}-{name}.json"
                path.write_text(json.dumps(entry, indent=2, ensure_ascii=False) + "\n")
        return entry

    def _send_json(self, handler: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("request-id", f"req_{uuid.uuid4().hex[:24]}")
        handler.end_headers()
        handler.wfile.write(data)

    def _send_sse(self, handler: BaseHTTPRequestHandler, events: Iterator[bytes]) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("request-id", f"req_{uuid.uuid4().hex[:24]}")
        handler.end_headers()
        for event in events:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        body, raw = self._read_body(handler)
        self._log(handler, body, raw)
        path = urlsplit(handler.path).path.rstrip("/")
        req = body if isinstance(body, dict) else {}
        model = req.get("model") or self.model
        ntok = _count(body)
        stream = bool(req.get("stream"))
        reply: str | ToolCall = self.text
        if handler.command == "POST" and path.endswith(("/messages", "/responses", "/chat/completions")):
            with self._lock:
                if self.replies and req.get("tools"):
                    reply = self.replies.pop(0)
            if self.delay:
                time.sleep(self.delay)
        if isinstance(reply, ToolCall):
            self._send_tool_call(handler, path, model, reply, ntok, stream, req)
            return
        text = reply
        if path.endswith("/models") and handler.command == "GET":
            entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "kvcellar",
                     "type": "model", "display_name": self.model, "created_at": "2025-01-01T00:00:00Z"}
            self._send_json(handler, 200, {"object": "list", "data": [entry], "has_more": False,
                                           "first_id": self.model, "last_id": self.model})
        elif path.endswith("/messages/count_tokens"):
            self._send_json(handler, 200, {"input_tokens": ntok})
        elif path.endswith("/messages"):
            if stream:
                self._send_sse(handler, anthropic_stream(model, text, ntok))
            else:
                self._send_json(handler, 200, anthropic_message(model, text, ntok))
        elif path.endswith("/responses"):
            if stream:
                self._send_sse(handler, responses_stream(model, text, ntok, req))
            else:
                self._send_json(handler, 200, responses_object(model, text, ntok, request=req))
        elif path.endswith("/chat/completions"):
            if stream:
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                self._send_sse(handler, chat_stream(model, text, ntok, usage))
            else:
                self._send_json(handler, 200, chat_completion(model, text, ntok))
        else:
            self._send_json(handler, 404, {"error": {"message": f"no route {handler.command} {path}",
                                                     "type": "not_found_error"}})

    def _send_tool_call(self, handler: BaseHTTPRequestHandler, path: str, model: str, call: ToolCall,
                        ntok: int, stream: bool, req: dict[str, Any]) -> None:
        if path.endswith("/messages"):
            if stream:
                self._send_sse(handler, anthropic_tool_stream(model, call, ntok))
            else:
                self._send_json(handler, 200, anthropic_tool_message(model, call, ntok))
        elif path.endswith("/responses"):
            if stream:
                self._send_sse(handler, responses_tool_stream(model, call, ntok, req))
            else:
                body = responses_object(model, "", ntok, request=req)
                body.update(output=[responses_tool_item(call)], output_text="")
                self._send_json(handler, 200, body)
        else:
            if stream:
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                self._send_sse(handler, chat_tool_stream(model, call, ntok, usage))
            else:
                self._send_json(handler, 200, chat_tool_completion(model, call, ntok))


if __name__ == "__main__":  # python -m tests.agent_recorder [PORT]: serve and log until Ctrl-C
    import sys

    server = RecordingServer(record_dir=Path("recorded-requests"),
                             port=int(sys.argv[1]) if len(sys.argv) > 1 else 0).start()
    print(f"recording on {server.url} into ./recorded-requests", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
