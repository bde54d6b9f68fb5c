"""Storage tiers below the RAM block pool, behind one interface (``base.KVTier``).

``disk`` is the persistent SSD tier; ``remote`` the shared tier on Redis/Valkey
(imported on demand: it needs the ``redis`` client). Both store the block format of
``block_format.py``; shared helpers: ``counters.py``, ``faults.py``.
"""

from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest
from kvcellar.storage.disk import DiskTier, DiskTierConfig

__all__ = ["BlockSpec", "DiskTier", "DiskTierConfig", "KVTier", "LoadRequest", "StoreRequest"]
