"""Shared test helpers: a real ``kvcellar serve`` subprocess and ways to wait on it.

Starting, waiting for /health and stopping is the bench's launcher (``kvcellar.bench.launch``),
as is ``wait_until``; ``ServerProcess`` adds the test conveniences (clients, ``wait_idle``).
Nothing here sleeps for a fixed time to "let things settle": waits poll a condition until a
generous deadline and fail with what they last saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kvcellar.bench.launch import (
    ServerLauncher,
    free_port,
    kvcellar_command,
    link_models,
    serve_command,
    wait_until,
)

MODEL = "SmolLM2-135M-Instruct"
# A small pool keeps start-up cheap. The product's default weights (the embedded Q4_1 as int4 on
# kvcellar's kernels, where they pay): the servers under test run what users run, a decode
# step costs a third of float32's, and a token's numbers do not depend on its step, so greedy
# outputs compare exactly across runs, batches and cache hits.
DEFAULT_SERVE_ARGS = ("--dtype", "float32", "--weights", "auto", "--kv-cache-gb", "0.25")
READY_TIMEOUT = float(os.environ.get("KVCELLAR_TEST_READY_TIMEOUT", "300"))


class ServerProcess:
    """``kvcellar serve`` on a free port of 127.0.0.1, logging to a file."""

    def __init__(self, cache_dir: Path, *extra_args: str, log_dir: Path | None = None,
                 env: dict[str, str] | None = None, api_key: str | None = None,
                 models_dir: Path | None = None, warmup: bool = False,
                 disk_floor_gb: float | None = 0.0) -> None:
        """``models_dir``: a prepared-model artifact folder shared between servers (linked
        as ``<cache_dir>/models``), so that only the first start of a session prepares the
        model; KV caches stay separate. ``warmup``: run the server's warm-up before ready;
        off by default (it costs seconds per start and changes no output), on for the
        session server, which tests/server/test_warmup.py checks. ``disk_floor_gb``: the SSD
        tier's free-space floor, 0 so that no test depends on how full the test machine's disk
        is (a flag in ``extra_args`` wins); None leaves the server's default."""
        self.cache_dir = Path(cache_dir)
        if models_dir is not None:
            link_models(self.cache_dir, Path(models_dir))
        self.extra_args: Sequence[str] = extra_args
        self.api_key = api_key
        self.warmup = warmup
        self.disk_floor_gb = disk_floor_gb
        self.log_path = (log_dir or self.cache_dir) / "server.log"
        self.launcher = ServerLauncher(self.command, self.log_path, env=env, name="kvcellar serve")
        self._attached_url: str | None = None

    def command(self, port: int) -> list[str]:
        floor = () if self.disk_floor_gb is None else ("--disk-min-free-gb", f"{self.disk_floor_gb:g}")
        args = [*DEFAULT_SERVE_ARGS, *floor, *self.extra_args]
        if not self.warmup:
            args.append("--no-warmup")
        if self.api_key:
            args += ["--api-key", self.api_key]
        return serve_command(port, self.cache_dir, args)

    @property
    def proc(self) -> Any:
        return self.launcher.proc

    @property
    def port(self) -> int:
        return self.launcher.port

    @property
    def url(self) -> str:
        return self._attached_url or self.launcher.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @classmethod
    def attach(cls, url: str, api_key: str | None = None) -> ServerProcess:
        """A server someone else started (``KVCELLAR_TEST_SERVER_URL``, for quick iteration)."""
        proc = cls(Path("."), api_key=api_key)
        proc._attached_url = url.rstrip("/").removesuffix("/v1")
        return proc

    def start(self, ready_timeout: float = READY_TIMEOUT) -> ServerProcess:
        self.launcher.start(ready_timeout)
        return self

    def log_tail(self, n: int = 4000) -> str:
        return self.launcher.log_tail(n)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/health", headers=self.headers(), timeout=10.0)
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
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; busy: {last}") from None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.launcher.signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.launcher.wait_exit(timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        return self.launcher.stop(timeout)

    def kill(self) -> None:
        self.launcher.kill()


class InProcessServer:
    """A real uvicorn server on 127.0.0.1 around an app built in this process: for tests
    that need a component of the engine replaced by a test subclass (a fault that cannot be
    made real on demand), which a ``kvcellar serve`` subprocess cannot take."""

    def __init__(self, app: Any) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, name="test-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        wait_until(lambda: self._server.started, timeout=READY_TIMEOUT, what="the in-process server to start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=120)


def verified_namespaces(cache: Path) -> list[dict[str, Any]]:
    """``kvcellar cache verify --json`` over ``cache``: each namespace's report, having asserted
    that every entry it checked was whole (none bad, none unreadable)."""
    verify = subprocess.run([*kvcellar_command(), "cache", "verify", "--cache-dir", str(cache), "--json"],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stderr
    namespaces: list[dict[str, Any]] = json.loads(verify.stdout)["namespaces"]
    for ns in namespaces:
        assert ns["bad"] == {} and ns["unreadable"] == 0 and ns["ok"] == ns["checked"] > 0, ns
    return namespaces
