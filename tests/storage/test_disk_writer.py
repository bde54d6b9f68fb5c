"""The writer thread when a write raises something it does not expect (a bug, not an OS
fault): the block is counted as failed, its claim released, and the thread goes on writing."""

from __future__ import annotations

import logging
import threading

import kvcellar.storage.disk.tier as tier_module
from kvcellar.storage import StoreRequest
from kvcellar.storage.disk.admission import WriteAdmission
from kvcellar.storage.disk.namespace import OpenNamespace
from tests.storage.helpers import bits_equal, block, chain, load_request


class BrokenOnce(WriteAdmission):
    """The real admission, except that the first write of block 0 raises."""

    def __init__(self, ns: OpenNamespace) -> None:
        super().__init__(ns)
        self.poisoned = {block(0).key}

    def write(self, r: StoreRequest) -> None:
        if r.key in self.poisoned:
            self.poisoned.discard(r.key)
            raise RuntimeError("bug in a write")
        super().write(r)


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvcellar-disk-writer-") and t.is_alive()]


def test_unexpected_exception_in_a_write_is_counted_and_the_writer_survives(tmp_path, open_tier, monkeypatch,
                                                                             caplog) -> None:
    caplog.set_level(logging.ERROR, logger="kvcellar.storage.disk")
    monkeypatch.setattr(tier_module, "WriteAdmission", BrokenOnce)
    bad = block(0)
    before = {t.ident for t in _writer_threads()}
    tier = open_tier(tmp_path)
    (writer,) = [t for t in _writer_threads() if t.ident not in before]
    tier.store([bad, *chain(3, start=1)])  # the bad one first: the others queue behind it
    assert tier.wait_idle(30)
    s = tier.stats()
    assert s["writer_failed"] == 1 and s["ssd_stored_blocks"] == 3 and s["writer_pending_keys"] == 0
    assert writer.is_alive()
    assert any("writer failed" in r.getMessage() for r in caplog.records)
    assert tier.lookup([bad.key]) == 0

    later = [bad, *chain(2, start=10)]  # its claim was released: the failed block can be stored again
    tier.store(later)
    assert tier.wait_idle(30)
    assert tier.stats()["ssd_stored_blocks"] == 6 and tier.stats()["writer_failed"] == 1
    for b in later:
        assert tier.lookup([b.key]) == 1
        req = load_request(b)
        assert tier.load([req]).result(timeout=30) == 1 and bits_equal(req.dest, b.data)
    assert tier.close(10) is True
