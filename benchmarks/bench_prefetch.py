"""A queued disk hit behind a running request, with and without prefetch.

    python benchmarks/bench_prefetch.py [--tokens 4096] [--busy-tokens 32] [--repeats 3] [--dtype float32]

In process, embedded SmolLM2, SSD tier in a temporary folder, ``max_num_seqs=1``. One
engine writes a ``--tokens`` prompt's KV to the SSD and shuts down; then, per row, a fresh
engine (empty RAM, same folder, the page cache of the block files dropped) starts a busy
request (a short prompt, ``--busy-tokens`` decoded tokens) and, once that one decodes,
receives the disk-hit request (max_tokens=1), which waits for the only slot. Reported:
the disk hit's TTFT from its submission, and from the moment the busy request finished
(what the wait adds on top of the slot becoming free), and how long the busy request took
after the disk hit's submission (the read's cost to it: reader threads and checksums
share the cores with its decode). Rows alternate prefetch on
(``prefetch_pool_fraction=0.25``) and off (0). One throw-away round first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests._models import chat_ids, embedded, make_engine

from kvcellar.bench.pagecache import drop_page_cache
from kvcellar.engine import SamplingParams, observability
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier


def engine_with_disk(loaded: Any, root: Path, dtype_gb: float, fraction: float) -> Any:
    engine = make_engine(loaded, kv_cache_gb=dtype_gb, max_num_seqs=1, max_step_tokens=512,
                         max_prefill_step_tokens=2048, prefetch_pool_fraction=fraction)
    engine.attach_tier(DiskTier(root, engine.fingerprint, engine.block_spec, DiskConfig(min_free_bytes=0),
                                descriptor=engine.descriptor))
    return engine


def finish_time(stream: Any, out: dict[str, float], key: str) -> None:
    while stream.get_sync().finish_reason is None:
        pass
    out[key] = time.perf_counter()


def one_row(loaded: Any, root: Path, prompt: list[int], busy_tokens: int, gb: float, fraction: float
            ) -> dict[str, Any]:
    engine = engine_with_disk(loaded, root, gb, fraction)
    row: dict[str, Any] = {"page_cache": drop_page_cache([root])}
    engine.start()
    try:
        busy = engine.submit(chat_ids(loaded, "Count slowly from one to one hundred."),
                             SamplingParams(max_tokens=busy_tokens, temperature=0.0, ignore_eos=True))
        busy.stream.get_sync()  # it decodes
        times: dict[str, float] = {}
        waiter = threading.Thread(target=finish_time, args=(busy.stream, times, "busy_done"))
        waiter.start()
        t0 = time.perf_counter()
        hit = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        first = hit.stream.get_sync()
        t_first = time.perf_counter()
        while first.finish_reason is None:
            first = hit.stream.get_sync()
        waiter.join()
        row["ttft_s"] = t_first - t0
        row["after_slot_s"] = t_first - times["busy_done"]
        row["busy_rest_s"] = times["busy_done"] - t0
        row["cached"] = first.num_cached_tokens
        snap = observability.snapshot(engine)
        row["prefetched_blocks"] = int(snap["sched_prefetched_blocks"])
        row["ssd_load_hits"] = int(snap["ssd_load_hits"])
    finally:
        engine.shutdown(30)
    return row


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} ms [{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--busy-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    args = ap.parse_args()
    loaded = embedded(args.dtype)
    text = "Summarize the following log. " + " ".join(f"event {i} ok;" for i in range(args.tokens))
    prompt = chat_ids(loaded, text)[: args.tokens]
    root = Path(tempfile.mkdtemp(prefix="kvcellar-bench-prefetch-"))
    try:
        writer = engine_with_disk(loaded, root, args.kv_cache_gb, 0.0)
        writer.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        writer.shutdown(60)
        os.sync()
        one_row(loaded, root, prompt, args.busy_tokens, args.kv_cache_gb, 0.25)  # throw-away: one-off costs
        rows: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for _ in range(args.repeats):
            for mode, fraction in (("on", 0.25), ("off", 0.0)):
                row = one_row(loaded, root, prompt, args.busy_tokens, args.kv_cache_gb, fraction)
                rows[mode].append(row)
                print(f"prefetch {mode:3} " + " ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        for mode, got in rows.items():
            ttft = [r["ttft_s"] for r in got]
            after = [r["after_slot_s"] for r in got]
            busy = [r["busy_rest_s"] for r in got]
            print(f"prefetch {mode}: {len(prompt)} tokens, TTFT {ms(ttft)}, after the slot freed {ms(after)}, "
                  f"busy request's rest {ms(busy)} (medians [min-max])")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
