"""Server-sent events, and noticing that a client went away.

A client that disconnects must cost nothing more: its engine sequences are cancelled and
their blocks freed. Nothing in the ASGI server does that for us (uvicorn drops writes to a
closed connection silently), so both paths watch ``receive()`` for ``http.disconnect``
themselves: ``until_disconnect`` while a handler waits for a complete response, and
``SSEResponse`` while it streams. Either way the caller's ``finally`` runs, which cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    pass


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    """A named event, as the Anthropic and Responses streams send them."""
    return f"event: {name}\n".encode() + sse(payload)


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await ``work``; raise ``ClientDisconnected`` (after cancelling it) if the client
    goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected
    finally:
        await _cancel(task, watcher)


class SSEResponse(Response):
    """Streams ``body`` (already-encoded SSE events); calls ``on_close(disconnected)`` once,
    however the stream ends (finished, client gone, task cancelled)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[bool], None]) -> None:
        # Not Response.__init__: it would render an empty body and declare Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)
        self._body = body
        self._on_close = on_close

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done():
                try:
                    writer.result()
                except OSError:  # ASGI servers that report writes to a closed socket
                    disconnected = True
            else:
                disconnected = True
        finally:
            await _cancel(writer, watcher)
            with contextlib.suppress(BaseException):
                await self._body.aclose()  # type: ignore[attr-defined]  # async generators have it; suppressed
            self._on_close(disconnected)
