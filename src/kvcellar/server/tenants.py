"""Who is calling: the API keys a server accepts, each a tenant with a prefix cache of its own.

Keys come from ``--api-key`` (the tenant ``default``) and ``--api-key-file`` (one a line:
``KEY`` or ``NAME KEY``; blank lines and ``#`` comments skipped), so they need not be on a
command line that ``ps`` shows. Without keys the server is one user's and nothing here applies.

With keys, every request's prefix cache is salted with its key's digest: a prompt another key
sent is never a hit, so ``cached_tokens`` (and timing) tells a caller nothing about other
callers' prompts, on this replica, after a restart or on another one. Sharing stays possible
on purpose: the keys named in ``--shared-cache-keys``, and any request that sends
``X-Kvcellar-Cache: shared``, use the common cache, which holds only what was sent that way.
A stored Responses API reply resolves (``previous_response_id``) only for the key that stored
it.

``ApiGate`` identifies the tenant of each request and sets ``current`` (and ``shared``) for the
task that serves it; what runs inside reads them.

Tenants also take turns: ``--max-inflight-per-key`` caps one key's requests in flight, the
tokenizer thread (``TurnTaking``) runs the jobs of the tenants waiting one each in turn, and
the scheduler admits the waiting sequence of the tenant with the fewest admitted
(``engine/scheduler.py``), so one key's backlog of long prompts does not hold another's
requests behind it.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

SHARED_HEADER = b"x-kvcellar-cache"

T = TypeVar("T")


@dataclass(frozen=True)
class Tenant:
    name: str
    salt: str  # from the key's digest: renaming a key keeps its cache, a new key starts afresh
    shared: bool = False  # its requests use the common cache (--shared-cache-keys)


current: ContextVar[Tenant | None] = ContextVar("kvcellar_tenant", default=None)
shared: ContextVar[bool] = ContextVar("kvcellar_shared_cache", default=False)


def cache_salt(request_salt: str | None) -> str | None:
    """The salt a request's prefix cache is kept under: its tenant's (unless it or the request
    shares), then the request's own ``cache_salt``."""
    tenant = current.get()
    if tenant is None or tenant.shared or shared.get():
        return request_salt
    return tenant.salt if request_salt is None else f"{tenant.salt}\0{request_salt}"


def owner() -> str | None:
    """Whose stored responses a request may see: its tenant's name (None without keys)."""
    tenant = current.get()
    return None if tenant is None else tenant.name


class Keys:
    """The keys a server accepts. ``identify`` compares a token with every key in constant time."""

    def __init__(self, keys: dict[str, str], shared_names: set[str]) -> None:
        unknown = shared_names - set(keys)
        if unknown:
            raise ValueError(f"shared_cache_keys names no key: {', '.join(sorted(unknown))}")
        self._keys = [(key.encode(), Tenant(name, "tenant:" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest(),
                                            name in shared_names))
                      for name, key in keys.items()]

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def names(self) -> list[str]:
        return [t.name for _, t in self._keys]

    def identify(self, token: bytes) -> Tenant | None:
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(token, key) and found is None:
                found = tenant
        return found

    @classmethod
    def configured(cls, api_key: str | None, key_file: str | None, shared_names: list[str]) -> Keys | None:
        """The keys of the settings; None when there are none (a keyless server)."""
        keys: dict[str, str] = {}
        if api_key is not None:
            keys["default"] = api_key
        if key_file:
            for name, key in read_key_file(Path(key_file)).items():
                if name in keys:
                    raise ValueError(f"api key file {key_file}: the name {name!r} is used twice")
                keys[name] = key
        if not keys:
            if shared_names:
                raise ValueError("shared_cache_keys needs API keys (--api-key, --api-key-file)")
            return None
        return cls(keys, set(shared_names))


def read_key_file(path: Path) -> dict[str, str]:
    """``{name: key}`` from a key file (``KEY`` or ``NAME KEY`` a line; unnamed keys are
    ``key<line>``)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api key file {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ValueError(f"api key file {path}, line {number}: expected KEY or NAME KEY")
        name, key = (f"key{number}", fields[0]) if len(fields) == 1 else fields
        if name in keys:
            raise ValueError(f"api key file {path}, line {number}: the name {name!r} is used twice")
        keys[name] = key
    if not keys:
        raise ValueError(f"api key file {path}: no keys in it")
    return keys


class TurnTaking:
    """One worker thread whose queue is a queue per tenant: each tenant's jobs in their order,
    the tenants with jobs waiting served one job each in turn. A job cancelled before it starts
    is dropped; ``close`` cancels what has not started."""

    def __init__(self, name: str) -> None:
        # tenant -> its jobs; the dict's order is the turn order
        self._queues: dict[str | None, collections.deque[tuple[Future[Any], Callable[[], Any]]]] = {}
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, tenant: str | None, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the worker is closed")
            self._queues.setdefault(tenant, collections.deque()).append((future, fn))
            self._ready.notify()
        return future

    def close(self) -> None:
        with self._ready:
            self._closed = True
            for jobs in self._queues.values():
                for future, _ in jobs:
                    future.cancel()
            self._queues.clear()
            self._ready.notify()

    def _next(self) -> tuple[Future[Any], Callable[[], Any]] | None:
        with self._ready:
            while not self._queues and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            tenant = next(iter(self._queues))
            jobs = self._queues.pop(tenant)
            job = jobs.popleft()
            if jobs:  # its next job waits for the others' turns
                self._queues[tenant] = jobs
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
