"""The artifact index under processes that open it at once, and under a file another process holds."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path
from typing import Any

from kvcellar.artifacts.index import ArtifactIndex


def _open_and_insert(path: Path, barrier: Any, results: Any, name: str) -> None:
    try:
        barrier.wait(timeout=60)  # a child that never started breaks it: the others report, not wait
        ArtifactIndex(path).insert(name, {"by": name}, 1, 0.0)
        results.put("ok")
    except Exception as exc:  # reported, not raised: the parent asserts on every child
        results.put(f"{name}: {exc!r}")


def test_processes_opening_a_new_index_at_once_all_open_it_and_lose_nothing(tmp_path: Path) -> None:
    # Seen on a 14-worker run: a new file's switch to WAL answered "database is locked" at once,
    # the index was taken for corrupt and deleted under the processes that had just written it.
    # forkserver: children forked from a clean process, not from a test worker whose earlier
    # tests left threads (the kernels' pool, engines) that may hold a lock at the fork
    ctx = mp.get_context("forkserver")
    procs = 12
    for round_ in range(6):
        path = tmp_path / f"r{round_}" / "index.sqlite"
        path.parent.mkdir()
        barrier, results = ctx.Barrier(procs), ctx.Queue()
        children = [ctx.Process(target=_open_and_insert, args=(path, barrier, results, f"p{i}")) for i in range(procs)]
        for child in children:
            child.start()
        outcomes = [results.get(timeout=120) for _ in children]
        for child in children:
            child.join(timeout=60)
        assert outcomes == ["ok"] * procs
        assert sorted(row.key for row in ArtifactIndex(path).entries()) == sorted(f"p{i}" for i in range(procs))


class _HeldElsewhere(ArtifactIndex):
    """An index whose first opens find the file locked by another process."""

    refusals = 2

    def _connect(self) -> sqlite3.Connection:
        if type(self).refusals:
            type(self).refusals -= 1
            raise sqlite3.OperationalError("database is locked")
        return super()._connect()


def test_a_locked_index_is_waited_for_not_recreated(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    ArtifactIndex(path).insert("kept", {}, 7, 1.0)
    index = _HeldElsewhere(path)
    assert _HeldElsewhere.refusals == 0
    assert [(row.key, row.size_bytes) for row in index.entries()] == [("kept", 7)]


def test_a_corrupt_index_is_still_recreated(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    index = ArtifactIndex(path)
    index.insert("new", {}, 1, 0.0)
    assert [row.key for row in index.entries()] == ["new"]
