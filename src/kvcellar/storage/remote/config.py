"""Knobs of the remote tier: ``RemoteSettings`` as users set them (flags, ``[remote]`` in
the TOML file, ``KVCELLAR_REMOTE_*``), ``RemoteTierConfig`` as the tier takes them.

Importing this module does not import the Redis client."""

from __future__ import annotations

from dataclasses import dataclass

REMOTE_POLICIES = ("write_through", "evict_only", "read_only")
URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


@dataclass(frozen=True)
class RemoteTierConfig:
    # The longest one Redis call may block (connect, send, receive). Bounds what the engine
    # thread can lose to a slow or dead server per lookup.
    timeout_s: float = 0.25
    # The longest a request waits for one load from Redis (all its chunks together).
    load_timeout_s: float = 2.0
    # Blocks per pipelined GET round trip while loading.
    load_chunk_blocks: int = 16
    load_threads: int = 4
    # Expire blocks this long after they were last written or loaded (0: never; let
    # Redis' maxmemory + allkeys-lru bound the store instead).
    ttl_s: float = 0.0
    # Store queue bound: a full queue drops blocks (counted) rather than stalling decode.
    # A prefill chunk publishes up to 128 blocks at once (2048 tokens); at 64 a 4096-token
    # prompt reached Redis with 64 of its 256 blocks (the rest only when RAM evicted them),
    # so another replica recomputed most of it. 256 holds two chunks (the SSD queue's bound
    # too): each queued block holds its copy, e.g. 0.7 MiB for the embedded model in fp32.
    queue_blocks: int = 256
    # Blocks per pipelined SET round trip.
    write_batch_blocks: int = 8
    # Writes after an OOM from a full ``noeviction`` server back off this long, doubling.
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    # During a fault the writer thread probes the server this often (its own thread; a
    # failed probe lengthens nothing): the tier is back within about this long of the server.
    probe_interval_s: float = 0.5
    # Keys this process knows the store holds, so ``wants`` can decline them without I/O.
    known_keys: int = 65536


@dataclass
class RemoteSettings:
    """The ``[remote]`` section. An empty URL means no remote tier."""

    # redis://[user:pass@]host:port/db; rediss:// for TLS (a private CA in the query:
    # ?ssl_ca_certs=/path/ca.pem); redis+cluster://host:port for a Redis Cluster (any node
    # as the seed). Valkey speaks the same protocol.
    remote_url: str = ""
    # write_through: every new block is also stored remotely (default); evict_only: blocks the
    # RAM tier drops; read_only: only load what other replicas stored.
    remote_policy: str = "write_through"
    remote_timeout_s: float = 0.25
    remote_load_timeout_s: float = 2.0
    remote_ttl_s: float = 0.0
    remote_queue_blocks: int = 256

    def validate(self) -> None:
        if self.remote_policy not in REMOTE_POLICIES:
            raise ValueError(f"remote_policy must be one of {', '.join(REMOTE_POLICIES)}, "
                             f"not {self.remote_policy!r}")
        if self.remote_url and not self.remote_url.startswith(URL_SCHEMES):
            raise ValueError(f"remote_url must start with one of {', '.join(URL_SCHEMES)}")
        if self.remote_timeout_s <= 0 or self.remote_load_timeout_s <= 0 or self.remote_ttl_s < 0 \
                or self.remote_queue_blocks < 1:
            raise ValueError("remote timeouts must be > 0, remote_ttl_s >= 0, remote_queue_blocks >= 1")

    def to_tier_config(self) -> RemoteTierConfig:
        self.validate()
        return RemoteTierConfig(timeout_s=self.remote_timeout_s, load_timeout_s=self.remote_load_timeout_s,
                                ttl_s=self.remote_ttl_s, queue_blocks=self.remote_queue_blocks)
