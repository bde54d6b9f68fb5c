"""The shared remote tier: KV blocks in Redis/Valkey (one server or a Redis Cluster).

Replicas of one model that point at the same store reuse each other's blocks. Values
are the block format of ``storage/block_format.py`` under ``kvc:<namespace>:<key hex>``
(``layout.py``); ``tier.py`` is the ``KVTier``; ``writer.py`` its bounded store queue;
``connection.py`` how a URL becomes a client; ``config.py`` its knobs.
"""

from kvcellar.storage.remote.config import REMOTE_POLICIES, RemoteConfig

__all__ = ["REMOTE_POLICIES", "RemoteConfig"]
