"""Flags of ``kvcellar serve`` and the settings they make. Light to import: the top-level
CLI imports this module to build its parser; the server itself loads only in ``cmd_serve``.
"""

from __future__ import annotations

import argparse
from typing import Any

SSD_POLICIES = ("write_through", "evict_only")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvcellar serve`` beyond the model/engine ones the CLI shares."""
    p.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--cache-dir", default=None,
                   help="cache root (default: KVCELLAR_CACHE_DIR, else ~/.cache/kvcellar)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(also KVCELLAR_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="extra comma-separated names accepted in the 'model' field")
    p.add_argument("--ssd-policy", default=None, choices=SSD_POLICIES,
                   help="SSD tier write policy (default write_through)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in the running batch")
    p.add_argument("--max-step-tokens", type=int, default=None, help="token budget per engine step")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (0: model's)")
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
    p.add_argument("--access-log", action="store_true", default=None, help="log every HTTP request")
    p.add_argument("--log-format", default=None, choices=["text", "json"], help="log line format")


def build_settings(args: argparse.Namespace, engine_cfg: Any) -> Any:
    """The ``Settings`` of a served instance from config file, environment and flags."""
    from kvcellar.config import Settings, apply_overrides, build_section, read_config_file, resolve_cache_dir
    from kvcellar.server.config import ServerConfig

    file_values = read_config_file(getattr(args, "config", None))
    apply_overrides(engine_cfg, {"max_num_seqs": args.max_num_seqs, "max_step_tokens": args.max_step_tokens,
                                 "max_model_len": args.max_model_len}, source="command line")
    server = build_section(ServerConfig, file_values.get("server", {}), {
        "host": args.host, "port": args.port, "api_key": args.api_key,
        "served_model_name": args.served_model_name, "first_token_timeout": args.first_token_timeout,
        "inter_token_timeout": args.inter_token_timeout, "shutdown_timeout": args.shutdown_timeout,
        "max_body_bytes": args.max_body_bytes, "max_choices": args.max_choices,
        "max_inflight_requests": args.max_inflight_requests, "access_log": args.access_log,
        "log_format": args.log_format,
    })
    server.validate()
    disk = dict(file_values.get("disk", {}))
    # The SSD tier is not built yet; its policy is accepted and kept for it.
    disk["policy"] = args.ssd_policy or disk.get("policy") or "write_through"
    if disk["policy"] not in SSD_POLICIES:
        raise ValueError(f"config file: ssd policy must be one of {', '.join(SSD_POLICIES)}")
    return Settings(model=args.model, cache_dir=resolve_cache_dir(args.cache_dir), engine=engine_cfg,
                    sections={"server": server, "disk": disk})



def cmd_serve(args: argparse.Namespace, engine_cfg: Any) -> int:
    from kvcellar.server.runner import serve

    return serve(args, engine_cfg)
