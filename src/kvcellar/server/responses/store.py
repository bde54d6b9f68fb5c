"""Recent responses kept for ``previous_response_id`` (``store: true``, the API's default).

Bounded: the newest ``capacity`` responses, least recently used dropped first; memory only (a
restart forgets them, and a client gets 404 ``previous_response_not_found``, as for any id it
does not know). What is kept is the conversation as the next turn continues it: the previous
turns' messages, without ``instructions`` (the API does not carry those over), and the reply.
Touched only from the event loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # internal chat messages, reply included
    response: dict[str, Any]  # the response object as sent
    owner: str | None = None  # the tenant that stored it (server/tenants.py); None without keys


class ResponseStore:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The response stored under ``response_id`` by ``owner``; another tenant's is as unknown
        as an id never stored."""
        item = self._items.get(response_id)
        if item is None or item.owner != owner:
            return None
        self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
