"""A separate process that uses a DiskTier, for the restart and SIGKILL tests.

    python -m tests.storage.disk_child write ROOT NS DURABILITY ASYNC START
        store blocks START, START+1, ... forever, 4 per store() call; prints
        "stored <next index> <blocks written so far>" after each call
        (flushed), until killed.
    python -m tests.storage.disk_child batch ROOT NS START N CLOSE
        store blocks START..START+N-1 (async) and return from main; with
        CLOSE=0 the tier is never closed (the exit path must drain it).
    python -m tests.storage.disk_child check ROOT NS N
        open the namespace, lookup blocks 0..N-1, load and verify what lookup
        reports; prints one JSON line; closes cleanly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvcellar.storage.disk import DiskConfig, DiskTier
from tests.storage.helpers import SPEC, bits_equal, block, load_request


def write(root: str, ns: str, durability: str, async_writes: str, start: str) -> None:
    # No free-space floor: these processes test crashes, not how full the test machine's disk is.
    cfg = DiskConfig(durability=durability, async_writes=async_writes == "1",  # type: ignore[arg-type]
                     min_free_bytes=0)
    tier = DiskTier(Path(root), ns, SPEC, cfg)
    i = int(start)
    while True:
        tier.store([block(j) for j in range(i, i + 4)])
        i += 4
        print(f"stored {i} {tier.stats()['ssd_stored_blocks']}", flush=True)


def batch(root: str, ns: str, start: str, n: str, close: str) -> None:
    tier = DiskTier(Path(root), ns, SPEC, DiskConfig(queue_blocks=1024, enqueue_timeout_s=10.0,
                                                      min_free_bytes=0))
    first = int(start)
    for i in range(first, first + int(n), 8):
        tier.store([block(j) for j in range(i, min(i + 8, first + int(n)))])
    if close == "1":
        assert tier.close(60)
    print("done", flush=True)


def check(root: str, ns: str, n: str) -> None:
    tier = DiskTier(Path(root), ns, SPEC, DiskConfig(min_free_bytes=0))
    blocks = [block(i) for i in range(int(n))]
    present = tier.lookup([b.key for b in blocks])
    reqs = [load_request(b) for b in blocks[:present]]
    loaded = tier.load(reqs).result(timeout=60)
    same = all(bits_equal(r.dest, b.data) for r, b in zip(reqs[:loaded], blocks, strict=False))
    health = tier.health()
    print(json.dumps({"present": present, "loaded": loaded, "bits_equal": same,
                      "last_shutdown_clean": health["last_shutdown_clean"]}), flush=True)
    tier.close(10)


if __name__ == "__main__":
    {"write": write, "batch": batch, "check": check}[sys.argv[1]](*sys.argv[2:])
