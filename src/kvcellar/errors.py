"""Exceptions raised inside kvcellar.

Each carries what a user needs to fix the problem. The HTTP layer maps them to
OpenAI-style error bodies in exactly one place (server/errors.py).
"""


class KvcellarError(Exception):
    """Base class for errors kvcellar raises on purpose."""


class ModelNotFoundError(KvcellarError):
    """The requested model cannot be found locally."""


class ModelLoadError(KvcellarError):
    """The model was found but could not be loaded."""


class InvalidRequestError(KvcellarError):
    """A request is malformed or asks for something impossible (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineStoppedError(KvcellarError):
    """The engine is shutting down or has stopped (maps to HTTP 503)."""
