"""Storage tiers below the RAM block pool, behind one interface (``base.KVTier``).

``disk`` is the persistent SSD tier; a shared remote tier (Redis/Valkey,
Mooncake Store) will be another implementation of the same interface.
"""

from kvcellar.storage.base import BlockSpec, KVTier, LoadRequest, StoreRequest
from kvcellar.storage.disk import DiskTier, DiskTierConfig

__all__ = ["BlockSpec", "DiskTier", "DiskTierConfig", "KVTier", "LoadRequest", "StoreRequest"]
