"""A separate process that uses a DiskTier, for the restart and SIGKILL tests.

    python -m tests.storage.disk_child write ROOT NS DURABILITY ASYNC START
        store blocks START, START+1, ... forever, 4 per store() call; prints
        "stored <next index> <blocks written so far>" after each call
        (flushed), until killed.
    python -m tests.storage.disk_child check ROOT NS N
        open the namespace, lookup blocks 0..N-1, load and verify what lookup
        reports; prints one JSON line; closes cleanly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvcellar.storage import DiskTier, DiskTierConfig
from tests.storage.helpers import SPEC, bits_equal, block, load_request


def write(root: str, ns: str, durability: str, async_writes: str, start: str) -> None:
    cfg = DiskTierConfig(durability=durability, async_writes=async_writes == "1")  # type: ignore[arg-type]
    tier = DiskTier(Path(root), ns, SPEC, cfg)
    i = int(start)
    while True:
        tier.store([block(j) for j in range(i, i + 4)])
        i += 4
        print(f"stored {i} {tier.stats()['ssd_stored_blocks']}", flush=True)


def check(root: str, ns: str, n: str) -> None:
    tier = DiskTier(Path(root), ns, SPEC, DiskTierConfig())
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
    {"write": write, "check": check}[sys.argv[1]](*sys.argv[2:])
