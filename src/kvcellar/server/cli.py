"""Flags of ``kvcellar serve`` (the ``[server]`` section). Light to import: the top-level CLI
imports this module to build its parser; the server itself loads only when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from kvcellar.server.config import LogFormat

_FIELDS = ("host", "port", "api_key", "api_key_file", "shared_cache_keys", "public_health", "allowed_hosts",
           "allowed_origins", "served_model_name", "serve_any_model", "stop", "first_token_timeout",
           "inter_token_timeout", "shutdown_timeout", "max_body_bytes", "max_choices", "max_inflight_requests",
           "max_inflight_per_key", "max_stored_responses", "max_stored_responses_mb", "max_body_mb_in_flight",
           "body_timeout", "access_log", "log_format")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvcellar serve`` beyond the model/engine ones the CLI shares."""
    p.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(also KVCELLAR_API_KEY; --api-key-file keeps it out of `ps`)")
    p.add_argument("--api-key-file", default=None,
                   help="file of API keys, one a line ('KEY' or 'NAME KEY'); each key has a prefix cache of its "
                        "own, so no caller learns what another sent")
    p.add_argument("--shared-cache-keys", default=None,
                   help="names of keys (from --api-key-file; 'default' for --api-key) whose requests share one "
                        "prefix cache, comma-separated; a request joins it with 'X-Kvcellar-Cache: shared'")
    p.add_argument("--public-health", action="store_true", default=None,
                   help="with keys: answer /health in full and /metrics without a key (default: /health says "
                        "only its status, /metrics needs a key)")
    p.add_argument("--allowed-hosts", default=None,
                   help="Host header names to answer beside loopback names and the bound address, comma-separated "
                        "(*: any); others get 403, which keeps web pages that rebind their DNS name to this "
                        "machine out")
    p.add_argument("--allowed-origins", default=None,
                   help="browser origins (scheme://host[:port]) that may call the API, comma-separated (*: any), "
                        "with CORS; requests from other origins get 403 (default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="extra comma-separated names accepted in the 'model' field")
    p.add_argument("--serve-any-model", action="store_true", default=None,
                   help="answer requests that name any model with the loaded one (agents' background "
                   "requests name their own small models); default: unknown names get 404")
    p.add_argument("--stop", default=None,
                   help="stop strings added to every request, comma-separated, escapes allowed (e.g. '\\n'), as an "
                   "Ollama Modelfile's stop: a reply they end reports a normal end")
    p.add_argument("--first-token-timeout", type=float, default=None,
                   help="seconds a request may wait for its first token (default 300)")
    p.add_argument("--inter-token-timeout", type=float, default=None,
                   help="seconds a request may wait between tokens (default 60)")
    p.add_argument("--shutdown-timeout", type=float, default=None,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT (default 30)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (default 16 MiB)")
    p.add_argument("--max-choices", type=int, default=None, help="most choices per request (default 16)")
    p.add_argument("--max-inflight-requests", type=int, default=None,
                   help="API requests in flight before 503 (default 1024)")
    p.add_argument("--max-inflight-per-key", type=int, default=None,
                   help="with API keys: one key's API requests in flight before 429, so no caller takes every slot "
                        "(default 0: no cap per key)")
    p.add_argument("--max-body-mb-in-flight", type=float, default=None,
                   help="MiB of request bodies the requests in flight may hold in all; past it, 503 (default 256)")
    p.add_argument("--body-timeout", type=float, default=None,
                   help="seconds a request body may take to arrive, else 408 (default 60)")
    p.add_argument("--max-stored-responses", type=int, default=None,
                   help="Responses API replies kept for previous_response_id (default 1024)")
    p.add_argument("--max-stored-responses-mb", type=float, default=None,
                   help="... and the MiB they may hold in all (default 256)")
    p.add_argument("--access-log", action="store_true", default=None, help="log every HTTP request")
    p.add_argument("--log-format", default=None, choices=list(get_args(LogFormat)), help="log line format")


def server_cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ``[server]`` values given as flags (None: not given), for ``config.load_settings``."""
    return {k: getattr(args, k, None) for k in _FIELDS}
