"""Fixtures for the remote tier's tests: real ``redis-server`` processes and tiers that
are always closed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcellar.storage import BlockSpec
from kvcellar.storage.remote.config import RemoteConfig
from kvcellar.storage.remote.tier import RemoteTier
from tests.helpers import wait_until
from tests.remote.redis_server import RedisServer, TLSFiles, cluster_port
from tests.storage.helpers import SPEC


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the tests that do not kill or reconfigure it."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(shared_redis: RedisServer) -> RedisServer:
    """The shared server, emptied for this test."""
    shared_redis.client().flushall()
    return shared_redis


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``private_redis(port=None, tls=None, **settings)``: a server this test may kill, stall
    or fill; not started yet. Every one is stopped by PID at teardown."""
    servers: list[RedisServer] = []

    def make(port: int | None = None, tls: TLSFiles | None = None, **settings: str) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}", port, tls, **settings)
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def open_remote() -> Iterator[Callable[..., RemoteTier]]:
    """``open_remote(url, fingerprint="fp", spec=SPEC, secret=None, **config)``; closed at teardown."""
    opened: list[RemoteTier] = []

    def make(url: str, fingerprint: str = "fp", spec: BlockSpec = SPEC, secret: bytes | None = None,
             **cfg: Any) -> RemoteTier:
        cfg.setdefault("backoff_initial_s", 0.05)
        cfg.setdefault("backoff_max_s", 0.2)
        tier = RemoteTier(url, fingerprint, spec, RemoteConfig(**cfg), secret)
        opened.append(tier)
        return tier

    yield make
    for t in opened:
        t.close(10)


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """A 3-node Redis Cluster (masters only) on loopback, stopped by PID at teardown."""
    import shutil
    import subprocess

    nodes = [RedisServer(tmp_path / f"node{i}", cluster_port(), **{"cluster-enabled": "yes",
                                                    "cluster-config-file": f"nodes-{i}.conf",
                                                    "cluster-node-timeout": "5000"}) for i in range(3)]
    try:
        for node in nodes:
            node.start()
        cli = shutil.which("redis-cli") or "redis-cli"
        made = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                               "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout + made.stderr
        wait_until(lambda: all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in nodes),
                   timeout=30, what="the cluster to settle")
        yield nodes
    finally:
        for node in nodes:
            node.stop()
