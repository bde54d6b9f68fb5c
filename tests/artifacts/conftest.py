"""Fixtures of the artifact-cache tests: tiny real GGUF files, shared by the session."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcellar  # noqa: F401  (OMP wait policy before anything imports torch)
from tests.artifacts.helpers import write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Five tiny GGUF models (different random weights, same shapes), in one source folder."""
    folder = tmp_path_factory.mktemp("gguf")
    return [write_tiny_gguf(folder / f"tiny-{seed}.gguf", seed) for seed in range(5)]
