"""From a URL to a Redis client that never retries on its own and never blocks long.

Retries and back-off belong to the tier (``storage/faults.py``): a client that retried
inside a call would multiply the bounded wait the tier promises.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

# What a server or cluster that is down, unreachable, half-configured or refusing raises:
# the tier turns each into a fault episode, never into an exception for its caller. The
# cluster client raises its own family (no slot map, slots not covered, no node reachable),
# which is not a ``RedisError``; OSError covers socket errors that escape the client.
FAULTS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException, OSError)


def redacted(url: str) -> str:
    """``url`` without its password (in the authority or as a ``password=`` query parameter,
    which redis-py also reads), for logs and /health."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{netloc}")
    if parts.query:
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        parts = parts._replace(query="&".join(
            f"{k}=***" if k.lower() == "password" else f"{k}={v}" for k, v in query))
    return urllib.parse.urlunsplit(parts)


def is_cluster(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme in CLUSTER_SCHEMES


def open_client(url: str, timeout_s: float) -> Any:
    """A ``redis.Redis`` (or ``RedisCluster`` for the ``+cluster`` schemes). A plain client
    connects lazily; a cluster client asks its seed for the slot map here and raises one of
    ``FAULTS`` (e.g. ``RedisClusterException``) when none answers or the slots are not covered.
    TLS options go in the URL's query, e.g. ``rediss://host:6380/0?ssl_ca_certs=/etc/ca.pem``."""
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "retry_on_timeout": False,
    }
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme.startswith("rediss"):
        # The server's certificate must name the host dialled, whatever redis-py's default (it
        # was off before 6.0); a URL's own ssl_check_hostname still wins.
        common.update(ssl_cert_reqs="required", ssl_check_hostname=True)
    if scheme in CLUSTER_SCHEMES:
        from redis.cluster import RedisCluster

        plain = CLUSTER_SCHEMES[scheme] + url[len(scheme):]
        return RedisCluster.from_url(plain, **common)
    return redis.Redis.from_url(url, **common)
