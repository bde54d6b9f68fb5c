"""The ``[server]`` section of the configuration: knobs of the HTTP layer.

Filled like every section (``kvcellar.settings.load_settings``): defaults < config file
``[server]`` table < ``KVCELLAR_<FIELD>`` environment variables < ``kvcellar serve`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

LogFormat = Literal["text", "json"]


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer token required on /v1/* when set (also KVCELLAR_API_KEY): the tenant "default".
    api_key: str | None = field(default=None, repr=False)  # never in a printed config
    # More keys, one a line ("KEY" or "NAME KEY"), each a tenant with its own prefix cache
    # (server/tenants.py); a file keeps keys off the command line.
    api_key_file: str | None = None
    # Names of keys whose requests share one prefix cache (comma-separated).
    shared_cache_keys: str | None = None
    # With keys: /health details and /metrics without a key (load balancers, scrapers).
    public_health: bool = False
    # Host header names answered beside loopback names, the bound address (and any IP address
    # when bound to all interfaces), comma-separated; "*": any. Other names are refused (403):
    # a web page that rebinds its own name to 127.0.0.1 sends its name as the Host.
    allowed_hosts: str | None = None
    # Browser origins (scheme://host[:port]) allowed to call the API, comma-separated; "*": any.
    # They get CORS answers, preflights included; a request from any other origin is refused (403).
    allowed_origins: str | None = None
    # Extra names clients may use in the "model" field, comma-separated; the loaded
    # model's own name is always accepted.
    served_model_name: str | None = None
    # Serve requests naming any model with the loaded one (agents' background requests name
    # their own small models); off: an unknown name is a 404.
    serve_any_model: bool = False
    # Seconds a request may wait for its first token (queueing + prefill; a prefill that
    # computed more of the prompt within the last period gets another), and then between two
    # tokens. A request over either is cancelled in the engine, then answered 504.
    first_token_timeout: float = 300.0
    inter_token_timeout: float = 60.0
    # SIGTERM/SIGINT: seconds in-flight requests get to finish before they are cancelled.
    shutdown_timeout: float = 30.0
    # Request bodies above this are refused with 413 before they are read.
    max_body_bytes: int = 16 << 20
    # Upper bound on choices per request (n, times the prompts of a /v1/completions batch).
    max_choices: int = 16
    # API requests in flight beyond this are refused with 503 (Retry-After) instead of queueing
    # forever: counted from their arrival, token counts and requests still being prepared included.
    max_inflight_requests: int = 1024
    # With API keys: one key's requests in flight beyond this are refused with 429 (Retry-After),
    # so that one caller's burst or runaway agent cannot take every slot from the others. 0: no
    # cap per key (max_inflight_requests alone).
    max_inflight_per_key: int = 0
    # The request bodies those requests may hold in all, MiB (a body counts its Content-Length, or
    # max_body_bytes while unknown); past it, 503 before the body is read.
    max_body_mb_in_flight: float = 256.0
    # Seconds a request body may take to arrive (408 after): a client that trickles bytes holds a slot.
    body_timeout: float = 60.0
    # Stop strings added to every generation request, comma-separated escapes allowed ("\n"),
    # as an Ollama Modelfile's stop parameter: a small model in an agent loop ends its turn at
    # them. A reply they end reports a normal end (end_turn / stop), not a stop sequence.
    stop: str | None = None
    # Responses API: replies kept in memory for previous_response_id (store: true), newest first.
    max_stored_responses: int = 1024
    # ... and at most this many MiB of them (their conversations, as the next turn needs them).
    max_stored_responses_mb: float = 256.0
    access_log: bool = False
    log_format: LogFormat = "text"

    def default_stops(self) -> tuple[str, ...]:
        if not self.stop:
            return ()
        return tuple(part.encode().decode("unicode_escape") for part in self.stop.split(",") if part)

    def model_aliases(self) -> list[str]:
        if not self.served_model_name:
            return []
        return [name.strip() for name in self.served_model_name.split(",") if name.strip()]

    def shared_key_names(self) -> list[str]:
        return [name.strip() for name in (self.shared_cache_keys or "").split(",") if name.strip()]

    def host_names(self) -> list[str]:
        return _listed(self.allowed_hosts)

    def origins(self) -> list[str]:
        return [o.rstrip("/") for o in _listed(self.allowed_origins)]

    def validate(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty (KVCELLAR_API_KEY set to nothing?): give a key or unset it; "
                             "an empty key would mean no key")
        from kvcellar.server.tenants import Keys

        Keys.configured(self.api_key, self.api_key_file, self.shared_key_names())  # raises for a bad file
        for origin in self.origins():
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"allowed_origins: {origin!r} is not scheme://host[:port] (or *)")
        for name in ("first_token_timeout", "inter_token_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")
        if self.body_timeout <= 0 or self.max_body_mb_in_flight <= 0:
            raise ValueError("body_timeout and max_body_mb_in_flight must be > 0")
        if self.max_stored_responses < 0 or self.max_stored_responses_mb < 0:
            raise ValueError("max_stored_responses and max_stored_responses_mb must be >= 0")
        if self.max_inflight_per_key < 0:
            raise ValueError(f"max_inflight_per_key must be >= 0, not {self.max_inflight_per_key}")
        if self.max_choices < 1 or self.max_inflight_requests < 1 or self.max_body_bytes < 1:
            raise ValueError("max_choices, max_inflight_requests and max_body_bytes must be >= 1")
        if self.log_format not in get_args(LogFormat):
            raise ValueError("log_format must be text or json")


def _listed(value: str | None) -> list[str]:
    return [part.strip().lower() for part in (value or "").split(",") if part.strip()]
