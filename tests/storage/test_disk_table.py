"""The disk tier's in-memory table: a scan never resurrects a file removed while it ran."""

from __future__ import annotations

from kvcellar.storage.disk.table import BlockTable


def test_scan_does_not_adopt_a_block_removed_after_it_started():
    table = BlockTable()
    table.add(b"a" * 32, 100)
    started = table.now_ns()  # the scan lists the directory from here on...
    table.discard(b"a" * 32)  # ...while a reader deletes the file as corrupt
    adopted, _ = table.merge_scan({b"a" * 32: (100, started)}, started)
    assert adopted == 0 and not table.contains(b"a" * 32)
    # a later scan that really finds it (rewritten since) adopts it again
    later = table.now_ns() + 1
    adopted, _ = table.merge_scan({b"a" * 32: (100, later)}, later)
    assert adopted == 1 and table.contains(b"a" * 32)


def test_rewrite_clears_the_removal_mark():
    table = BlockTable()
    table.discard(b"b" * 32)
    table.add(b"b" * 32, 100)  # written again
    started = table.now_ns()
    table.merge_scan({b"b" * 32: (100, started)}, started)
    assert table.contains(b"b" * 32)
