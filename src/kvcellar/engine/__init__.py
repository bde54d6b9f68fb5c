"""The inference engine: model loading, paged KV, continuous batching, sampling.

The names below load on first use: the settings import ``engine.config``, and reading a
config file must not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcellar.engine.build import assemble_engine
    from kvcellar.engine.engine import Engine, GenerationResult
    from kvcellar.engine.sampling import SamplingParams
    from kvcellar.engine.sequence import EventStream, TokenEvent

__all__ = ["Engine", "EventStream", "GenerationResult", "SamplingParams", "TokenEvent", "assemble_engine"]

_HOMES = {"assemble_engine": "build", "Engine": "engine", "GenerationResult": "engine",
          "SamplingParams": "sampling", "EventStream": "sequence", "TokenEvent": "sequence"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
