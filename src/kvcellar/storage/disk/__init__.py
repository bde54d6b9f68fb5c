"""The persistent SSD tier: per-block files under a namespaced directory.

Public surface: ``DiskTier``, ``DiskConfig``, ``measure_read_bandwidth``;
``maintenance`` and ``cli`` for the ``kvcellar cache`` commands.
"""

from kvcellar.storage.block_format import FORMAT_VERSION
from kvcellar.storage.disk.bandwidth import measure_read_bandwidth
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.tier import DiskTier

__all__ = ["FORMAT_VERSION", "DiskConfig", "DiskTier", "measure_read_bandwidth"]
