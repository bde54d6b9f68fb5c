"""The model artifact cache: prepared models, content-addressed under ``<cache_dir>/models``.

``store`` holds the cache (``ArtifactCache``; the directory, descriptors and leases,
acquiring and housekeeping sit beside it), ``prepare`` the builders that turn a source into
an entry (GGUF -> safetensors), ``config`` its ``[artifacts]`` settings, ``cli`` the
``kvcellar models`` commands. ``runtime.prepare_and_load`` is the only caller that prepares.
"""

from kvcellar.artifacts.config import ArtifactConfig
from kvcellar.artifacts.descriptor import ARTIFACT_FORMAT_VERSION, ArtifactDescriptor, ArtifactLease
from kvcellar.artifacts.directory import ArtifactStoreError
from kvcellar.artifacts.store import ArtifactCache

__all__ = [
    "ARTIFACT_FORMAT_VERSION",
    "ArtifactCache",
    "ArtifactConfig",
    "ArtifactDescriptor",
    "ArtifactLease",
    "ArtifactStoreError",
]
