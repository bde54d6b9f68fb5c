"""Running the server: load the model, build the engine and the app, run uvicorn.

Shutdown protocol (SIGTERM or SIGINT):

1. the first signal starts draining: ``/v1/*`` answers 503 and ``/health`` reports
   ``draining`` (also 503) while the listening socket stays open;
2. ``Engine.shutdown(shutdown_timeout)`` runs on a worker thread: in-flight requests finish
   until the deadline, the rest are aborted (their clients get an error), the step loop
   stops;
3. uvicorn then closes the socket, waits briefly for responses to flush, runs the app's
   lifespan shutdown, and the process exits 0.

A second signal stops uvicorn from waiting for open connections; the engine's drain is still
bounded by ``shutdown_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

import uvicorn

from kvcellar.engine.loader import machine_figures
from kvcellar.engine.warmup import warm_up
from kvcellar.runtime import build_engine
from kvcellar.server import logs
from kvcellar.server.app import ServerState, create_app
from kvcellar.settings import Settings

log = logging.getLogger(__name__)

# After the engine drained, how long uvicorn may take to flush the last responses.
FLUSH_SECONDS = 5.0


def serve(settings: Settings, log_level: str = "WARNING") -> int:
    server_cfg = settings.server
    logs.configure(log_level, server_cfg.log_format)
    if server_cfg.host not in ("127.0.0.1", "localhost", "::1") and not (server_cfg.api_key or
                                                                        server_cfg.api_key_file):
        print(f"kvcellar: warning: listening on {server_cfg.host} without --api-key: anyone who can reach "
              "this port can use the model", file=sys.stderr)
    settings.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    # Prepared weights come from (and go to) the artifact cache under the cache root; KV
    # blocks live below it too (the SSD tier).
    engine = build_engine(settings)
    if settings.engine.warmup:
        try:
            seconds = warm_up(engine, figures=machine_figures(engine.pool.device))
            print(f"kvcellar: warmed up in {seconds:.2f} s", file=sys.stderr, flush=True)
        except Exception:  # a speed-up only: serve anyway, the first request pays the one-off costs
            log.exception("warm-up failed; serving without it")
    app = create_app(engine, server_cfg)
    uv_config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_config=None,
                               access_log=server_cfg.access_log, lifespan="on",
                               timeout_graceful_shutdown=int(FLUSH_SECONDS))
    server = GracefulServer(uv_config, app.state.kvcellar, server_cfg.shutdown_timeout)
    try:
        server.run()
    finally:
        # Normally a no-op (the lifespan stopped the engine); after a forced exit it is what
        # stops the engine's (non-daemon) thread.
        engine.shutdown(timeout=0)
    if not server.started:
        return 1
    return 0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._signalled = False
        self._drained = False

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            cfg = self.config
            print(f"kvcellar: serving {self.state.serving.model_name} on http://{cfg.host}:{cfg.port}",
                  file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Unlike uvicorn's, this does not re-raise the signal after shutting down: a drained
        # shutdown is a normal exit (status 0).
        if self._signalled or self._loop is None or not self.started:
            self.should_exit = True
            # A second signal forces the exit, unless the drain is already over (e.g. `make`
            # passing its own SIGTERM on): forcing then only cancels the app's lifespan
            # mid-shutdown, which uvicorn reports as an error.
            self.force_exit = self._signalled and not self._drained
            return
        self._signalled = True
        self.state.start_draining()
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        print(f"kvcellar: {signal.Signals(sig).name}: draining (up to {self.shutdown_timeout:g} s)",
              file=sys.stderr, flush=True)
        self._drain = asyncio.ensure_future(self._drain_engine())

    async def _drain_engine(self) -> None:
        try:
            clean = await asyncio.to_thread(self.state.engine.shutdown, self.shutdown_timeout)
            print("kvcellar: drained, " + ("every request finished" if clean else
                  f"requests still running after {self.shutdown_timeout:g} s were cancelled") + "; exiting",
                  file=sys.stderr, flush=True)
        finally:
            self._drained = True
            self.should_exit = True
