"""Disk-tier micro-benchmark: the measurements behind the storage layout.

Usage:
    python benchmarks/bench_disk_io.py [--dir DIR] [--quick] [--only SECTION ...]

Sections (each prints a small table):
  checksum   payload checksum throughput (crc32, adler32, blake2b, sha256)
  floor      sequential O_DIRECT read bandwidth (the physical floor)
  layout     per-block files vs one segment file, cold and warm reads
  lookup     stat() per key; directory scan of 100k files, shard depth 1 vs 2
  index      SQLite (WAL) index of 100k blocks: open, load, point lookups
  writer     atomic block writes: best_effort vs persistent (fsync file + dir)
  tier       DiskTier end to end: store() latency under overload per
             back-pressure budget, and a 4096-token cold load vs the floor
  startup    DiskTier open time and background scan time over 100k blocks

Cold reads drop the page cache with `echo 3 > /proc/sys/vm/drop_caches` when
allowed, else posix_fadvise(DONTNEED) on every file read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import mmap
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from kvcellar.storage.base import BlockSpec, LoadRequest, StoreRequest
from kvcellar.storage.disk.bandwidth import measure_read_bandwidth_detailed

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# Default model (SmolLM2-135M): 30 layers x (K,V) x 3 kv heads x 64 dims x bf16.
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2


def fmt_bw(bps: float) -> str:
    return f"{bps / 1e9:7.2f} GB/s"


def table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    print(f"\n## {title}")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def drop_caches(paths: list[Path], level: str = "3") -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(level + "\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def timeit(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# --------------------------------------------------------------------------- checksum
def bench_checksum(args: argparse.Namespace) -> None:
    sizes = [("block bs16 (368 KiB)", 16 * BYTES_PER_TOKEN), ("4096-token prompt", 4096 * BYTES_PER_TOKEN)]
    algos: dict[str, Callable[[memoryview], object]] = {
        "zlib.crc32": zlib.crc32,
        "zlib.adler32": zlib.adler32,
        "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
    }
    rows = []
    for label, n in sizes:
        buf = memoryview(os.urandom(n))
        for name, fn in algos.items():
            reps = 20 if n < 4 * MIB else 3
            dt = timeit(lambda fn=fn, buf=buf, reps=reps: [fn(buf) for _ in range(reps)], repeat=3) / reps
            rows.append((label, name, fmt_bw(n / dt), f"{dt * 1e3:8.2f} ms"))
    # crc32 releases the GIL for large buffers: two threads over 16-block chunks.
    n = 4096 * BYTES_PER_TOKEN
    buf = memoryview(os.urandom(n))
    step = 16 * BYTES_PER_TOKEN
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        def par() -> None:
            list(ex.map(lambda o: zlib.crc32(buf[o:o + step]), range(0, n, step)))
        dt = timeit(par)
    rows.append(("4096-token prompt", "zlib.crc32 x2 threads", fmt_bw(n / dt), f"{dt * 1e3:8.2f} ms"))
    table("payload checksum throughput", rows, ("payload", "algorithm", "throughput", "time"))


# --------------------------------------------------------------------------- floor
def bench_floor(args: argparse.Namespace) -> float:
    nbytes = (128 if args.quick else 512) * MIB
    bw = measure_read_bandwidth_detailed(args.dir, nbytes)
    table("sequential read floor", [(bw.method, f"{bw.nbytes / MIB:.0f} MiB", fmt_bw(bw.bytes_per_s))],
          ("method", "size", "bandwidth"))
    return bw.bytes_per_s


# --------------------------------------------------------------------------- layout
def _write_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read_files(paths: list[Path], buf: memoryview, threads: int, direct: bool = False) -> int:
    n = len(buf) // len(paths)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def one(i: int) -> int:
        fd = os.open(paths[i], flags)
        try:
            return os.preadv(fd, [buf[i * n:(i + 1) * n]], 0)
        finally:
            os.close(fd)

    if threads == 1:
        return sum(one(i) for i in range(len(paths)))
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, range(len(paths))))


def _read_segment(path: Path, buf: memoryview, block: int, direct: bool = False) -> int:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        return sum(os.preadv(fd, [buf[o:o + block]], o) for o in range(0, len(buf), block))
    finally:
        os.close(fd)


def bench_layout(args: argparse.Namespace, floor: float | None) -> None:
    tokens = 1024 if args.quick else 4096
    total = tokens * BYTES_PER_TOKEN
    base = Path(tempfile.mkdtemp(prefix="layout-", dir=args.dir))
    rows = []
    try:
        data = memoryview(os.urandom(total))
        arena = mmap.mmap(-1, total)  # page-aligned destination, as a RAM block pool would be
        dest = memoryview(arena)
        for bs in (16, 64):
            block = bs * BYTES_PER_TOKEN
            nblocks = total // block
            d = base / f"bs{bs}"
            d.mkdir()
            files = [d / f"{i:04x}.kvb" for i in range(nblocks)]
            t0 = time.perf_counter()
            for i, p in enumerate(files):
                _write_file(p, data[i * block:(i + 1) * block])
            os.sync()
            w_files = time.perf_counter() - t0
            seg = d / "segment.bin"
            t0 = time.perf_counter()
            _write_file(seg, data)
            os.sync()
            w_seg = time.perf_counter() - t0
            cases: list[tuple[str, Callable[[], int], list[Path]]] = [
                ("files, 1 thread", lambda f=files: _read_files(f, dest, 1), files),
                ("files, 2 threads", lambda f=files: _read_files(f, dest, 2), files),
                ("files, 4 threads", lambda f=files: _read_files(f, dest, 4), files),
                ("files, 4 threads, O_DIRECT", lambda f=files: _read_files(f, dest, 4, True), files),
                ("segment, 1 thread", lambda s=seg, b=block: _read_segment(s, dest, b), [seg]),
                ("segment, 1 thread, O_DIRECT", lambda s=seg, b=block: _read_segment(s, dest, b, True), [seg]),
            ]
            for name, fn, paths in cases:
                colds = []
                for _ in range(1 if args.quick else 3):
                    how = drop_caches(paths)
                    t0 = time.perf_counter()
                    got = fn()
                    colds.append(time.perf_counter() - t0)
                    assert got == total, (got, total)
                cold = statistics.median(colds)
                fn()
                warm = timeit(fn)
                ratio = f"{(total / floor) / cold:.2f}" if floor else "-"
                rows.append((f"bs{bs} ({block // KIB} KiB) x{nblocks}", name,
                             fmt_bw(total / cold), ratio, fmt_bw(total / warm), how))
            rows.append((f"bs{bs}", "write (files vs segment, incl. sync)",
                         f"{w_files * 1e3:.0f} ms vs {w_seg * 1e3:.0f} ms", "", "", ""))
        dest.release()
        arena.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    table(f"per-block files vs one segment ({tokens} tokens, {total / MIB:.0f} MiB)", rows,
          ("blocks", "read", "cold", "floor/cold", "warm", "cache drop"))


# --------------------------------------------------------------------------- lookup
def _make_tree(root: Path, n: int, depth: int, size: int) -> list[Path]:
    paths = []
    made: set[Path] = set()
    for i in range(n):
        h = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).hexdigest()
        d = root / h[:2] if depth == 1 else root / h[:2] / h[2:4]
        if d not in made:
            d.mkdir(parents=True, exist_ok=True)
            made.add(d)
        p = d / f"{h}.kvb"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)  # sparse: the scan only needs the size
        os.close(fd)
        paths.append(p)
    return paths


def _scan(root: Path) -> tuple[int, int]:
    count = total = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                else:
                    st = e.stat(follow_symlinks=False)
                    count += 1
                    total += st.st_size
    return count, total


def bench_lookup(args: argparse.Namespace) -> None:
    n = 20_000 if args.quick else 100_000
    rows = []
    for depth in (1, 2):
        root = Path(tempfile.mkdtemp(prefix=f"scan{depth}-", dir=args.dir))
        try:
            t0 = time.perf_counter()
            paths = _make_tree(root, n, depth, 16 * BYTES_PER_TOKEN + 4096)
            t_make = time.perf_counter() - t0
            probe = paths[:256]
            warm_stat = timeit(lambda p=probe: [os.stat(x) for x in p]) / len(probe)
            miss = [x.with_name("0" * 64 + ".kvb") for x in probe]
            miss_stat = timeit(lambda m=miss: [os.path.exists(x) for x in m]) / len(miss)
            how = drop_caches([])
            t0 = time.perf_counter()
            for x in probe:
                os.stat(x)
            cold_stat = (time.perf_counter() - t0) / len(probe)
            drop_caches([])
            t0 = time.perf_counter()
            cnt, _ = _scan(root)
            cold_scan = time.perf_counter() - t0
            warm_scan = timeit(lambda r=root: _scan(r), repeat=2)
            assert cnt == n
            rows.append((f"depth {depth}", f"{n}", f"{t_make:.1f} s", f"{warm_stat * 1e6:.1f} us",
                         f"{miss_stat * 1e6:.1f} us", f"{cold_stat * 1e6:.0f} us ({how})",
                         f"{cold_scan:.2f} s", f"{warm_scan:.2f} s"))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    table("stateless lookup and start-up scan", rows,
          ("sharding", "files", "create", "stat hit", "stat miss", "stat cold", "scan cold", "scan warm"))


# --------------------------------------------------------------------------- index
def bench_index(args: argparse.Namespace) -> None:
    n = 20_000 if args.quick else 100_000
    d = Path(tempfile.mkdtemp(prefix="sqlite-", dir=args.dir))
    rows = []
    try:
        db = d / "index.sqlite"
        con = sqlite3.connect(db)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("CREATE TABLE blocks (key BLOB PRIMARY KEY, size INTEGER, last_access INTEGER)"
                    " WITHOUT ROWID")
        keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest() for i in range(n)]
        t0 = time.perf_counter()
        with con:
            con.executemany("INSERT INTO blocks VALUES (?, ?, ?)", ((k, 380_000, i) for i, k in enumerate(keys)))
        t_insert = time.perf_counter() - t0
        t0 = time.perf_counter()
        with con:
            con.executemany("UPDATE blocks SET last_access=? WHERE key=?", ((i, k) for i, k in enumerate(keys[:256])))
        t_touch = time.perf_counter() - t0
        con.close()
        drop_caches([db])
        t0 = time.perf_counter()
        con = sqlite3.connect(db)
        loaded = {k: (s, a) for k, s, a in con.execute("SELECT key, size, last_access FROM blocks")}
        t_load = time.perf_counter() - t0
        assert len(loaded) == n
        probe = keys[:256]
        t_point = timeit(lambda: [con.execute("SELECT 1 FROM blocks WHERE key=?", (k,)).fetchone()
                                  for k in probe]) / len(probe)
        con.close()
        rows.append((str(n), f"{t_insert:.2f} s", f"{t_touch * 1e3:.1f} ms", f"{t_load:.3f} s",
                     f"{t_point * 1e6:.1f} us", f"{db.stat().st_size / MIB:.1f} MiB"))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    table("SQLite WAL index (for comparison with the stateless layout)", rows,
          ("rows", "insert (1 txn)", "touch 256", "cold open+load all", "point lookup", "db size"))


# --------------------------------------------------------------------------- writer
def bench_writer(args: argparse.Namespace) -> None:
    from kvcellar.storage.disk.config import DiskConfig
    from kvcellar.storage.disk.tier import DiskTier

    spec = BlockSpec(torch.bfloat16, (30, 2, 16, 3, 64), 16)
    nblocks = 64 if args.quick else 256
    rows = []
    for durability in ("best_effort", "persistent"):
        root = Path(tempfile.mkdtemp(prefix="writer-", dir=args.dir))
        try:
            tier = DiskTier(root, "bench", spec, DiskConfig(durability=durability, async_writes=False))
            reqs = _requests(spec, nblocks, seed=1)
            t0 = time.perf_counter()
            tier.store(reqs)
            dt = time.perf_counter() - t0
            tier.close(30)
            rows.append((durability, str(nblocks), f"{dt / nblocks * 1e3:.2f} ms",
                         fmt_bw(nblocks * spec.nbytes / dt)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    table("atomic block writes (bs16, 368 KiB, synchronous mode)", rows,
          ("durability", "blocks", "per block", "throughput"))


def _requests(spec: BlockSpec, n: int, seed: int) -> list[StoreRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        key = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest()
        data = torch.randn(spec.shape, generator=g, dtype=torch.float32).to(spec.dtype)
        out.append(StoreRequest(key, key, tuple(range(i, i + spec.block_size)), data))
    return out


# --------------------------------------------------------------------------- tier
def bench_tier(args: argparse.Namespace, floor: float | None) -> None:
    from kvcellar.storage.disk.config import DiskConfig
    from kvcellar.storage.disk.tier import DiskTier

    spec = BlockSpec(torch.bfloat16, (30, 2, 16, 3, 64), 16)
    # Back-pressure. "sustained": 32 blocks (one 512-token prefill chunk) every 2 ms, far more
    # than any disk here absorbs, so the queue is always full. "burst": 128 blocks at once every
    # 300 ms, which the writer can absorb on average but which overflows a 64-block queue.
    rows = []
    scenarios = [("sustained", 32, 0.002, 40 if args.quick else 100),
                 ("burst", 128, 0.300, 4 if args.quick else 8)]
    for scenario, per_call, period, calls in scenarios:
        for budget in (0.0, 0.002, 0.010):
            root = Path(tempfile.mkdtemp(prefix="bp-", dir=args.dir))
            try:
                cfg = DiskConfig(queue_blocks=64, enqueue_timeout_s=budget)
                tier = DiskTier(root, "bench", spec, cfg)
                proto = _requests(spec, per_call, seed=2)
                lat = []
                offered = 0
                for step in range(calls):
                    batch = [StoreRequest(hashlib.blake2b(f"{step}:{i}".encode(), digest_size=32).digest(),
                                          r.digest, r.token_ids, r.data) for i, r in enumerate(proto)]
                    t0 = time.perf_counter()
                    tier.store(batch)
                    lat.append(time.perf_counter() - t0)
                    offered += len(batch)
                    time.sleep(period)
                tier.close(120)
                st = tier.stats()
                lat.sort()
                rows.append((scenario, f"{budget * 1e3:.0f} ms", f"{statistics.median(lat) * 1e3:.2f} ms",
                             f"{lat[max(0, int(len(lat) * 0.99) - 1)] * 1e3:.2f} ms", f"{lat[-1] * 1e3:.2f} ms",
                             f"{st['ssd_stored_blocks'] / offered:.0%}"))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    table("store() back-pressure (queue 64 blocks of 368 KiB): wait budget per call, then drop", rows,
          ("load", "wait budget", "p50 store()", "p99 store()", "max store()", "written"))

    # A 4096-token prompt stored, page cache dropped, loaded through the tier.
    tokens = 1024 if args.quick else 4096
    n = tokens // spec.block_size
    root = Path(tempfile.mkdtemp(prefix="load-", dir=args.dir))
    rows = []
    try:
        reqs = _requests(spec, n, seed=3)
        tier = DiskTier(root, "bench", spec, DiskConfig(async_writes=False))
        tier.store(reqs)
        tier.close(60)
        pool = torch.empty((n, *spec.shape), dtype=spec.dtype)
        for io_threads in (1, 2, 4, 8):
            tier = DiskTier(root, "bench", spec, DiskConfig(io_threads=io_threads))
            files = [p for p in root.rglob("*.kvb")]
            colds = []
            for _ in range(1 if args.quick else 3):
                how = drop_caches(files)
                t0 = time.perf_counter()
                got = tier.load([LoadRequest(r.key, r.digest, r.token_ids, pool[i])
                                 for i, r in enumerate(reqs)]).result()
                colds.append(time.perf_counter() - t0)
                assert got == n, got
            t0 = time.perf_counter()
            tier.load([LoadRequest(r.key, r.digest, r.token_ids, pool[i]) for i, r in enumerate(reqs)]).result()
            warm = time.perf_counter() - t0
            tier.close(10)
            cold = statistics.median(colds)
            total = n * spec.nbytes
            floor_s = total / floor if floor else float("nan")
            rows.append((str(io_threads), f"{cold * 1e3:.1f} ms", fmt_bw(total / cold),
                         f"{floor_s * 1e3:.1f} ms", f"{cold / floor_s:.2f}x", f"{warm * 1e3:.1f} ms", how))
        assert torch.equal(pool[-1], reqs[-1].data)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table(f"DiskTier.load of a {tokens}-token prompt ({n} blocks, {n * spec.nbytes / MIB:.0f} MiB)", rows,
          ("io_threads", "cold", "cold bw", "floor", "cold/floor", "warm", "cache drop"))


# --------------------------------------------------------------------------- startup
def bench_startup(args: argparse.Namespace) -> None:
    from kvcellar.storage.block_format import file_size_for
    from kvcellar.storage.disk.config import DiskConfig
    from kvcellar.storage.disk.layout import NamespaceLayout
    from kvcellar.storage.disk.tier import DiskTier

    spec = BlockSpec(torch.bfloat16, (30, 2, 16, 3, 64), 16)
    n = 20_000 if args.quick else 100_000
    root = Path(tempfile.mkdtemp(prefix="startup-", dir=args.dir))
    rows = []
    try:
        lay = NamespaceLayout(root, "bench")
        size = file_size_for(spec)
        made: set[Path] = set()
        for i in range(n):  # sparse files of the right size: the scan stats, it does not read
            p = lay.block_path(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest())
            if p.parent not in made:
                p.parent.mkdir(parents=True, exist_ok=True)
                made.add(p.parent)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        cfg = DiskConfig(capacity_bytes=1 << 50, min_free_bytes=0)
        for label in ("cold", "warm"):
            if label == "cold":
                drop_caches([])
            t0 = time.perf_counter()
            tier = DiskTier(root, "bench", spec, cfg)
            t_open = time.perf_counter() - t0
            key0 = hashlib.blake2b((0).to_bytes(8, "little"), digest_size=32).digest()
            t1 = time.perf_counter()
            hit = tier.lookup([key0])
            t_lookup = time.perf_counter() - t1
            assert tier.wait_scanned(600)
            t_scan = time.perf_counter() - t0
            blocks = tier.stats()["ssd_blocks"]
            tier.close(30)
            rows.append((label, str(n), f"{t_open * 1e3:.1f} ms", f"{t_lookup * 1e6:.0f} us (hit={hit})",
                         f"{t_scan:.2f} s", str(blocks)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table("DiskTier start-up: lookups work at once, the reconciliation scan runs behind", rows,
          ("cache", "blocks", "constructor", "first lookup", "scan done after", "blocks adopted"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the filesystem to measure")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, one repetition")
    ap.add_argument("--only", nargs="*", default=None,
                    choices=["checksum", "floor", "layout", "lookup", "index", "writer", "tier", "startup"])
    args = ap.parse_args()
    only = set(args.only or ["checksum", "floor", "layout", "lookup", "index", "writer", "tier", "startup"])
    fs = _fs_of(args.dir)
    print(f"# bench_disk_io: dir={args.dir} fs={fs} cpus={os.cpu_count()} torch={torch.__version__}"
          f" threads_alive={threading.active_count()}")
    floor = None
    if "checksum" in only:
        bench_checksum(args)
    if only & {"floor", "layout", "tier"}:
        floor = bench_floor(args)
    if "layout" in only:
        bench_layout(args, floor)
    if "lookup" in only:
        bench_lookup(args)
    if "index" in only:
        bench_index(args)
    if "writer" in only:
        bench_writer(args)
    if "tier" in only:
        bench_tier(args, floor)
    if "startup" in only:
        bench_startup(args)


def _fs_of(path: str) -> str:
    best = ("", "?", "?")
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                    best = (mnt, typ, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[2]} ({best[0]})"


if __name__ == "__main__":
    main()
