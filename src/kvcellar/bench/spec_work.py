"""The work ``kvcellar bench spec`` measures: chat conversations of the kinds coding agents send,
deterministic (no data set is downloaded), as OpenAI-style message lists.

* ``code-edit``: a Python module of ~110 lines (names varied by a seed) to rewrite whole with a
  small change, the same with a described edit, and an edit tool call whose JSON echoes a
  function of the file;
* ``json``: a JSON document to repeat with one field changed;
* ``agent``: five turns on one file, each asking for another small change of the whole file,
  each turn carrying the replies before it (the server's own);
* ``chat``: natural questions, whose answers repeat little; each round (a benchmark's repeat)
  asks others, so drafts from earlier outputs (``suffix``) find no answer of the same question.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

_MODULE = '''"""Inventory of a small {shop}: items, stock levels and reorder rules."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path


@dataclasses.dataclass
class Item:
    sku: str
    name: str
    price: float
    stock: int
    reorder_at: int = 5

    @property
    def value(self) -> float:
        return self.price * self.stock

    def needs_reorder(self) -> bool:
        return self.stock <= self.reorder_at


class Inventory:
    def __init__(self, items: list[Item] | None = None) -> None:
        self.items: dict[str, Item] = {{}}
        for item in items or []:
            self.add(item)

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {{item.sku}}")
        self.items[item.sku] = item

    def remove(self, sku: str) -> Item:
        try:
            return self.items.pop(sku)
        except KeyError:
            raise KeyError(f"no item with sku {{sku}}") from None

    def sell(self, sku: str, count: int) -> float:
        item = self.items[sku]
        if count > item.stock:
            raise ValueError(f"only {{item.stock}} of {{item.name}} left")
        item.stock -= count
        return count * item.price

    def restock(self, sku: str, count: int) -> None:
        self.items[sku].stock += count

    def total_value(self) -> float:
        return sum(item.value for item in self.items.values())

    def to_reorder(self) -> list[Item]:
        return sorted((i for i in self.items.values() if i.needs_reorder()), key=lambda i: i.stock)


def {loader}(path: Path) -> Inventory:
    inventory = Inventory()
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            inventory.add(Item(
                sku=row["sku"],
                name=row["name"],
                price=float(row["price"]),
                stock=int(row["stock"]),
                reorder_at=int(row.get("reorder_at") or 5),
            ))
    return inventory


def save_items(inventory: Inventory, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sku", "name", "price", "stock", "reorder_at"])
        writer.writeheader()
        for item in inventory.items.values():
            writer.writerow(dataclasses.asdict(item))


def report(inventory: Inventory) -> str:
    lines = [f"{{len(inventory.items)}} items, worth {{inventory.total_value():.2f}}"]
    for item in inventory.to_reorder():
        lines.append(f"reorder {{item.name}} ({{item.sku}}): {{item.stock}} left")
    return "\\n".join(lines)


if __name__ == "__main__":
    import sys

    inv = {loader}(Path(sys.argv[1]))
    print(report(inv))
'''

_SHOPS = ("bakery", "bike shop", "bookshop", "hardware store", "tea house", "flower stall")
_LOADERS = ("load_items", "read_items", "load_inventory", "read_csv_items")
_QUESTIONS = (
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Why is the sky blue? Explain it to a ten year old.",
    "Give me some advice for my first week at a new job.",
    "What are the pros and cons of living in a big city?",
    "Describe a walk through an autumn forest.",
    "How do vaccines teach the body to fight an illness?",
    "Plan a relaxing weekend for two people who like museums and food.",
    "What should I think about before adopting a dog?",
    "Write a letter to a friend who moved to another country.",
    "Why do we dream, and what do scientists know about it?",
    "Suggest three ways to save money on groceries and explain each.",
    "What was daily life like for a sailor on a ship in the 1700s?",
)
CHAT_PER_ROUND = 4


@dataclass(frozen=True)
class Conversation:
    """One piece of work: ``turns`` user messages sent in order, each with the replies before it."""

    kind: str  # code-edit, json, agent, chat
    name: str
    system: str
    turns: tuple[str, ...]


def module_source(seed: str) -> tuple[str, str]:
    """(a module's source, its loader function's name), varied by ``seed``."""
    rnd = random.Random(f"kvcellar-spec:{seed}")
    loader = rnd.choice(_LOADERS)
    return _MODULE.format(shop=rnd.choice(_SHOPS), loader=loader), loader


def _document(seed: str) -> str:
    rnd = random.Random(f"kvcellar-spec-json:{seed}")
    rows = [{"id": i + 1, "name": f"{rnd.choice(_SHOPS)} {i + 1}", "city": rnd.choice(("Lyon", "Porto", "Oslo")),
             "open": rnd.choice((True, False)), "rating": round(rnd.uniform(2.5, 5.0), 1)} for i in range(12)]
    return json.dumps({"status": "draft", "shops": rows}, indent=2)


SYSTEM = "You are a careful coding assistant. When asked for a file, reply with the whole file in one code block."


def conversations(seed: str, kinds: tuple[str, ...] = ("code-edit", "json", "agent", "chat"),
                  round_: int = 0) -> list[Conversation]:
    """The work of one round (``round_``: which chat questions; ``seed``: the file's names)."""
    src, loader = module_source(seed)
    file = f"Here is `inventory.py`:\n```python\n{src}```\n"
    out: list[Conversation] = []
    if "code-edit" in kinds:
        out += [
            Conversation("code-edit", "rename", SYSTEM, (
                file + f"Rename the function `{loader}` to `load_stock` everywhere. Reply with the whole updated "
                "file and nothing else.",)),
            Conversation("code-edit", "describe", SYSTEM, (
                file + "Make `restock` raise a ValueError when count is not positive. Reply with the whole updated "
                "file and nothing else.",)),
            Conversation("code-edit", "tool-call", SYSTEM, (
                file + "Call the edit tool to add a docstring to `Inventory.sell`. Reply with only a JSON object "
                '{"path": "inventory.py", "old_string": ..., "new_string": ...} where old_string is the method '
                "exactly as in the file and new_string the method with the docstring.",)),
        ]
    if "json" in kinds:
        out.append(Conversation("json", "repeat", SYSTEM, (
            f"```json\n{_document(seed)}\n```\nReply with the same JSON document, with status set to \"final\" "
            "and nothing else changed.",)))
    if "agent" in kinds:
        out.append(Conversation("agent", "five-turns", SYSTEM, (
            file + f"Rename `{loader}` to `load_stock`. Reply with the whole file.",
            "Now make `sell` refuse a count below 1. The whole file again.",
            "Add a method `names(self) -> list[str]` to Inventory returning the item names sorted. Whole file.",
            "Change the default reorder_at from 5 to 3 everywhere. Whole file.",
            "Finally, rename `report` to `summary`. Whole file.",
        )))
    if "chat" in kinds:
        first = CHAT_PER_ROUND * round_
        out += [Conversation("chat", f"q{(first + i) % len(_QUESTIONS) + 1}", "You are a helpful assistant.",
                             (_QUESTIONS[(first + i) % len(_QUESTIONS)],))
                for i in range(CHAT_PER_ROUND)]
    return out
