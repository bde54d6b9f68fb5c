"""Recent responses kept for ``previous_response_id`` (``store: true``, the API's default).

Bounded: the newest ``capacity`` responses within ``max_bytes``, least recently used dropped
first; memory only (a restart forgets them, and a client gets 404
``previous_response_not_found``, as for any id it does not know). What is kept is only what the
next turn continues from: the previous turns' messages, without ``instructions`` (the API does
not carry those over), and the reply, with the tenant that stored them; not the response object
(its ``metadata`` and ``tools`` would be bytes any client could fill the store with). Touched
only from the event loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # internal chat messages, reply included
    owner: str | None = None  # the tenant that stored it (server/tenants.py); None without keys

    def nbytes(self) -> int:
        return _size(self.messages)


def _size(value: Any) -> int:
    """About the bytes ``value`` holds: its strings' lengths, and a little per container."""
    if isinstance(value, str):
        return len(value) + 49
    if isinstance(value, dict):
        return 64 + sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 56 + sum(_size(v) for v in value)
    return 32


class ResponseStore:
    def __init__(self, capacity: int = 1024, max_bytes: int = 256 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The response stored under ``response_id`` by ``owner``; another tenant's is as unknown
        as an id never stored."""
        entry = self._items.get(response_id)
        if entry is None or entry[0].owner != owner:
            return None
        self._items.move_to_end(response_id)
        return entry[0]

    def put(self, response_id: str, item: StoredResponse) -> None:
        """Keep ``item``; one larger than the whole store is not kept (the next turn that
        names it gets 404, as for any response the store no longer has)."""
        size = item.nbytes()
        if size > self.max_bytes:
            return
        old = self._items.pop(response_id, None)
        if old is not None:
            self.nbytes -= old[1]
        self._items[response_id] = (item, size)
        self.nbytes += size
        while len(self._items) > self.capacity or self.nbytes > self.max_bytes:
            self.nbytes -= self._items.popitem(last=False)[1][1]

    def __len__(self) -> int:
        return len(self._items)
