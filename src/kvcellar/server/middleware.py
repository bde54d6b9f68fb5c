"""ASGI middleware in front of the API: admission and accounting.

``ApiGate`` guards ``/v1/*``: while the server drains it answers 503; with an API key it
requires ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``); it refuses
bodies over the limit with 413 before reading them (``Content-Length``) or as soon as the
running total passes it (chunked), and hands the app a body it has already read in full (as
JSON, whatever the Content-Type), so a handler's later ``receive()`` only ever sees
``http.disconnect``. ``/health`` and ``/metrics`` pass untouched.

``RequestMetrics`` counts responses by route and status and times them.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcellar.server import errors
from kvcellar.server.metrics import ServerMetrics


async def _send_error(err: errors.APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await err.response(scope.get("path", ""))(scope, receive, send)


@dataclass
class DrainState:
    """Shared between the gate and whoever shuts the server down."""

    draining: bool = False


class ApiGate:
    def __init__(self, app: ASGIApp, *, drain: DrainState, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.drain = drain
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self.api_key):  # Anthropic's header
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _send_error(errors.shutting_down(), scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_error(errors.unauthorized(), scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _send_error(errors.body_too_large(self.max_body_bytes), scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(errors.body_too_large(self.max_body_bytes), scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        # The API speaks only JSON: read every body as JSON whatever Content-Type says
        # (curl -d sends application/x-www-form-urlencoded unless told otherwise).
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
        headers.append((b"content-type", b"application/json"))
        await self.app({**scope, "headers": headers}, replay, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestMetrics:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: list[Any] = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.observe_request(scope["path"], status[0], time.perf_counter() - start)
