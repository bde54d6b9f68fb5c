"""The first request after a server start against the same request on a warmed server.

    python benchmarks/bench_first_request.py [--dtype float32] [--repeats 2] [--disk-hit]

Each row starts fresh ``kvcellar serve`` processes (the embedded model, prepared models
shared through KVCELLAR_TEST_MODELS_DIR) with and without ``--no-warmup`` and reports the
time of a max_tokens=1 chat request:

* short prompt: the first request of the server against the median of three more of the
  same shape (each with a system message of its own, so none reuses another's blocks);
* ``--disk-hit``: a 4.8k-token prompt is written to the SSD tier by one server, ``sync``ed,
  and requested again as the first request of a restarted server, against the same request
  on a restarted server that served one short request first.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests._models import shared_models_dir
from tests.helpers import ServerProcess

LONG = "Summarize the following log. " + " ".join(f"event {i} ok;" for i in range(700))


def request_s(server: ServerProcess, content: str, system: str | None = None) -> tuple[float, int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    t0 = time.perf_counter()
    r = server.post("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "temperature": 0,
                                             "messages": msgs})
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed, int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def one_row(args: list[str], disk_hit: bool, models: Path, warm: bool) -> dict[str, Any]:
    cache = Path(tempfile.mkdtemp(prefix="kvcellar-first-request-"))
    row: dict[str, Any] = {}
    try:
        if disk_hit:
            s = ServerProcess(cache, *args, models_dir=models).start()
            request_s(s, LONG)
            s.wait_idle()
            s.stop()
            os.sync()  # the blocks are on disk, not in writeback while we measure
        t0 = time.perf_counter()
        s = ServerProcess(cache, *args, models_dir=models, warmup=warm).start()
        row["ready_s"] = time.perf_counter() - t0
        m = re.search(r"warmed up in ([0-9.]+) s", s.log_tail())
        row["warmup_s"] = float(m.group(1)) if m else 0.0
        if disk_hit:
            row["first_s"], row["cached"] = request_s(s, LONG)
            s.stop()
            s = ServerProcess(cache, *args, models_dir=models, warmup=warm).start()
            request_s(s, "Hello there, how are you?", system="Another session.")
            row["warmed_s"], _ = request_s(s, LONG)
        else:
            row["first_s"], row["cached"] = request_s(s, "Say hi in five words.", system="Session one.")
            row["warmed_s"] = statistics.median(
                request_s(s, "Say hi in five words.", system=f"Session {w}.")[0] for w in ("two", "three", "four"))
        s.stop()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    row["first_over_warmed"] = row["first_s"] / row["warmed_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--disk-hit", action="store_true")
    args = ap.parse_args()
    models = shared_models_dir()
    for _ in range(args.repeats):
        for warm in (True, False):
            # (tests.helpers.ServerProcess adds --no-warmup unless asked to warm up)
            row = one_row(["--dtype", args.dtype, "--kv-cache-gb", "0.25"], args.disk_hit, models, warm)
            print(f"{'disk hit' if args.disk_hit else 'short'} warm-up {'on ' if warm else 'off'} "
                  + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)


if __name__ == "__main__":
    main()
