"""ASGI middleware in front of the API: what a browser may do, admission and accounting.

``BrowserGuard`` keeps web pages out, on every path: a server on 127.0.0.1 is reachable
from any page the user opens. A Host header that names neither a loopback name, the bound
address (any IP address when bound to all interfaces) nor one of ``--allowed-hosts`` is
refused (DNS rebinding: the page's own name, pointed at this machine), and so is a request
whose ``Origin`` is neither this server's own nor one of ``--allowed-origins`` (those get CORS
answers, from Starlette's ``CORSMiddleware`` inside it).

``ApiGate`` guards ``/v1/*``: while the server drains it answers 503; with an API key it
requires ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``); a body must
be declared JSON (415 otherwise: a page may send ``text/plain`` or no type without a CORS
preflight, never ``application/json``); it refuses bodies over the limit with 413 before
reading them (``Content-Length``) or as soon as the running total passes it (chunked), and
hands the app a body it has already read in full, so a handler's later ``receive()`` only
ever sees ``http.disconnect``. ``/health`` and ``/metrics`` pass it untouched.

``RequestMetrics`` counts responses by route and status and times them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvcellar.server import errors, tenants
from kvcellar.server.metrics import ServerMetrics


async def _send_error(err: errors.APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await err.response(scope.get("path", ""))(scope, receive, send)


@dataclass
class DrainState:
    """Shared between the gate and whoever shuts the server down."""

    draining: bool = False


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ALL_INTERFACES = frozenset({"", "0.0.0.0", "::"})


def host_name(authority: str) -> str:
    """The host of a Host header or an origin's authority: lower case, without the port,
    the brackets of an IPv6 address or a trailing dot."""
    value = authority.strip().lower()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:  # a name or IPv4 address and a port; a bare IPv6 address has more
        value = value.partition(":")[0]
    return value.rstrip(".")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


class BrowserGuard:
    def __init__(self, app: ASGIApp, *, bind_host: str, allowed_hosts: list[str],
                 allowed_origins: list[str]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.any_ip = bind_host.strip("[]") in ALL_INTERFACES
        self.hosts = LOOPBACK_NAMES | {host_name(h) for h in allowed_hosts}
        if not self.any_ip:
            self.hosts |= {host_name(bind_host)}
        self.any_origin = "*" in allowed_origins
        self.origins = frozenset(allowed_origins)

    def _host_allowed(self, host: str) -> bool:
        name = host_name(host)
        if self.any_host or name in self.hosts or name.endswith(".localhost"):  # *.localhost is loopback (RFC 6761)
            return True
        if self.any_ip:  # DNS rebinding needs a name; an address is what the client dialled
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                pass
        return False

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if self.any_origin or origin in self.origins:
            return True
        scheme, _, authority = origin.partition("://")  # this server's own origin (it serves no pages)
        return scheme in ("http", "https") and host is not None and authority == host.strip().lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host, origin = _header(scope, b"host"), _header(scope, b"origin")
        if host is not None and not self._host_allowed(host):
            await _send_error(errors.host_not_allowed(host), scope, receive, send)
            return
        if origin is not None and not self._origin_allowed(origin, host):
            await _send_error(errors.origin_not_allowed(origin), scope, receive, send)
            return
        await self.app(scope, receive, send)


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


@dataclass(frozen=True)
class RequestClock:
    """When an API request arrived (its body's first byte awaited) and how to hear that its
    client left: the work before its generation (tokenizing, grammars) counts against its
    first-token timeout and stops when the client goes."""

    arrived: float
    receive: Receive
    first_token_timeout: float | None = None  # the request's own, where it sets a shorter one


started: ContextVar[RequestClock | None] = ContextVar("kvcellar_request_clock", default=None)


class ApiGate:
    def __init__(self, app: ASGIApp, *, drain: DrainState, keys: tenants.Keys | None, max_body_bytes: int,
                 public_health: bool = False, max_active: int = 1024, max_body_bytes_held: int = 256 << 20,
                 body_timeout_s: float = 60.0, max_active_per_key: int = 0) -> None:
        self.app = app
        self.drain = drain
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self.public_health = public_health
        self.max_active = max_active
        self.max_body_bytes_held = max(max_body_bytes_held, max_body_bytes)  # one largest body always fits
        self.body_timeout_s = body_timeout_s
        self.max_active_per_key = max_active_per_key
        # Event loop only: requests past the gate, the body bytes they reserved, and (with keys)
        # the requests of each tenant (at most one entry per key).
        self.active = 0
        self.body_bytes = 0
        self.active_by_tenant: dict[str, int] = {}

    def _tenant(self, scope: Scope) -> tenants.Tenant | None:
        """The tenant whose key the request carries (``Authorization: Bearer`` or Anthropic's
        ``x-api-key``), None if it carries none of them."""
        assert self.keys is not None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and (tenant := self.keys.identify(token.strip())) is not None:
                    return tenant
            elif name == b"x-api-key" and (tenant := self.keys.identify(value.strip())) is not None:
                return tenant
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if not path.startswith("/v1/"):
            if self.keys is not None and not self.public_health and path in ("/health", "/metrics"):
                tenant = self._tenant(scope)
                if tenant is None and path == "/metrics":
                    await _send_error(errors.unauthorized(), scope, receive, send)
                    return
                tenants.current.set(tenant)  # /health without a key says only its status
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _send_error(errors.shutting_down(), scope, receive, send)
            return
        tenant = None
        if self.keys is not None:
            tenant = self._tenant(scope)
            if tenant is None:
                await _send_error(errors.unauthorized(), scope, receive, send)
                return
            tenants.current.set(tenant)
            tenants.shared.set(_header(scope, tenants.SHARED_HEADER) == "shared")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        content_type = _header(scope, b"content-type")
        if not _is_json(content_type):
            await _send_error(errors.not_json(content_type), scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _send_error(errors.body_too_large(self.max_body_bytes), scope, receive, send)
            return
        # Admission, before a byte of the body is read: requests in the gate (from here to
        # their last byte out) and the bytes of the bodies they hold are both bounded, so no
        # number of clients makes the server hold more than that before the engine sees them.
        reserved = declared if declared is not None else self.max_body_bytes
        if self.active >= self.max_active or self.body_bytes + reserved > self.max_body_bytes_held:
            await _send_error(errors.overloaded(), scope, receive, send)
            return
        name = tenant.name if tenant is not None else None
        if name is not None and self.max_active_per_key:
            if self.active_by_tenant.get(name, 0) >= self.max_active_per_key:
                await _send_error(errors.key_over_quota(self.max_active_per_key), scope, receive, send)
                return
            self.active_by_tenant[name] = self.active_by_tenant.get(name, 0) + 1
        self.active += 1
        self.body_bytes += reserved
        try:
            arrived = time.monotonic()
            body = await self._read_body(scope, receive, send, arrived + self.body_timeout_s)
            if body is None:
                return
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            started.set(RequestClock(arrived, replay))
            await self.app(scope, replay, send)
        finally:
            self.active -= 1
            self.body_bytes -= reserved
            if name is not None and self.max_active_per_key:
                left = self.active_by_tenant[name] - 1
                if left:
                    self.active_by_tenant[name] = left
                else:
                    del self.active_by_tenant[name]

    async def _read_body(self, scope: Scope, receive: Receive, send: Send, deadline: float) -> bytes | None:
        """The whole body, or None once an error was sent (too large, too slow) or the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # a client that trickles its body holds a slot: not for long
                await _send_error(errors.body_timeout(self.body_timeout_s), scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(errors.body_too_large(self.max_body_bytes), scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
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
