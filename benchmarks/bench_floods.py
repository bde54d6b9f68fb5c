"""Floods of what any client may send, at full scale, against a real server on 127.0.0.1:
2,000 stored responses with the largest metadata, 10,000 tool types the server ignores, 1,000
distinct schemas compiled into grammars, 500 token counts of 200 KB at once. Prints, per
flood, its wall time, the answers by status and the server's peak RSS (``VmHWM``) after it,
then how long a plain chat request takes while nothing else runs.

    .venv/bin/python benchmarks/bench_floods.py [--model NAME_OR_PATH] [--scale 1.0]

The server runs with ``--max-body-mb-in-flight 8 --max-stored-responses-mb 8`` (the bounds
tests/server/test_floods.py asserts at smaller counts) and ``--serve-any-model``; the
default model is the embedded one. ``--scale`` multiplies every count.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.floods import FULL, distinct_schemas, peak_rss, send_all, stored_responses, token_counts, unknown_tools

from kvcellar.bench.launch import ServerLauncher, serve_command

FLAGS = ["--max-body-mb-in-flight", "8", "--max-stored-responses-mb", "8", "--max-inflight-requests", "600",
         "--serve-any-model"]


def chat_seconds(url: str, model: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=300,
                   json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded one)")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    counts = {k: max(2, round(v * args.scale)) for k, v in FULL.items()}
    floods = [("stored responses", stored_responses, counts["stored"], 8),
              (f"{counts['tools'] * 100} unknown tool types", unknown_tools, counts["tools"], 8),
              ("distinct schemas", distinct_schemas, counts["schemas"], 8),
              ("token counts at once", token_counts, counts["counts"], counts["counts"])]
    with tempfile.TemporaryDirectory(prefix="kvcellar-floods-") as tmp:
        flags = FLAGS + (["--model", args.model] if args.model else [])
        server = ServerLauncher(lambda port: serve_command(port, Path(tmp) / "cache", flags), Path(tmp) / "server.log")
        server.start(timeout=600)
        try:
            assert server.proc is not None
            pid, model = server.proc.pid, "flood"
            rows = [{"flood": "before", "requests": 0, "seconds": 0.0, "statuses": {}, "peak_rss_mib":
                     round(peak_rss(pid) / 2**20), "chat_s": round(chat_seconds(server.url, model), 3)}]
            for name, build, n, concurrency in floods:
                bodies = build(model, n)
                t0 = time.perf_counter()
                got = send_all(server.url, bodies, concurrency)
                rows.append({"flood": name, "requests": len(bodies), "seconds": round(time.perf_counter() - t0, 1),
                             "statuses": dict(collections.Counter(r.status_code for r in got)),
                             "peak_rss_mib": round(peak_rss(pid) / 2**20),
                             "chat_s": round(chat_seconds(server.url, model), 3)})
            health = httpx.get(server.url + "/health", timeout=30).json()
        finally:
            server.stop()
    print(f"{'flood':<30} {'requests':>8} {'seconds':>8} {'peak RSS MiB':>12} {'chat s':>7}  statuses")
    for r in rows:
        print(f"{r['flood']:<30} {r['requests']:>8} {r['seconds']:>8} {r['peak_rss_mib']:>12} {r['chat_s']:>7}  "
              f"{r['statuses']}")
    errors = health.get("server", {}).get("server_internal_errors")
    print(f"peak RSS grew {rows[-1]['peak_rss_mib'] - rows[0]['peak_rss_mib']} MiB; server internal errors: {errors}")
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "rows": rows, "server_internal_errors": errors}, indent=1))


if __name__ == "__main__":
    main()
