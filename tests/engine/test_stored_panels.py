"""int4 panels stored by a first start and mapped by the next (``artifacts/panels.py``): a GGUF
written by the test, served through ``runtime.build_engine`` as the server builds its engine.
The second start packs nothing, its panels lie in the entry's file mapping, and it gives the
first start's tokens and logprobs to the bit; a damaged entry is packed and stored again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.artifacts.panels import PANELS_FILE, PanelStore, panels_descriptor
from kvcellar.artifacts.store import ArtifactCache
from kvcellar.engine import native
from kvcellar.engine.linears import _file_mapped
from kvcellar.engine.sampling import SamplingParams
from kvcellar.runtime import build_engine, prepare_and_load
from kvcellar.settings import load_settings
from tests.artifacts.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(not native.available(), reason="kvcellar's kernels are not built here")

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("panels") / "q4.gguf", arch="llama", types="Q4_0", head_scale=1.0)


def start(gguf: Path, cache_dir: Path) -> tuple[Any, Any]:
    """A server's engine (without its tiers' threads started) and the model it serves."""
    settings = load_settings(model=str(gguf), cache_dir=cache_dir,
                             flags={"engine": {"weights": "int4", "kv_cache_gb": 0.05, "warmup": False},
                                    "disk": {"ssd_policy": "off"}})
    cfg = settings.engine
    loaded = prepare_and_load(settings.model, dtype=cfg.dtype, device=cfg.device, weights=cfg.weights,
                              artifacts=ArtifactCache.open(cache_dir))
    return build_engine(settings, loaded), loaded


def panel_linears(engine: Any) -> list[Any]:
    return [m for m in engine.runner.linears.linears if m.panels]


def run(engine: Any, loaded: Any) -> list[tuple[list[int], list[float]]]:
    tok = loaded.tokenizer
    prompts = [tok("hello world, the other hello " * 3 + end).input_ids for end in (" tell", " or the world")]
    return [(r.token_ids, r.logprobs) for r in engine.generate(prompts, PARAMS)]


def test_panels_packed_by_a_first_start_are_mapped_by_the_next(gguf: Path, tmp_path: Path) -> None:
    first, loaded = start(gguf, tmp_path)
    try:
        packed = panel_linears(first)
        assert packed and isinstance(loaded.panels, PanelStore) and loaded.panels.taken == 0
        assert not any(_file_mapped(m._q.data_ptr(), m._q.data_ptr() + m._q.nbytes) for m in packed)
        expected = run(first, loaded)
        entry = loaded.panels.lease
        assert entry is not None and entry.built and entry.manifest.info["linears"] == len(packed)
        assert entry.manifest.info["layout"] == native.panel_layout()
    finally:
        first.shutdown(timeout=0)

    second, loaded = start(gguf, tmp_path)
    try:
        mapped = panel_linears(second)
        assert len(mapped) == len(packed) and loaded.panels.taken == len(mapped)
        for m in mapped:  # every panel tensor in the entry's file mapping, none packed
            for t in (m._q, m._scale) + (() if m._zero is None else (m._zero,)):
                assert _file_mapped(t.data_ptr(), t.data_ptr() + t.nbytes)
        assert loaded.panels.lease is not None and loaded.panels.lease.hit
        assert run(second, loaded) == expected
    finally:
        second.shutdown(timeout=0)

    # a byte of the stored panels changed: the entry fails its check, is packed and stored again
    path = loaded.panels.lease.path / PANELS_FILE
    loaded.panels.lease.release()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.chmod(0o600)
    path.write_bytes(bytes(data))
    third, loaded = start(gguf, tmp_path)
    try:
        assert loaded.panels.taken == 0 and loaded.panels.lease is not None and loaded.panels.lease.built
        assert run(third, loaded) == expected
    finally:
        third.shutdown(timeout=0)


def test_each_panel_layout_is_an_entry_of_its_own(gguf: Path, tmp_path: Path) -> None:
    """AVX-512 CPUs keep pairs of panels interleaved, AVX2 ones do not: machines of both kinds
    sharing a cache dir each map their own."""
    cache = ArtifactCache.open(tmp_path)
    loaded = prepare_and_load(str(gguf), weights="int4", artifacts=cache)
    quantized = loaded.quantized_artifact
    assert quantized is not None
    keys = {panels_descriptor(quantized, layout).key for layout in ("int4-panels-x1", "int4-panels-x2")}
    assert len(keys) == 2 and quantized.key not in keys
    store = PanelStore(cache, quantized, "int4-panels-x1")
    rows = (torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.float16), None)
    store.keep("a", rows)
    store.commit()
    assert PanelStore(cache, quantized, "int4-panels-x1").take("a", rows) is not None
    assert PanelStore(cache, quantized, "int4-panels-x2").take("a", rows) is None
    # stored panels of other shapes than the row layout's are not taken
    assert PanelStore(cache, quantized, "int4-panels-x1").take("a", (rows[0][:, :8], rows[1], None)) is None
