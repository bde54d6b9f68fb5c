"""Storage tiers below the RAM block pool, behind one interface (``base.KVTier``).

``disk`` is the persistent SSD tier; ``remote`` the shared tier on Redis/Valkey. Neither is
imported here: callers import the tier they use (``kvcellar.storage.disk``). Both store the
block format of ``block_format.py``; shared helpers: ``faults.py``, ``writer.py``; their
counters are ``kvcellar.stats.SharedStats`` (disk/stats.py, remote/stats.py).
"""

from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest

__all__ = ["BlockSpec", "KVTier", "LoadRequest", "StoreRequest"]
