"""The servers a benchmark measures: kvcellar started by the bench, a peer started from a
command, or any OpenAI-compatible server already running at a URL.

Every target answers the same small set of verbs: ``start``, ``stop``, ``restart`` (with
the page cache dropped in between), ``counters`` (kvcellar's /health counters, flat; empty
for a peer) and the ``url`` to talk to. A target started here is run by the launcher shared
with the tests (``launch.py``): its own process group, stopped with SIGTERM to that group,
then SIGKILL after ``stop_timeout``; kvcellar drains its disk writer on SIGTERM, so a restart
measures what a clean shutdown left on disk.
"""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvcellar.bench.launch import ServerLauncher, answers, link_models, serve_command, wait_until
from kvcellar.bench.pagecache import drop_page_cache
from kvcellar.cache.block_manager import BlockStats
from kvcellar.cache.tiering import LinkStats
from kvcellar.engine.stats import EngineStats
from kvcellar.stats import Stats
from kvcellar.storage.disk.stats import DiskStats, DiskWriterStats

S = TypeVar("S", bound=Stats)

READY_TIMEOUT_S = 600.0
# kvcellar answers /health; a peer may only have the OpenAI routes.
READY_PATHS = ("/health", "/v1/models")


def default_models_dir() -> Path:
    from kvcellar.paths import resolve_cache_dir

    return Path(resolve_cache_dir(None)) / "models"


def flat_counters(health: Mapping[str, Any]) -> dict[str, float]:
    """Every numeric counter of a kvcellar /health answer, by its prefixed name."""
    out: dict[str, float] = {}

    def walk(node: Mapping[str, Any]) -> None:
        for k, v in node.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, int | float):
                out.setdefault(k, float(v))
            elif isinstance(v, Mapping):
                walk(v)

    for group in ("tiers", "engine", "sched", "server"):
        if isinstance(health.get(group), Mapping):
            walk(health[group])
    return out


@dataclass(frozen=True)
class TierSplit:
    """Where the prompt tokens of what ran between two /health answers came from, by
    tier (each tier's own count: the RAM block table's hits, the link's per lower tier),
    and what the SSD read for them."""

    ram_tokens: float
    ssd_tokens: float
    remote_tokens: float
    computed_tokens: float
    ssd_blocks_loaded: float
    ssd_bytes_loaded: float

    @classmethod
    def between(cls, before: Mapping[str, float], after: Mapping[str, float]) -> TierSplit:
        def change(stats: type[S], prefix: str | None = None) -> S:
            return stats.from_dict(after, prefix).since(stats.from_dict(before, prefix))

        ssd, remote = change(LinkStats, "ssd_link_"), change(LinkStats, "remote_link_")
        return cls(ram_tokens=change(BlockStats).hit_tokens, ssd_tokens=ssd.hit_tokens,
                   remote_tokens=remote.hit_tokens, computed_tokens=change(EngineStats).computed_tokens,
                   ssd_blocks_loaded=ssd.loaded_blocks,
                   ssd_bytes_loaded=DiskStats.from_dict(after).load_bytes.value
                   - DiskStats.from_dict(before).load_bytes.value)


@dataclass(frozen=True)
class SsdWrites:
    """What the SSD tier stored and its writer dropped over a run (one /health answer)."""

    stored_blocks: float
    stored_bytes: float
    enqueued: float
    dropped: float  # queue full or backing off
    enqueue_wait_s: float
    generated_tokens: float

    @classmethod
    def of(cls, counters: Mapping[str, float]) -> SsdWrites | None:
        """None for a server that reports no SSD tier (a peer, or a URL)."""
        if not any(k.startswith(DiskStats.PREFIX) for k in counters):
            return None
        disk, writer = DiskStats.from_dict(counters), DiskWriterStats.from_dict(counters)
        return cls(stored_blocks=disk.stored_blocks.value, stored_bytes=disk.stored_bytes.value,
                   enqueued=writer.enqueued.value,
                   dropped=writer.dropped_queue_full.value + writer.dropped_backoff.value,
                   enqueue_wait_s=writer.enqueue_wait_s_total.value,
                   generated_tokens=EngineStats.from_dict(counters).generated_tokens)


class Target:
    """A server to measure. Subclasses start and stop it; this base only talks HTTP."""

    kind = "url"

    def __init__(self, name: str, url: str = "", api_key: str | None = None) -> None:
        self.name = name
        self.url = url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.cache_dir: Path | None = None
        self.log_path: Path | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def can_restart(self) -> bool:
        return False

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> Target:
        self.wait_ready(timeout=30.0)
        self.starts += 1
        return self

    def stop(self) -> None:
        pass

    def restart(self, drop_cache: bool = True) -> str:
        raise RuntimeError(f"{self.name} is a running server at a URL; the bench cannot restart it")

    def health(self) -> dict[str, Any] | None:
        """kvcellar's /health JSON (with its ``tiers``), or None for a server that has none."""
        try:
            r = httpx.get(self.url + "/health", timeout=10.0, headers=self.headers())
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) and "tiers" in body else None

    @property
    def is_kvcellar(self) -> bool:
        return self.health() is not None

    def counters(self) -> dict[str, float]:
        h = self.health()
        return flat_counters(h) if h else {}

    def kv_spec(self) -> dict[str, Any] | None:
        """The SSD tier's block spec (``block_nbytes``, ``block_size``, ...) from its namespace.json."""
        h = self.health()
        path = (((h or {}).get("tiers") or {}).get("ssd") or {}).get("ssd") or {}
        ns = Path(path["path"]) / "namespace.json" if path.get("path") else None
        if ns is None or not ns.exists():
            return None
        import json

        return dict(json.loads(ns.read_text()).get("spec", {}))

    def served_model(self) -> str:
        r = httpx.get(self.base_url + "/models", timeout=30.0, headers=self.headers())
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    def ready(self) -> bool:
        return answers(self.url, READY_PATHS, self.headers())

    def wait_ready(self, timeout: float) -> None:
        try:
            wait_until(self.ready, timeout=timeout, interval=0.2, what=f"{self.name} at {self.url}")
        except TimeoutError as exc:
            raise RuntimeError(str(exc)) from None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "url": self.url, "can_restart": self.can_restart,
                "cache_dir": str(self.cache_dir) if self.cache_dir else None,
                "log": str(self.log_path) if self.log_path else None}


class ProcessTarget(Target):
    """A server the bench starts as a subprocess on a free port of 127.0.0.1."""

    kind = "command"

    def __init__(self, name: str, work_dir: Path, *, ready_timeout: float = READY_TIMEOUT_S,
                 stop_timeout: float = 60.0, env: Mapping[str, str] | None = None) -> None:
        super().__init__(name)
        self.work_dir = Path(work_dir)
        self.cache_dir: Path = self.work_dir / "cache"
        self.log_path = self.work_dir / "server.log"
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.server = ServerLauncher(self.command, self.log_path, env=env, cwd=self.work_dir, name=name,
                                     ready=lambda s: answers(s.url, READY_PATHS, self.headers()))
        self.last_start_s: float | None = None
        self.last_stop_s: float | None = None
        self.last_exit_code: int | None = None

    @property
    def can_restart(self) -> bool:
        return True

    @property
    def proc(self) -> Any:
        return self.server.proc

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def start(self) -> Target:
        if self.server.running:
            return self
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            self.server.start(self.ready_timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name} did not become ready: {exc}") from None
        self.url = self.server.url
        self.last_start_s = time.perf_counter() - t0
        self.starts += 1
        return self

    def stop(self) -> None:
        if not self.server.running:
            return
        t0 = time.perf_counter()
        self.last_exit_code = self.server.stop(self.stop_timeout)
        self.last_stop_s = time.perf_counter() - t0

    def restart(self, drop_cache: bool = True) -> str:
        """Stop, drop the page cache (what a cold machine would have), start again.
        Returns how the page cache was dropped (see ``pagecache.drop_page_cache``)."""
        self.stop()
        method = drop_page_cache([self.cache_dir] if self.cache_dir else []) if drop_cache else "not dropped"
        self.start()
        return method

    def log_tail(self, n: int = 4000) -> str:
        return self.server.log_tail(n)


class KvcellarTarget(ProcessTarget):
    """``kvcellar serve`` with its own cache dir; prepared models come from ``models_dir``
    (linked as ``<cache_dir>/models``), so a bench run does not prepare the model again."""

    kind = "kvcellar"

    def __init__(self, name: str, work_dir: Path, *, models_dir: Path | None = None,
                 serve_args: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(name, work_dir, **kwargs)
        self.serve_args = list(serve_args)
        self.models_dir = Path(models_dir) if models_dir else None

    def start(self) -> Target:
        if self.models_dir is not None:
            link_models(self.cache_dir, self.models_dir)
        return super().start()

    def command(self, port: int) -> list[str]:
        return serve_command(port, self.cache_dir, self.serve_args)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "serve_args": self.serve_args,
                "models_dir": str(self.models_dir) if self.models_dir else None}


class CommandTarget(ProcessTarget):
    """A peer started from a shell command; ``{port}``, ``{host}`` and ``{cache_dir}`` are
    substituted. It runs with the bench's working directory's absolute paths intact (the
    command's cwd is its work dir under the output dir)."""

    def __init__(self, name: str, work_dir: Path, command_template: str, **kwargs: Any) -> None:
        super().__init__(name, work_dir, **kwargs)
        self.command_template = command_template

    def command(self, port: int) -> list[str]:
        text = self.command_template.format(port=port, host="127.0.0.1", cache_dir=str(self.cache_dir))
        return ["bash", "-c", text]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "command": self.command_template}


# ---- command line ------------------------------------------------------------------------


def add_target_arguments(p: argparse.ArgumentParser, *, kvcellar_flags: bool = True) -> None:
    """Options choosing what to measure: kvcellar started here (default) or a URL, plus a peer."""
    g = p.add_argument_group("targets")
    g.add_argument("--base-url", default=None,
                   help="measure an already-running OpenAI-compatible server at this URL instead of starting "
                        "kvcellar (restart phases are then not applicable)")
    g.add_argument("--name", default=None, help="label of the --base-url server in tables (default: server)")
    g.add_argument("--peer-command", default=None,
                   help="also measure a peer started by this shell command ({port}, {cache_dir} substituted); "
                        "it is restarted between phases, e.g. 'benchmarks/peer/run_llama_cpp.sh {port} {cache_dir}'")
    g.add_argument("--peer-url", default=None, help="also measure a peer already running at this URL")
    g.add_argument("--peer-name", default="peer", help="label of the peer in tables (default: peer)")
    g.add_argument("--api-key", default=None, help="bearer token for --base-url / peers")
    g.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S,
                   help="seconds a started server may take to answer (default %(default)s)")
    if kvcellar_flags:
        k = p.add_argument_group("kvcellar started by the bench")
        k.add_argument("--models-dir", type=Path, default=None,
                       help="prepared-model folder to reuse (linked as <cache_dir>/models; default: "
                            "<KVCELLAR_CACHE_DIR or ~/.cache/kvcellar>/models)")
        k.add_argument("--serve-args", default="",
                       help="extra flags for 'kvcellar serve', one shell-quoted string (e.g. '--dtype float32')")
        k.add_argument("--keep-cache", action="store_true",
                       help="keep the KV cache dirs under the output dir (default: delete them at the end)")


def kvcellar_target(args: argparse.Namespace, name: str, out_dir: Path,
                    extra_serve_args: Sequence[str] = ()) -> KvcellarTarget:
    return KvcellarTarget(name, out_dir / "servers" / name, models_dir=args.models_dir or default_models_dir(),
                          serve_args=[*shlex.split(args.serve_args or ""), *extra_serve_args],
                          ready_timeout=args.ready_timeout)


def targets_from_args(args: argparse.Namespace, out_dir: Path) -> list[Target]:
    """[kvcellar started here, or the --base-url server] + [the peer, if any]."""
    targets: list[Target] = []
    if args.base_url:
        targets.append(Target(args.name or "server", args.base_url, api_key=args.api_key))
    else:
        targets.append(kvcellar_target(args, "kvcellar", out_dir))
    targets.extend(peer_targets(args, out_dir))
    return targets


def variant_targets(args: argparse.Namespace, out_dir: Path, flag: str, values: Sequence[str]) -> list[Target]:
    """kvcellar started once per value of ``flag`` (``kvcellar-<value>``), or the --base-url
    server alone; the peers are the caller's to add."""
    if args.base_url:
        return [Target(args.name or "server", args.base_url, api_key=args.api_key)]
    return [kvcellar_target(args, f"kvcellar-{v}", out_dir, [flag, v]) for v in values]


def peer_targets(args: argparse.Namespace, out_dir: Path) -> list[Target]:
    out: list[Target] = []
    if args.peer_command:
        peer = CommandTarget(args.peer_name, out_dir / "servers" / args.peer_name, args.peer_command,
                             ready_timeout=args.ready_timeout)
        peer.api_key = args.api_key
        out.append(peer)
    if args.peer_url:
        out.append(Target(args.peer_name, args.peer_url, api_key=args.api_key))
    return out


def cleanup_cache(target: Target, keep: bool) -> None:
    """Delete a started kvcellar's KV blocks (they can be GiBs); the models link and logs stay."""
    if keep or not isinstance(target, ProcessTarget) or target.cache_dir is None:
        return
    import shutil

    for child in target.cache_dir.iterdir() if target.cache_dir.exists() else ():
        if child.name == "models" and child.is_symlink():
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
