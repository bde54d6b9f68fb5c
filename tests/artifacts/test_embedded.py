"""The embedded SmolLM2 GGUF through the artifact cache: prepared once, then loaded from the entry.

The first start costs one real preparation (~20 s here), done once for the module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.artifacts import ArtifactCache
from kvcellar.cache.namespace import kv_descriptor, kv_fingerprint
from kvcellar.engine.loader import LoadedModel
from kvcellar.identity import file_sha256
from kvcellar.model_source import find_embedded_gguf
from kvcellar.runtime import prepare_and_load
from tests.artifacts.helpers import greedy


@dataclass
class Starts:
    cache_dir: Path
    first: LoadedModel
    second: LoadedModel


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory) -> Starts:
    cache_dir = tmp_path_factory.mktemp("kvcellar-cache")
    first = prepare_and_load(None, device="cpu", weights="full", artifacts=ArtifactCache.open(cache_dir))
    second = prepare_and_load(None, device="cpu", weights="full", artifacts=ArtifactCache.open(cache_dir))
    return Starts(cache_dir, first, second)


def _fingerprint(m: LoadedModel) -> str:
    return kv_fingerprint(kv_descriptor(weights_id=m.weights_id, tokenizer_id=m.tokenizer_id, dtype=m.dtype,
                                        kv_dtype=m.dtype, block_size=16))


def test_first_start_prepares_an_hf_format_entry(starts: Starts) -> None:
    lease = starts.first.artifact
    assert lease is not None and lease.built and not lease.hit
    entry = lease.path
    assert entry.parent == starts.cache_dir / "models" / "entries"
    names = {p.name for p in entry.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", "manifest.json"} <= names
    config = json.loads((entry / "config.json").read_text())
    assert "quantization_config" not in config  # dense weights, nothing GGUF-specific left
    from safetensors import safe_open

    with safe_open(entry / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"BF16" if starts.first.dtype == torch.bfloat16 else "F32"}
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["descriptor"]["name"] == "SmolLM2-135M-Instruct"
    assert manifest["descriptor"]["modality"] == "text"
    assert manifest["descriptor"]["source"] == starts.first.weights_id


def test_second_start_is_a_hit_and_much_faster(starts: Starts) -> None:
    first, second = starts.first, starts.second
    assert second.artifact.hit and not second.artifact.built
    assert second.artifact.path == first.artifact.path
    assert "build" not in second.artifact.seconds
    prepare_first = first.load_seconds["artifact"]
    prepare_second = second.load_seconds["artifact"]
    assert prepare_second * 5 <= prepare_first, (prepare_first, prepare_second)
    # The GGUF content hash is memoized: the second start did not read the 98 MB again.
    assert first.artifact.cache.stats()["artifact_digest_misses"] == 1
    assert second.artifact.cache.stats()["artifact_digest_hits"] == 1
    assert second.artifact.cache.stats()["artifact_digest_misses"] == 0
    stats = ArtifactCache.open(starts.cache_dir).stats()
    assert stats["artifact_lifetime_builds"] == 1
    assert stats["artifact_lifetime_misses"] == 1
    assert stats["artifact_lifetime_hits"] == 1
    assert stats["artifact_entries"] == 1
    assert all(k.startswith("artifact_") for k in stats)


def test_greedy_outputs_identical(starts: Starts) -> None:
    a = greedy(starts.first, "What is the capital of France?", max_tokens=12)
    b = greedy(starts.second, "What is the capital of France?", max_tokens=12)
    assert a == b
    assert len(a) >= 4


def test_kv_namespace_does_not_depend_on_the_cache_state(starts: Starts) -> None:
    first, second = starts.first, starts.second
    assert first.weights_id == second.weights_id == "gguf-sha256:" + file_sha256(find_embedded_gguf())
    assert first.tokenizer_id == second.tokenizer_id
    # ... and equals the tokenizer read straight from the GGUF (a run without the cache).
    assert first.artifact.manifest.info["source_tokenizer_id"] == first.tokenizer_id
    assert _fingerprint(first) == _fingerprint(second)
    assert second.tokenizer.chat_template and second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.eos_token_ids == first.eos_token_ids


def test_models_verify_passes_on_the_real_entry(starts: Starts, capsys: Any) -> None:
    from kvcellar.cli import main

    assert main(["models", "verify", "--cache-dir", str(starts.cache_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"ok": [starts.first.artifact.key], "corrupt": []}
