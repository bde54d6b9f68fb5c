"""Start a server on a free port of 127.0.0.1, wait until it answers, stop it by its process group.

The one launcher of ``kvcellar bench`` (its targets, ``targets.py``) and of the test suite
(``tests/helpers.py``), and the one polling helper, ``wait_until``, that both use.

- ``ServerLauncher.start`` picks a free port, runs ``command(port)`` in a new session (its own
  process group) with stdout and stderr appended to ``log_path``, and polls ``ready`` until it
  holds or the process exits. A port taken between picking and binding ("address already in
  use" in the log) is tried again, twice.
- ``stop`` sends SIGTERM to the group (kvcellar drains its disk writer on SIGTERM) and waits,
  then SIGKILL. It returns the exit status.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], *, timeout: float = 60.0, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; return that. An exception from it
    counts as "not yet" (e.g. connection refused while a server starts). Raises TimeoutError,
    with the last value or exception seen, after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
        except Exception as exc:
            last = exc
        else:
            last = value
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvcellar_command() -> list[str]:
    """The ``kvcellar`` script next to this interpreter, else ``python -m kvcellar.cli``."""
    script = Path(sys.executable).with_name("kvcellar")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvcellar.cli"]


def serve_command(port: int, cache_dir: Path, args: Sequence[str] = ()) -> list[str]:
    return [*kvcellar_command(), "serve", "--port", str(port), "--cache-dir", str(cache_dir), *args]


def link_models(cache_dir: Path, models_dir: Path) -> None:
    """Link a prepared-model folder as ``<cache_dir>/models``, so that a server started there
    loads the model prepared by an earlier one; its KV cache stays its own."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    models_dir.mkdir(parents=True, exist_ok=True)
    link = cache_dir / "models"
    if not link.exists() and not link.is_symlink():
        link.symlink_to(models_dir.resolve(), target_is_directory=True)


def answers(url: str, paths: Sequence[str] = ("/health",), headers: Mapping[str, str] | None = None) -> bool:
    """Whether the server at ``url`` answers 200 on one of ``paths``."""
    for path in paths:
        try:
            r = httpx.get(url + path, timeout=5.0, headers=dict(headers or {}))
        except httpx.HTTPError:
            return False
        if r.status_code == 200:
            return True
    return False


def _answers_as_itself(launcher: ServerLauncher) -> bool:
    try:
        r = httpx.get(launcher.url + "/health", timeout=5.0)
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    try:
        body = r.json()
    except ValueError:
        return True  # not a JSON health: nothing to check it by
    pid = body.get("pid") if isinstance(body, dict) else None
    return not isinstance(pid, int) or launcher.proc is None or _descends_from(pid, launcher.proc.pid)


def _descends_from(pid: int, root: int) -> bool:
    """Whether process ``pid`` is ``root`` or started under it (a wrapper command's child)."""
    for _ in range(8):
        if pid == root:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rpartition(")")[2].split()[1])  # the parent's pid, after the command's name
        if pid <= 1:
            return False
    return False


class LaunchError(RuntimeError):
    """The server exited, or did not answer in time, while starting."""


class ServerLauncher:
    """One server process at a time, started from ``command(port)``; see the module docstring.
    Not thread-safe: one owner starts and stops it."""

    def __init__(self, command: Callable[[int], Sequence[str]], log_path: Path, *,
                 ready: Callable[[ServerLauncher], bool] | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None, name: str = "server") -> None:
        """``ready``: whether the started server is up (default: ``/health`` answers 200, from
        this process where it says its ``pid``: a port given up by ``free_port`` can be taken by
        another server before this one binds it)."""
        self.command = command
        self.log_path = Path(log_path)
        self.ready = ready or _answers_as_itself
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):
            self.port = free_port()
            cmd = list(self.command(self.port))
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== start {self.name} at {time.strftime('%H:%M:%S')}: {shlex.join(cmd)}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                             start_new_session=True)
            try:
                wait_until(lambda: not self.running or self.ready(self), timeout=timeout, interval=0.1,
                           what=f"{self.name} to answer")
            except TimeoutError:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(timeout=30)
                raise LaunchError(f"{self.name} did not answer within {timeout:g}s; log {self.log_path}, "
                                  f"tail:\n{self.log_tail()}") from None
            if self.running:
                return
            if "address already in use" not in self.log_tail().lower():
                break
        assert self.proc is not None  # every attempt starts one
        raise LaunchError(f"{self.name} exited with {self.proc.returncode} while starting; log {self.log_path}, "
                          f"tail:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's process group."""
        self._signal_group(sig)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.running:
            self._signal_group(signal.SIGKILL)
            self.wait_exit(30)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
