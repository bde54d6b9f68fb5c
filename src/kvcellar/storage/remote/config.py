"""The ``[remote]`` section: the remote tier's knobs, as users set them and as the tier reads them.

A field's ``key`` metadata is the name users give it (the ``[remote]`` key in the TOML file,
``KVCELLAR_<KEY>`` in the environment, ``--<key>`` on the command line); ``key=None``: tuned
here, not a setting. ``validate`` runs once, where the settings are assembled
(``kvcellar.settings``). Importing this module does not import the Redis client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# write_through: every new block is also stored remotely (default); evict_only: blocks the
# RAM tier drops; read_only: only load what other replicas stored.
RemotePolicy = Literal["write_through", "evict_only", "read_only"]
REMOTE_POLICIES: tuple[RemotePolicy, ...] = get_args(RemotePolicy)
URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")

# Metadata of the knobs that are no setting (no flag, file key or environment variable).
TUNED = {"key": None}


@dataclass
class RemoteConfig:
    """The ``[remote]`` section. An empty URL means no remote tier."""

    # redis://[user:pass@]host:port/db; rediss:// for TLS (a private CA in the query:
    # ?ssl_ca_certs=/path/ca.pem); redis+cluster://host:port for a Redis Cluster (any node
    # as the seed). Valkey speaks the same protocol.
    url: str = field(default="", metadata={"key": "remote_url"})
    policy: RemotePolicy = field(default="write_through", metadata={"key": "remote_policy"})
    # The longest one Redis call may block (connect, send, receive). Bounds what the engine
    # thread can lose to a slow or dead server per lookup.
    timeout_s: float = field(default=0.25, metadata={"key": "remote_timeout_s"})
    # The longest a request waits for one load from Redis (all its chunks together), plus
    # the load's bytes at ``load_bytes_per_s``.
    load_timeout_s: float = field(default=2.0, metadata={"key": "remote_load_timeout_s"})
    # Expire blocks this long after they were last written or loaded (0: never; let
    # Redis' maxmemory + allkeys-lru bound the store instead).
    ttl_s: float = field(default=0.0, metadata={"key": "remote_ttl_s"})
    # Store queue bound: a full queue drops blocks (counted) rather than stalling decode.
    # A prefill chunk publishes up to 128 blocks at once (2048 tokens); 256 holds two chunks
    # (the SSD queue's bound too), so another replica finds a long prompt whole, not only
    # what RAM later evicts. Each queued block holds its copy.
    queue_blocks: int = field(default=256, metadata={"key": "remote_queue_blocks"})

    # What a load may take beyond ``load_timeout_s``: its bytes at this rate (that of a
    # 1 Gb/s link). A long prefix of a large model is gigabytes, and the tokens a cut load
    # leaves are computed again, at minutes per thousand on a CPU; a server slower than
    # this is a fault.
    load_bytes_per_s: float = field(default=128 * 2**20, metadata=TUNED)
    # Blocks per pipelined GET round trip while loading.
    load_chunk_blocks: int = field(default=16, metadata=TUNED)
    load_threads: int = field(default=4, metadata=TUNED)
    # Blocks per pipelined SET round trip.
    write_batch_blocks: int = field(default=8, metadata=TUNED)
    # Writes after an OOM from a full ``noeviction`` server back off this long, doubling.
    backoff_initial_s: float = field(default=0.5, metadata=TUNED)
    backoff_max_s: float = field(default=30.0, metadata=TUNED)
    # During a fault the writer thread probes the server this often (its own thread; a
    # failed probe lengthens nothing): the tier is back within about this long of the server.
    probe_interval_s: float = field(default=0.5, metadata=TUNED)
    # Keys this process knows the store holds, so ``wants`` can decline them without I/O.
    known_keys: int = field(default=65536, metadata=TUNED)

    def validate(self) -> None:
        if self.policy not in REMOTE_POLICIES:
            raise ValueError(f"remote_policy must be one of {', '.join(REMOTE_POLICIES)}, not {self.policy!r}")
        if self.url and not self.url.startswith(URL_SCHEMES):
            raise ValueError(f"remote_url must start with one of {', '.join(URL_SCHEMES)}")
        if self.timeout_s <= 0 or self.load_timeout_s <= 0 or self.ttl_s < 0 or self.queue_blocks < 1:
            raise ValueError("remote timeouts must be > 0, remote_ttl_s >= 0, remote_queue_blocks >= 1")
