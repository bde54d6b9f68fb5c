"""Typed statistics: each owner declares its numbers as the fields of one dataclass, with the
metric kind on the field (``counter()`` for monotonic counts, ``gauge()`` for levels), and
updates them by attribute. ``as_dict`` exports them under the owner's prefix, the flat names
/metrics and /health show (``kvcellar_<prefix><field>``); a name is spelled as a string only
where a reason picks the count (``SharedStats.add_named``).

Only the owner's thread writes a ``Stats``; other threads read it (an attribute read is
atomic). Numbers that several threads change are a ``SharedStats``, whose fields are ``Count``s
changed under the owner's lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, ClassVar, Self

_KIND = "kind"


def counter(default: float = 0) -> Any:
    """A monotonic count (a Prometheus counter)."""
    return dataclasses.field(default=default, metadata={_KIND: "counter"})


def gauge(default: float = 0) -> Any:
    """A level that goes up and down (a Prometheus gauge)."""
    return dataclasses.field(default=default, metadata={_KIND: "gauge"})


@dataclasses.dataclass
class Stats:
    """Base of an owner's numbers; subclasses are dataclasses whose every field is a
    ``counter()`` or a ``gauge()``, exported as ``PREFIX + name``."""

    PREFIX: ClassVar[str] = ""

    def as_dict(self, prefix: str | None = None) -> dict[str, float]:
        """``{prefix + field: value}``; ``prefix`` defaults to the class's ``PREFIX``."""
        p = self.PREFIX if prefix is None else prefix
        return {p + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def gauge_names(cls, prefix: str | None = None) -> frozenset[str]:
        """The exported names of the fields that are levels."""
        p = cls.PREFIX if prefix is None else prefix
        return frozenset(p + f.name for f in dataclasses.fields(cls) if f.metadata.get(_KIND) == "gauge")

    @classmethod
    def from_dict(cls, values: Mapping[str, float], prefix: str | None = None) -> Self:
        """The fields found among exported ``values`` (a flattened /health answer); others 0."""
        p = cls.PREFIX if prefix is None else prefix
        return cls(**{f.name: values[p + f.name] for f in dataclasses.fields(cls) if p + f.name in values})

    def since(self, earlier: Self) -> Self:
        """Each field's change from ``earlier`` (counts over an interval)."""
        names = [f.name for f in dataclasses.fields(self)]
        return type(self)(**{n: getattr(self, n) - getattr(earlier, n) for n in names})

    def copy(self) -> Self:
        return dataclasses.replace(self)

    def restore(self, saved: Stats) -> None:
        """Set every field back to ``saved``'s, in place (others hold this object)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(saved, f.name))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Runs before @dataclass: every annotated name must be a counter() or a gauge().
        super().__init_subclass__(**kwargs)
        for name, annotation in vars(cls).get("__annotations__", {}).items():
            value = vars(cls).get(name)
            if "ClassVar" not in str(annotation) and not (isinstance(value, dataclasses.Field)
                                                          and _KIND in value.metadata):
                raise TypeError(f"{cls.__name__}.{name}: declare it with counter() or gauge()")


class Count:
    """One number of a ``SharedStats``, changed under its owner's lock."""

    __slots__ = ("_lock", "value")

    def __init__(self, lock: threading.Lock, value: float = 0) -> None:
        self._lock = lock
        self.value = value

    def add(self, n: float = 1) -> float:
        """Add ``n``; the value it made (read under the same lock)."""
        with self._lock:
            self.value += n
            return self.value

    def set_max(self, value: float) -> None:
        with self._lock:
            if value > self.value:
                self.value = value


@dataclasses.dataclass
class SharedStats(Stats):
    """``Stats`` that several threads change: every field becomes a ``Count`` (declare it
    ``name: Count = counter()``), all sharing one lock."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        for f in dataclasses.fields(self):
            setattr(self, f.name, Count(self._lock, getattr(self, f.name)))
        self._labeled: dict[str, float] = {}

    def add_named(self, name: str, n: float = 1) -> None:
        """Add to the field ``name`` (a caller that picks it by a reason), or to a count kept
        beside the fields where none has that name (one per errno name, say; a reason a newer
        check added), exported as ``PREFIX + name`` too."""
        if name in self._names():
            getattr(self, name).add(n)
            return
        with self._lock:
            self._labeled[name] = self._labeled.get(name, 0) + n

    @classmethod
    def _names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    def as_dict(self, prefix: str | None = None) -> dict[str, float]:
        p = self.PREFIX if prefix is None else prefix
        out = {p + f.name: getattr(self, f.name).value for f in dataclasses.fields(self)}
        with self._lock:
            out.update({p + k: v for k, v in self._labeled.items()})
        return out
