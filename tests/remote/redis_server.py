"""A real ``redis-server`` for tests: a free loopback port, a temporary config, stopped
by PID. Debian package ``redis-server`` (``make setup`` installs it when missing).
``TLSFiles`` / ``make_tls_files``: a throwaway CA and server certificate (``openssl``) for a
TLS-only server."""

from __future__ import annotations

import functools
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.helpers import free_port, wait_until


@dataclass(frozen=True)
class TLSFiles:
    ca: Path  # the CA certificate that signed ``cert``: what a client must trust
    cert: Path
    key: Path


def make_tls_files(workdir: Path) -> TLSFiles:
    """A new self-signed CA and a server certificate it signed, valid for 127.0.0.1 and
    localhost. Each call makes another CA: a client trusting one rejects the others."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not installed")
    workdir.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(workdir / "ca.pem", workdir / "server.pem", workdir / "server.key")
    ca_key, csr, ext = workdir / "ca.key", workdir / "server.csr", workdir / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str | Path) -> None:
        done = subprocess.run([openssl, *map(str, args)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", files.ca, "-days", "2",
        "-subj", "/CN=kvcellar test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", files.key, "-out", csr, "-subj", "/CN=localhost")
    run("x509", "-req", "-in", csr, "-CA", files.ca, "-CAkey", ca_key, "-CAcreateserial", "-out", files.cert,
        "-days", "2", "-extfile", ext)
    return files


@functools.cache
def tls_unsupported() -> str | None:
    """Why a TLS redis-server cannot run here (a reason to skip), or None. A build without
    TLS rejects the ``tls-port`` directive; one with TLS, told to listen nowhere, just exits."""
    binary = shutil.which("redis-server")
    if binary is None:
        return "redis-server is not installed"
    if shutil.which("openssl") is None:
        return "openssl is not installed"
    done = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--save", ""], capture_output=True, text=True,
                          timeout=30)
    if "Bad directive" in done.stdout + done.stderr:
        return "redis-server was built without TLS"
    return None


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is valid too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            return port


class RedisServer:
    """``tls``: serve TLS only, on ``port``, with that certificate (clients are not asked for one)."""

    def __init__(self, workdir: Path, port: int | None = None, tls: TLSFiles | None = None, **settings: str) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.tls = tls
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
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
            "enable-debug-command": "local", **self._tls_settings(), **self.settings,
        }
        conf.write_text("".join(f"{k} {v}\n" for k, v in lines.items()))
        with open(self.workdir / f"redis-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen([binary, str(conf)], stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._answers_or_exited, timeout=30, what=f"redis-server on port {self.port}")
        assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
        return self

    def _tls_settings(self) -> dict[str, str]:
        if self.tls is None:
            return {}
        return {"port": "0", "tls-port": str(self.port), "tls-cert-file": str(self.tls.cert),
                "tls-key-file": str(self.tls.key), "tls-ca-cert-file": str(self.tls.ca), "tls-auth-clients": "no"}

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
        if self.tls is not None:
            kwargs.setdefault("ssl", True)
            kwargs.setdefault("ssl_ca_certs", str(self.tls.ca))
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
