"""RemoteTier: KV blocks in a shared Redis/Valkey, behind ``storage.base.KVTier``.

Data path:
  lookup  one pipelined round trip of ``EXISTS`` per key, on the caller's thread
  load    pipelined ``GETRANGE`` bounded to a block's size (and ``PEXPIRE`` with a TTL) in
          chunks on ``kvcellar-remote-load-*`` threads; every value is checked by the block
          format (size, magic, version, header checksum, geometry, key, digest, token ids,
          payload CRC, and the seal with a secret) before it counts
  store   a bounded queue and one writer thread (writer.py): ``EXISTS`` then
          ``SET NX [PX ttl]`` per batch; a full queue drops, never waits

Faults (storage/faults.py): any of ``connection.FAULTS`` (a connection error or timeout,
a cluster with no reachable node or uncovered slots, a TLS handshake refused) starts an
episode on the connection: lookups answer 0, loads miss, stores drop, all without
touching the network, until the writer thread's probe (``PING`` every
``probe_interval_s``, on its own thread) gets an answer, so the engine thread never
waits on a server known to be down and the tier is back within about one probe interval
of the server, however long it was away (a failed probe does not lengthen anything). A
cluster client connects when built: one that cannot be built is not kept, so each probe
tries afresh. ``OOM`` from a full ``noeviction`` server starts an episode on writes only
(reads go on), ended by a block-sized probe write. No call waits longer than
``timeout_s`` per round trip; a load never longer than ``load_timeout_s`` plus its bytes at
``load_bytes_per_s``, in all.

A corrupt or foreign value under one of our keys is a miss, counted, and deleted.
Pins are no-ops: Redis evicts on its own (maxmemory + allkeys-lru), and a key gone
between lookup and load is a miss.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest, tier_health
from kvcellar.storage.block_format import (
    BlockSeal,
    CacheSecret,
    check_identity,
    decode_block_into,
    encode_block,
    file_size_for,
)
from kvcellar.storage.faults import FaultTracker
from kvcellar.storage.remote.config import RemoteConfig
from kvcellar.storage.remote.connection import FAULTS, is_cluster, open_client, redacted
from kvcellar.storage.remote.layout import RemoteLayout
from kvcellar.storage.remote.stats import RemoteStats
from kvcellar.storage.remote.writer import RemoteWriter

_log = logging.getLogger("kvcellar.storage.remote")

UNSEALED_WARNING = ("blocks are not sealed: anyone who can write to this store can make replicas serve KV "
                    "of other text; give every replica the same --cache-secret-file")


def _is_oom(exc: BaseException) -> bool:
    """A ``noeviction`` server at ``maxmemory`` refusing a write (the server is up)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM"))


class RemoteTier(KVTier):
    """Blocks of one namespace in the Redis at ``url``. The constructor never touches the
    network and never raises for a server that is down: the tier starts degraded then."""

    name = "remote"
    gauges = frozenset({"remote_writer_queue_depth", "remote_ok_state"})

    def __init__(self, url: str, fingerprint: str, spec: BlockSpec, config: RemoteConfig | None = None,
                 secret: bytes | CacheSecret | None = None) -> None:
        self.spec = spec
        self.config = config = config or RemoteConfig()
        self.url = url
        self.layout = RemoteLayout(fingerprint)
        # Values are sealed when written and unsealed ones are corrupt when read (block_format):
        # whoever can write to the store cannot make a replica serve KV it did not compute.
        self.seal = BlockSeal(secret, fingerprint) if secret is not None else None
        self._value_size = file_size_for(spec)
        self._c = RemoteStats()
        where = redacted(url)
        self._conn = FaultTracker("conn", self._c, _log, where, config.backoff_initial_s, config.backoff_max_s,
                                  tier="remote")
        self._wfault = FaultTracker("write", self._c, _log, where, config.backoff_initial_s, config.backoff_max_s,
                                    tier="remote")
        self._ttl_ms = int(config.ttl_s * 1000)
        # The link's bounds (storage/guard.py): past its own timeouts, with a margin for
        # building a cluster client and for scheduling.
        self.call_timeout_s = max(1.0, 4 * config.timeout_s)
        self.load_timeout_s = config.load_timeout_s + self.call_timeout_s
        self.load_bytes_per_s = config.load_bytes_per_s
        # _client_lock protects _client (created lazily: a cluster client connects when built).
        self._client_lock = threading.Lock()
        self._client: Any = None
        # _known_lock protects _known (keys the store holds, LRU-bounded) and _claims
        # (keys queued for writing).
        self._known_lock = threading.Lock()
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._claims: set[bytes] = set()
        self._closed = False
        self._last_probe = 0.0  # writer thread only
        ns8 = fingerprint[:8]
        self._loader = concurrent.futures.ThreadPoolExecutor(config.load_threads,
                                                             thread_name_prefix=f"kvcellar-remote-load-{ns8}")
        self._writer = RemoteWriter(f"kvcellar-remote-writer-{ns8}", config.queue_blocks, config.write_batch_blocks,
                                    self._write_batch, self._probe_if_due, self._c)

    # ------------------------------------------------------------------ connection
    def _redis(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = open_client(self.url, self.config.timeout_s)
            return self._client

    def _fault(self, exc: Exception, what: str, *, probe: bool = False) -> None:
        if _is_oom(exc):
            self._wfault.failure(exc, what, probe=probe)
            return
        self._conn.failure(exc, what, probe=probe)  # counts conn_errors (not for a probe)
        with self._known_lock:  # the server may come back empty (restarted without persistence)
            self._known.clear()

    def _usable(self) -> bool:
        """Whether engine-facing calls may touch the network: not during a connection
        episode (only the probe ends it)."""
        return not self._closed and not self._conn.in_episode

    def _probe_if_due(self) -> None:
        """Writer thread, while idle: end a fault episode as soon as the server answers.
        At most one probe per ``probe_interval_s``."""
        if not (self._conn.in_episode or self._wfault.in_episode):
            return
        now = time.monotonic()
        if now - self._last_probe < self.config.probe_interval_s:
            return
        self._last_probe = now
        self._c.probes.add()
        try:
            client = self._redis()
            client.ping()
            if self._wfault.in_episode:  # full: a block-sized write must succeed again to clear it
                probe_key = self.layout.key(b"\0probe")
                client.set(probe_key, bytes(self.spec.nbytes), px=1000)
                client.delete(probe_key)
                self._wfault.success(probe=True)
        except FAULTS as e:
            self._c.probe_failures.add()
            self._fault(e, "probe", probe=True)
            return
        self._conn.success(probe=True)

    def _remember(self, keys: Sequence[bytes]) -> None:
        with self._known_lock:
            for k in keys:
                self._known[k] = None
                self._known.move_to_end(k)
            while len(self._known) > self.config.known_keys:
                self._known.popitem(last=False)

    def _forget(self, key: bytes) -> None:
        with self._known_lock:
            self._known.pop(key, None)

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes]) -> int:
        keys = list(keys)
        if not keys or not self._usable():
            return 0
        t0 = time.monotonic()
        try:
            pipe = self._redis().pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.layout.key(k))
            present = pipe.execute()
        except FAULTS as e:
            self._fault(e, "lookup")
            return 0
        finally:
            self._c.lookup_seconds.add(time.monotonic() - t0)
        n = 0
        for hit in present:
            if not hit:
                break
            n += 1
        self._conn.success()
        self._remember(keys[:n])
        if n < len(keys):  # evicted by Redis, or never there: let ``wants`` say yes again
            self._forget(keys[n])
        self._c.lookup_calls.add()
        self._c.lookup_hit_blocks.add(n)
        return n

    # ------------------------------------------------------------------ load
    def load(self, requests: Sequence[LoadRequest]) -> concurrent.futures.Future[int]:
        for r in requests:
            self.spec.check_tensor(r.dest, "LoadRequest.dest")
        requests = list(requests)
        if requests and not self._closed:
            try:
                return self._loader.submit(self._load, requests)
            except RuntimeError:  # closed meanwhile: the pool takes nothing more
                pass
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(0)
        return done

    def _load(self, requests: list[LoadRequest]) -> int:
        t0 = time.monotonic()
        deadline = t0 + self.config.load_timeout_s
        if self.load_bytes_per_s > 0:
            deadline += len(requests) * self.spec.nbytes / self.load_bytes_per_s
        n = 0
        try:
            n = self._load_chunks(requests, deadline)
        except Exception:  # the future must not carry an exception: a miss is the safe answer
            _log.exception("remote tier: load failed")
        finally:
            self._c.load_calls.add()
            self._c.load_hits.add(n)
            self._c.load_misses.add(len(requests) - n)
            self._c.load_bytes.add(n * self.spec.nbytes)
            self._c.load_seconds.add(time.monotonic() - t0)
        return n

    def _load_chunks(self, requests: list[LoadRequest], deadline: float) -> int:
        n = 0
        step = max(1, self.config.load_chunk_blocks)
        for start in range(0, len(requests), step):
            if not self._usable():
                return n
            if time.monotonic() > deadline:
                self._c.load_timeouts.add()
                return n
            chunk = requests[start: start + step]
            try:
                pipe = self._redis().pipeline(transaction=False)
                for r in chunk:
                    # At most one byte past a block's size: a value planted to be huge is
                    # never read whole (``size`` below), nor held by the client.
                    pipe.getrange(self.layout.key(r.key), 0, self._value_size)
                    if self._ttl_ms:
                        pipe.pexpire(self.layout.key(r.key), self._ttl_ms)
                values = pipe.execute()[::2 if self._ttl_ms else 1]
            except FAULTS as e:
                self._fault(e, "load")
                return n
            self._conn.success()
            for r, value in zip(chunk, values, strict=True):
                if not value:  # GETRANGE of a missing key: empty, never a block
                    self._c.load_missing.add()
                    self._forget(r.key)
                    return n
                reason = decode_block_into(value, self.spec, r.key, r.digest, tuple(r.token_ids), r.dest, self.seal)
                if reason is not None:
                    self._corrupt(r.key, reason)
                    return n
                n += 1
        return n

    def _corrupt(self, key: bytes, reason: str) -> None:
        total = self._c.failed(reason)
        self._forget(key)
        try:
            if self._redis().delete(self.layout.key(key)):
                self._c.corrupt_deleted.add()
        except FAULTS as e:
            self._fault(e, "deleting a corrupt block")
        if total & (total - 1) == 0:  # 1, 2, 4, 8, ...: bounded logging
            _log.warning("remote tier %s: deleted a value that failed its %s check (%d so far)",
                         redacted(self.url), reason, total)

    # ------------------------------------------------------------------ store
    def wants(self, key: bytes, wait_s: float = 0.0) -> bool:
        """A full queue is waited on only when asked (at shutdown): ``evict_wait_s`` stays 0,
        so serving never waits on Redis (writer.py)."""
        if not self._usable() or self._wfault.backing_off():
            return False
        with self._known_lock:
            if key in self._known or key in self._claims:
                return False
        return self._writer.wait_for_room(wait_s)

    def store(self, requests: Sequence[StoreRequest]) -> None:
        for r in requests:
            self.spec.check_tensor(r.data, "StoreRequest.data")
            check_identity(self.spec, r.key, r.digest, tuple(r.token_ids))
        for r in requests:
            if not self._usable() or self._wfault.backing_off():
                (self._c.dropped_closed if self._closed else self._c.dropped_backoff).add()
                continue
            with self._known_lock:
                if r.key in self._known or r.key in self._claims:
                    self._c.store_skipped_existing.add()
                    continue
                self._claims.add(r.key)
            if not self._writer.offer(r):
                with self._known_lock:
                    self._claims.discard(r.key)

    def _write_batch(self, requests: list[StoreRequest]) -> None:
        """Writer thread: skip what the store already holds (another replica wrote it), then
        ``SET NX`` the rest in one pipelined round trip."""
        t0 = time.monotonic()
        written: list[StoreRequest] = []
        try:
            if not self._usable() or self._wfault.backing_off():
                self._c.dropped_backoff.add(len(requests))
                return
            names = [self.layout.key(r.key) for r in requests]
            try:
                client = self._redis()
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.exists(name)
                present = pipe.execute()
                pipe = client.pipeline(transaction=False)
                todo = [(r, name) for r, name, there in zip(requests, names, present, strict=True) if not there]
                for r, name in todo:
                    value = encode_block(self.spec, r.key, r.digest, tuple(r.token_ids), r.data, time.time_ns(),
                                         r.parent, self.seal)
                    pipe.set(name, value, nx=True, px=self._ttl_ms or None)
                results = pipe.execute(raise_on_error=False) if todo else []
            except FAULTS as e:
                self._fault(e, "store")
                self._c.dropped_error.add(len(requests))
                return
            self._conn.success()
            # Counted only now: a batch that raises is counted once, whole, by the writer.
            self._c.store_skipped_existing.add(len(requests) - len(todo))
            self._remember([r.key for r, _, there in zip(requests, names, present, strict=True) if there])
            failed: Exception | None = None
            for (r, _), res in zip(todo, results, strict=True):
                if isinstance(res, Exception):
                    failed = res
                    (self._c.dropped_oom if _is_oom(res) else self._c.dropped_error).add()
                    continue
                written.append(r)
            if failed is not None:
                self._fault(failed, "store")
            elif written:
                self._wfault.success()
            self._remember([r.key for r in written])
            self._c.stored_blocks.add(len(written))
            self._c.stored_bytes.add(len(written) * self.spec.nbytes)
        finally:
            with self._known_lock:
                for r in requests:
                    self._claims.discard(r.key)
            self._c.store_seconds.add(time.monotonic() - t0)

    # ------------------------------------------------------------------ removal
    def remove(self, keys: Sequence[bytes]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        for k in keys:
            self._forget(k)
        try:
            pipe = self._redis().pipeline(transaction=False)
            for k in keys:
                pipe.delete(self.layout.key(k))
            n = sum(int(x) for x in pipe.execute())
        except FAULTS as e:
            self._fault(e, "remove")
            return 0
        self._c.removed_blocks.add(n)
        return n

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int | float]:
        out = self._c.as_dict()
        degraded = self._conn.in_episode or self._wfault.in_episode
        out.update({
            "remote_writer_queue_depth": self._writer.queue_depth,
            "remote_ok_state": 0 if degraded else 1,
        })
        return out

    def health(self) -> dict[str, object]:
        errors = [(f.last_error_time or 0.0, f.last_error) for f in (self._conn, self._wfault) if f.last_error]
        last_time, last_error = max(errors) if errors else (None, None)
        return tier_health(
            self.name, degraded=self._conn.in_episode or self._wfault.in_episode, last_error=last_error,
            last_error_time=last_time, writer_queue_depth=self._writer.queue_depth, closed=self._closed,
            last_shutdown_clean=None,
            detail={
                "url": redacted(self.url),
                "cluster": is_cluster(self.url),
                "namespace": self.layout.namespace,
                "connection_backoff_s": round(self._conn.backoff_remaining(), 3),
                "write_backoff_s": round(self._wfault.backoff_remaining(), 3),
                "ttl_s": self.config.ttl_s,
                "timeout_s": self.config.timeout_s,
                "sealed": self.seal is not None,
                **({} if self.seal is not None else {"warning": UNSEALED_WARNING}),
            })

    # ------------------------------------------------------------------ closing
    def wait_idle(self, timeout: float) -> bool:
        """Wait until every block offered so far was written or dropped."""
        return self._writer.wait_idle(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        if self._closed:
            return True
        drained = self._writer.close(timeout)
        self._closed = True
        self._loader.shutdown(wait=False)
        with self._client_lock:
            if self._client is not None:
                try:
                    self._client.close()
                except FAULTS:
                    pass
        return drained

    def __repr__(self) -> str:
        return f"RemoteTier({redacted(self.url)!r}, {self.layout.namespace})"
