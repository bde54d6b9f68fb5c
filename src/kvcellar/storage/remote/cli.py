"""The remote tier's command-line flags (``kvcellar serve``, ``generate``, ``bench``)."""

from __future__ import annotations

import argparse
from typing import Any

from kvcellar.storage.remote.config import REMOTE_POLICIES

_FIELDS = ("remote_url", "remote_policy", "remote_timeout_s", "remote_load_timeout_s", "remote_ttl_s",
           "remote_queue_blocks")


def add_remote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote-url", default=None,
                   help="shared remote KV tier below the SSD: redis://[user:pass@]host:port/db, rediss:// (TLS; "
                        "a private CA: ?ssl_ca_certs=/path/ca.pem), redis+cluster://host:port (Redis Cluster); "
                        "Valkey works the same (default: none)")
    p.add_argument("--remote-policy", default=None, choices=list(REMOTE_POLICIES),
                   help="remote tier: store every new block (write_through, default), blocks RAM evicts "
                        "(evict_only), or never store (read_only)")
    p.add_argument("--remote-timeout", dest="remote_timeout_s", type=float, default=None,
                   help="longest one Redis round trip may block, seconds (default 0.25)")
    p.add_argument("--remote-load-timeout", dest="remote_load_timeout_s", type=float, default=None,
                   help="longest a request waits for one load from Redis, seconds (default 2), "
                        "plus its bytes at 128 MiB/s")
    p.add_argument("--remote-ttl", dest="remote_ttl_s", type=float, default=None,
                   help="expire remote blocks unused this long, seconds (default 0: never; use maxmemory)")
    p.add_argument("--remote-queue-blocks", type=int, default=None,
                   help="remote store queue bound, in blocks; a full queue drops (default 256)")


def remote_cli_values(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k, None) for k in _FIELDS}
