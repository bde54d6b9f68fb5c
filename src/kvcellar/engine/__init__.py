"""The inference engine: model loading, paged KV, continuous batching, sampling."""

from kvcellar.engine.build import assemble_engine
from kvcellar.engine.engine import Engine, GenerationResult
from kvcellar.engine.sampling import SamplingParams
from kvcellar.engine.sequence import EventStream, TokenEvent

__all__ = ["Engine", "EventStream", "GenerationResult", "SamplingParams", "TokenEvent", "assemble_engine"]
