"""How long a replica takes to use Redis again after Redis was down (issue 12's "recovery").

A real ``kvcellar serve`` with ``--remote-url`` and a real ``redis-server``: Redis is killed
(SIGKILL) while the server is idle (one request right after Redis is back) or answering a
request every ``--period`` seconds, stays down for each of ``--outages`` seconds, is started
again on the same port (empty), and the time from its restart to the replica's ``/health``
saying the remote tier is ``ok`` again, and to its first block stored there, is measured.
Every answer in between must be a 200.

    .venv/bin/python benchmarks/bench_remote_recovery.py --outages 2,10,30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import MODEL, ServerProcess, wait_until  # the one way a test server starts
from tests.remote.redis_server import RedisServer


def ask(server: ServerProcess, i: int) -> None:
    r = server.post("/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 2,
        "messages": [{"role": "user", "content": f"Ticket {i}: the disk is full on host {i}. First step?"}]})
    assert r.status_code == 200, r.text


def stored_blocks(server: ServerProcess) -> int:
    return int(server.health()["tiers"]["remote"]["counters"]["remote_stored_blocks"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outages", default="2,10,30", help="seconds Redis stays down, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--period", type=float, default=0.5, help="seconds between requests while loaded")
    ap.add_argument("--models-dir", default=None, help="prepared-model folder to share (tests' models dir)")
    args = ap.parse_args()
    outages = [float(x) for x in args.outages.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvc-bench-recovery-") as tmp:
        work = Path(tmp)
        redis = RedisServer(work / "redis").start()
        server = ServerProcess(work / "kvc", "--remote-url", redis.url,
                               models_dir=Path(args.models_dir) if args.models_dir else None).start()
        rows = []
        counter = [0]
        try:
            ask(server, 0)
            for loaded in (False, True):
                for outage in outages:
                    for _ in range(args.repeats):
                        stop = threading.Event()

                        def load(stop: threading.Event = stop) -> None:
                            while not stop.wait(args.period):
                                counter[0] += 1
                                ask(server, counter[0])

                        worker = threading.Thread(target=load, daemon=True)
                        if loaded:
                            worker.start()
                        redis.kill()
                        if not loaded:  # an idle replica notices at its next request
                            counter[0] += 1
                            ask(server, counter[0])
                        wait_until(lambda: server.health()["tiers"]["remote"]["state"] == "degraded", timeout=60,
                                   what="the tier to notice")
                        time.sleep(outage)
                        stored = stored_blocks(server)
                        redis.start()
                        t0 = time.monotonic()
                        if not loaded:  # the first request after Redis is back
                            counter[0] += 1
                            ask(server, counter[0])
                        wait_until(lambda: server.health()["tiers"]["remote"]["state"] == "ok", timeout=120,
                                   interval=0.02, what="the tier to reconnect")
                        ok_s = time.monotonic() - t0
                        if not loaded:  # its blocks were dropped while the tier was down: a next one
                            counter[0] += 1
                            ask(server, counter[0])
                        wait_until(lambda s=stored: stored_blocks(server) > s,
                                   timeout=120, interval=0.02, what="a block stored in Redis again")
                        stored_s = time.monotonic() - t0
                        stop.set()
                        if loaded:
                            worker.join(timeout=60)
                        rows.append({"loaded": loaded, "outage_s": outage, "ok_s": ok_s, "stored_s": stored_s})
                        print(rows[-1], flush=True)
            failed = server.health()["server"]["server_requests_failed"]
        finally:
            server.stop()
            redis.stop()
    print(f"\nrequests failed: {failed}\n")
    print("| replica | Redis down s | restart -> tier ok s | restart -> first block stored s |")
    print("|---|---:|---:|---:|")
    for loaded in (False, True):
        for outage in outages:
            sel = [r for r in rows if r["loaded"] == loaded and r["outage_s"] == outage]
            ok = [r["ok_s"] for r in sel]
            st = [r["stored_s"] for r in sel]
            who = f"a request every {args.period:g}s" if loaded else "idle, one request at restart"
            print(f"| {who} | {outage:g} | "
                  f"{statistics.median(ok):.2f} ({min(ok):.2f}-{max(ok):.2f}) | "
                  f"{statistics.median(st):.2f} ({min(st):.2f}-{max(st):.2f}) |")


if __name__ == "__main__":
    main()
