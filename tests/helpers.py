"""Shared test helpers: a real ``kvcellar serve`` subprocess and ways to wait on it.

Nothing here sleeps for a fixed time to "let things settle": waits poll a condition until a
generous deadline and fail with what they last saw.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

MODEL = "SmolLM2-135M-Instruct"
# A small pool keeps start-up cheap; fp32 makes greedy outputs comparable across runs.
DEFAULT_SERVE_ARGS = ("--dtype", "float32", "--kv-cache-gb", "0.25")
READY_TIMEOUT = float(os.environ.get("KVCELLAR_TEST_READY_TIMEOUT", "300"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], T], *, timeout: float = 60.0, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except Exception as exc:  # e.g. connection refused while starting
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def kvcellar_command() -> list[str]:
    script = Path(sys.executable).with_name("kvcellar")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvcellar.cli"]


class ServerProcess:
    """``kvcellar serve`` on a free port of 127.0.0.1, logging to a file."""

    def __init__(self, cache_dir: Path, *extra_args: str, log_dir: Path | None = None,
                 env: dict[str, str] | None = None, api_key: str | None = None,
                 models_dir: Path | None = None, warmup: bool = False) -> None:
        """``models_dir``: a prepared-model artifact folder shared between servers (linked
        as ``<cache_dir>/models``), so that only the first start of a session prepares the
        model; KV caches stay separate. ``warmup``: run the server's warm-up before ready;
        off by default (it costs seconds per start and changes no output), on for the
        session server, which tests/server/test_warmup.py checks."""
        self.cache_dir = Path(cache_dir)
        if models_dir is not None:
            link = self.cache_dir / "models"
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            Path(models_dir).mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(Path(models_dir).resolve(), target_is_directory=True)
        self.extra_args: Sequence[str] = extra_args
        self.api_key = api_key
        self.warmup = warmup
        self.log_path = (log_dir or self.cache_dir) / "server.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @classmethod
    def attach(cls, url: str, api_key: str | None = None) -> ServerProcess:
        """A server someone else started (``KVCELLAR_TEST_SERVER_URL``, for quick iteration)."""
        proc = cls(Path("."), api_key=api_key)
        proc.port = int(url.rstrip("/").rsplit(":", 1)[1])
        return proc

    def start(self, ready_timeout: float = READY_TIMEOUT) -> ServerProcess:
        for _attempt in range(3):  # a port picked free may be taken by the time we bind
            self.port = free_port()
            cmd = [*kvcellar_command(), "serve", "--port", str(self.port), "--cache-dir", str(self.cache_dir),
                   *DEFAULT_SERVE_ARGS, *self.extra_args]
            if not self.warmup:
                cmd.append("--no-warmup")
            if self.api_key:
                cmd += ["--api-key", self.api_key]
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
            if self._wait_ready(ready_timeout):
                return self
            if "address already in use" not in self.log_tail().lower():
                break
        raise RuntimeError(f"kvcellar serve did not become ready; log tail:\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/health", timeout=10.0)
        return r.json()

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **kwargs)

    def wait_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until nothing is running, queued, loading, in flight or holding KV blocks."""
        last: dict[str, Any] = {}

        def idle() -> dict[str, Any] | None:
            h = self.health()
            busy = {"running": h["running"], "queue_depth": h["queue_depth"],
                    "loading": h.get("engine", {}).get("engine_loading", 0),
                    "inflight_requests": h["inflight_requests"], "kv_blocks_used": h["kv_blocks_used"],
                    "inflight_sequences": h["server"]["server_inflight_sequences"]}
            last.clear()
            last.update(busy)
            return h if not any(busy.values()) else None

        try:
            return wait_until(idle, timeout=timeout, what="the server to become idle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; busy: {last}") from None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
