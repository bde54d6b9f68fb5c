"""A dropped write-through block gets a second chance: ``wants`` says which keys a store
would write now (not on disk, not queued), and a later write of a dropped key is counted."""

from __future__ import annotations

from tests.storage.helpers import chain, files


def test_wants_names_dropped_blocks_until_they_are_written(tmp_path, open_tier) -> None:
    tier = open_tier(tmp_path, queue_blocks=1, enqueue_timeout_s=0.0)
    assert tier.wait_scanned(30)
    blocks = chain(12)
    assert all(tier.wants(b.key) for b in blocks)
    tier.store(blocks)  # one call: the one-block queue takes the first, drops most of the rest
    dropped = tier.stats()["writer_dropped_queue_full"]
    assert dropped > 0
    assert tier.wait_idle(30)
    wanted = [b for b in blocks if tier.wants(b.key)]
    assert len(wanted) == dropped and not tier.wants(blocks[0].key)
    for b in wanted:  # offered again one at a time, as RAM eviction does
        tier.store([b])
        assert not tier.wants(b.key)  # queued or written: no second copy is asked for
        assert tier.wait_idle(30)
    s = tier.stats()
    assert s["writer_written_after_drop"] == dropped and s["ssd_stored_blocks"] == len(blocks)
    assert len(files(tmp_path, ".kvb")) == len(blocks)
    assert not any(tier.wants(b.key) for b in blocks)
    tier.close(10)
    assert not tier.wants(chain(1, start=100)[0].key)  # a closed tier asks for nothing
