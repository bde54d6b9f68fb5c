"""The SSD tier under sustained write overload: what RAM computes, what reaches the disk,
and what is lost for good.

    .venv/bin/python benchmarks/bench_write_overload.py [--prompts 300] [--write-ms 2] [--queue-blocks 16]

In process: the real scheduler, block manager, KV pool and tier link, driven by the fake
model of tests/fake_runner.py (a step costs microseconds, so KV is produced far faster than
any disk writes it), over a real ``DiskTier`` in a temporary folder whose writer takes
``--write-ms`` per block (a slow disk, made on demand: the writer thread waits that long
before each block). The RAM pool (``--pool-blocks``) is small, so most blocks are evicted
while the writer is behind. Every prompt is distinct: each block is computed once.

Reported per eviction wait (``--evict-wait-ms``, the disk tier's ``ssd_evict_wait_s``; on a
tree without that setting, the 1 ms store budget): blocks computed (registered in RAM),
copied off the pool for the SSD (the link's ``ssd_link_stored_blocks``), queued
(``writer_enqueued``), dropped for a full queue (``writer_dropped_queue_full``), written
during the run and in all (after the shutdown offers RAM's blocks again), lost (computed,
not on disk after shutdown), the run's wall time and the time spent waiting for the queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fake_runner import VOCAB, Driver

from kvcellar.cache.tiering import LowerTierLink
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier


class SlowDisk(DiskTier):
    """The real SSD tier whose writer spends ``write_s`` on every block."""

    write_s = 0.002

    def _defer_to_reads(self, max_s: float) -> bool:
        time.sleep(self.write_s)
        return super()._defer_to_reads(max_s)


def run(args: argparse.Namespace, evict_wait_ms: float | None) -> dict[str, Any]:
    rng = random.Random(args.seed)
    work = [[rng.randrange(VOCAB) for _ in range(rng.randrange(args.min_tokens, args.max_tokens))]
            for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="kvcellar-overload-") as root:
        driver = Driver(num_blocks=args.pool_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_step_tokens=args.max_step_tokens)
        cfg: dict[str, Any] = {"min_free_bytes": 0, "queue_blocks": args.queue_blocks}
        names = {f.name for f in dataclasses.fields(DiskConfig)}
        if evict_wait_ms is not None and "evict_wait_s" in names:
            cfg["evict_wait_s"] = evict_wait_ms / 1000
        tier = SlowDisk(Path(root) / "kv", "overload", LowerTierLink.block_spec(driver.pool), DiskConfig(**cfg))
        tier.write_s = args.write_ms / 1000
        assert tier.wait_scanned(30)
        driver.attach(tier)
        t0 = time.monotonic()
        for p in work:
            driver.submit(p, args.decode)
        driver.run()
        wall = time.monotonic() - t0
        during = tier.stats()
        clean = driver.lower.close(600, driver.bm.cached_blocks())
        s = driver.lower.stats_by_tier()["ssd"]
        on_disk = sum(1 for _ in (Path(root) / "kv").rglob("*.kvb"))
    computed = driver.bm.stats.registered
    assert driver.bm.stats.collisions == 0
    return {
        "wait": "1 ms budget" if evict_wait_ms is None else f"{evict_wait_ms:g} ms",
        "computed": computed,
        "copied": s["ssd_link_stored_blocks"],
        "queued": s["writer_enqueued"],
        "dropped_full": s["writer_dropped_queue_full"],
        "written_run": during["ssd_stored_blocks"],
        "written": s["ssd_stored_blocks"],
        "lost": computed - on_disk,
        "wall_s": wall,
        "wait_s": s["writer_enqueue_wait_s_total"],
        "clean": clean,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--min-tokens", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--decode", type=int, default=4, help="tokens generated per prompt")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--pool-blocks", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-step-tokens", type=int, default=64)
    ap.add_argument("--queue-blocks", type=int, default=16)
    ap.add_argument("--write-ms", type=float, default=2.0, help="the slow disk: time per block written")
    ap.add_argument("--evict-wait-ms", type=float, nargs="*", default=None,
                    help="eviction waits to compare (default: the tier's default; none on a tree without it)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    waits: list[float | None] = list(args.evict_wait_ms) if args.evict_wait_ms else [None]
    print(f"{args.prompts} prompts of {args.min_tokens}-{args.max_tokens} tokens + {args.decode} decoded, "
          f"block size {args.block_size}, pool {args.pool_blocks} blocks, queue {args.queue_blocks}, "
          f"{args.write_ms:g} ms per block written\n")
    cols = ("wait", "computed", "copied", "queued", "dropped_full", "written_run", "written", "lost", "wall_s",
            "wait_s", "clean")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for w in waits:
        row = run(args, w)
        print("| " + " | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
