"""The one place where failures become HTTP responses.

Every error leaves the server in the shape of the API that was called: OpenAI's
(chat, completions, Responses, everything else)::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

or, under ``/v1/messages``, Anthropic's (its ``type`` chosen by status)::

    {"type": "error", "error": {"type": "invalid_request_error", "message": ...}}

Inside, code raises specific exceptions (``kvcellar.errors``, ``APIError`` here for
conditions only the HTTP layer knows); the handlers installed by ``install_error_handlers``
map them. Request validation failures (FastAPI's 422) become 400, as OpenAI answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, overload

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from kvcellar.errors import (
    EngineStoppedError,
    InvalidRequestError,
    KvcellarError,
    ModelLoadError,
    ModelNotFoundError,
)

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields, raised by the server layer."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        message, param = _printable(message), _printable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    408: "timeout_error", 415: "invalid_request_error",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
                    529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


@overload
def _printable(text: str) -> str: ...
@overload
def _printable(text: str | None) -> str | None: ...
def _printable(text: str | None) -> str | None:
    """Error text may quote a request (a model name, a path); a lone surrogate in it would make
    the error body itself unencodable."""
    return None if text is None else text.encode("utf-8", "replace").decode("utf-8")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>').",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def host_not_allowed(host: str) -> APIError:
    return APIError(403, f"Host {host!r} is not a name this server answers to: a web page can point its own name "
                    "at this machine (DNS rebinding), so only loopback names and the bound address are answered. "
                    "Add the name with --allowed-hosts.", code="host_not_allowed")


def origin_not_allowed(origin: str) -> APIError:
    return APIError(403, f"Requests from the web origin {origin!r} are refused: any page a browser opens could "
                    "otherwise drive this server. Allow the origin with --allowed-origins.",
                    code="origin_not_allowed")


def not_json(content_type: str | None) -> APIError:
    got = f"'{content_type}'" if content_type else "none"
    return APIError(415, f"The request body must be JSON, sent with 'Content-Type: application/json' (got {got}).",
                    code="unsupported_media_type")


def overloaded() -> APIError:
    return APIError(503, "The server has too many requests in flight; retry later.", type=SERVER_ERROR,
                    code="overloaded", headers={"Retry-After": "1"})


def key_over_quota(limit: int) -> APIError:
    return APIError(429, f"This API key has {limit} requests in flight, the most one key may have; retry when one "
                    "ends.", type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g} s.", code="request_timeout")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {limit} bytes.",
                    code="request_too_large")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and accepts no new requests.", type=SERVER_ERROR,
                    code="shutting_down")


def cancelled_by_shutdown() -> APIError:
    return APIError(503, "The server is shutting down; the request was cancelled before it finished.",
                    type=SERVER_ERROR, code="shutting_down")


def timed_out(kind: str, seconds: float) -> APIError:
    what = "the first token" if kind == "first_token" else "the next token"
    return APIError(504, f"Timed out after {seconds:g} s waiting for {what}; the request was cancelled.",
                    type=SERVER_ERROR, code=f"{kind}_timeout")


def from_exception(exc: BaseException) -> APIError:
    """Map any exception to the error a client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, EngineStoppedError):
        return shutting_down()
    if isinstance(exc, (ModelLoadError, KvcellarError)):
        return APIError(500, str(exc), type=SERVER_ERROR)
    return APIError(500, "The server hit an internal error while processing the request.", type=SERVER_ERROR)


def from_http_exception(exc: StarletteHTTPException) -> APIError:
    if exc.status_code == 404:
        message = ("Not found. The API serves POST /v1/chat/completions, POST /v1/completions, "
                   "POST /v1/responses, POST /v1/responses/input_tokens, POST /v1/messages, "
                   "POST /v1/messages/count_tokens, GET /v1/models, GET /health and GET /metrics.")
    elif exc.status_code == 405:
        message = "Method not allowed on this path."
    else:
        message = str(exc.detail)
    err_type = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
    return APIError(exc.status_code, message, type=err_type, headers=exc.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _param_path(loc: Iterable[Any]) -> str | None:
    """``('body', 'messages', 0, 'content', 'str')`` -> ``messages[0].content``; union member
    tags (``str``, ``list[int]``, model names) end the path."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            if not out:
                break  # a position in the raw body, not an index into a field
            out += f"[{part}]"
            continue
        text = str(part)
        if text.lower() in _TYPE_TAGS or "[" in text or text[:1].isupper() or not text.isidentifier():
            break
        out += f".{text}" if out else text
    return out or None


def from_validation_errors(errors: Iterable[Mapping[str, Any]]) -> APIError:
    errors = list(errors)
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return invalid(f"We could not parse the JSON body of your request ({detail}). "
                           "The body must be a JSON object.", code="invalid_json")
    messages: list[str] = []
    first_param: str | None = None
    code = "invalid_value"
    seen: set[str | None] = set()
    # One message per field, even when a union reports each member: the member that got
    # furthest into the value (a list whose item has an unknown type) says what is wrong.
    best: dict[str | None, Mapping[str, Any]] = {}
    for err in errors:
        param = _param_path(err.get("loc", ()))
        if param not in best or len(err.get("loc", ())) > len(best[param].get("loc", ())):
            best[param] = err
    for err in errors:
        param = _param_path(err.get("loc", ()))
        if param in seen:
            continue
        seen.add(param)
        err = best[param]
        if first_param is None:
            first_param = param
        kind = err.get("type", "")
        if kind == "missing" and param is None:
            messages.append("The request body is empty: send a JSON object (Content-Type: application/json).")
        elif kind == "missing":
            messages.append(f"Missing required parameter: '{param}'.")
            code = "missing_required_parameter" if len(seen) == 1 else code
        elif param is None:
            messages.append("The request body must be a JSON object (send Content-Type: application/json).")
        elif kind.endswith("_type") or kind in ("model_attributes_type", "dict_type", "list_type"):
            messages.append(f"Invalid type for '{param}': {err.get('msg', 'wrong type')}.")
            code = "invalid_type" if len(seen) == 1 else code
        else:
            messages.append(f"Invalid value for '{param}': {err.get('msg', 'invalid')}.")
        if len(messages) == 3:
            break
    return invalid(" ".join(messages) or "Invalid request.", param=first_param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response(request.url.path)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation_errors(exc.errors()).response(request.url.path)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return from_http_exception(exc).response(request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return from_exception(exc).response(request.url.path)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(KvcellarError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
