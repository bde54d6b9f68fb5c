"""A real ``redis-server`` for tests: a free loopback port, a temporary config, stopped
by PID. Debian package ``redis-server`` (``make setup`` installs it when missing)."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import redis

from tests.helpers import free_port, wait_until


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is valid too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            return port


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, **settings: str) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; run `make setup` (installs the Debian package)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / f"redis-{self.port}.conf"
        lines = {
            "port": str(self.port), "bind": "127.0.0.1", "dir": str(self.workdir), "save": '""',
            "appendonly": "no", "protected-mode": "yes", "daemonize": "no",
            # DEBUG SLEEP simulates a stalled server (fault tests); loopback only.
            "enable-debug-command": "local", **self.settings,
        }
        conf.write_text("".join(f"{k} {v}\n" for k, v in lines.items()))
        with open(self.workdir / f"redis-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen([binary, str(conf)], stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._answers_or_exited, timeout=30, what=f"redis-server on port {self.port}")
        assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
        return self

    def _answers_or_exited(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            return True
        try:
            return bool(self.client().ping())
        except redis.ConnectionError:
            return False

    def client(self, **kwargs: Any) -> redis.Redis:
        kwargs.setdefault("socket_timeout", 10)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def kill(self) -> None:
        """SIGKILL, as a crash would (no save, clients see a reset)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def sleep_in_background(self, seconds: float) -> subprocess.Popen[bytes]:
        """``DEBUG SLEEP`` from another client: the server answers nobody meanwhile."""
        binary = shutil.which("redis-cli") or "redis-cli"
        return subprocess.Popen([binary, "-p", str(self.port), "DEBUG", "SLEEP", str(seconds)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
