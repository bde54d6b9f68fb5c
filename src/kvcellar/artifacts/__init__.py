"""The model artifact cache (SPEC §6): prepared models, content-addressed under ``<cache_dir>/models``.

``store`` holds the cache (entries, index, locks, validation, eviction), ``prepare`` the
builders that turn a source into an entry (GGUF -> safetensors), ``config`` its
``[artifacts]`` settings, ``cli`` the ``kvcellar models`` commands. ``runtime.prepare_and_load``
is the only caller that prepares; importing this package does not import torch.
"""

from kvcellar.artifacts.config import ArtifactConfig
from kvcellar.artifacts.store import (
    ARTIFACT_FORMAT_VERSION,
    ArtifactCache,
    ArtifactDescriptor,
    ArtifactLease,
    ArtifactStoreError,
)

__all__ = [
    "ARTIFACT_FORMAT_VERSION",
    "ArtifactCache",
    "ArtifactConfig",
    "ArtifactDescriptor",
    "ArtifactLease",
    "ArtifactStoreError",
]
