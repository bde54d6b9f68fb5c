"""The model artifact cache (SPEC §6): prepared models, content-addressed under ``<cache_dir>/models``.

``store`` holds the cache (``ArtifactCache``; the directory, descriptors and leases,
acquiring and housekeeping sit beside it), ``prepare`` the builders that turn a source into
an entry (GGUF -> safetensors), ``cli`` the ``kvcellar models`` commands. The loader
(``kvcellar.engine.loader.load_model``) is the only caller that prepares; importing this
package does not import torch.
"""

from kvcellar.artifacts.config import ArtifactConfig, load_artifact_config
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
    "load_artifact_config",
]
