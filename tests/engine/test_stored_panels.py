"""int4 panels stored in the artifact cache by a first start and mapped by every start
(``artifacts/panels.py``): a GGUF written by the test, served through ``runtime.build_engine``
as the server builds its engine. Mapped panels give the tokens and logprobs of panels packed in
memory to the bit; a damaged entry is built again."""

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
from tests._models import make_engine
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


def mapped(m: Any) -> bool:
    """Whether every tensor of a linear's panels lies in a file mapping (the entry's)."""
    return all(_file_mapped(t.data_ptr(), t.data_ptr() + t.nbytes)
               for t in (m._q, m._scale) + (() if m._zero is None else (m._zero,)))


def test_panels_stored_by_a_first_start_are_mapped_by_every_start(gguf: Path, tmp_path: Path) -> None:
    """The first start packs the panels into the entry and maps them, as every later one does;
    all give the tokens of panels packed in memory (no artifact cache) to the bit."""
    loaded = prepare_and_load(str(gguf), weights="int4")
    assert loaded.panels is None
    packed = make_engine(loaded)
    in_memory = panel_linears(packed)
    assert in_memory and not any(mapped(m) for m in in_memory)
    expected = run(packed, loaded)

    first, loaded = start(gguf, tmp_path)
    try:
        assert isinstance(loaded.panels, PanelStore) and loaded.panels.lease is not None
        entry = loaded.panels.lease
        assert entry.built and entry.manifest.info["linears"] == len(in_memory)
        assert entry.manifest.info["layout"] == native.panel_layout()
        stored = panel_linears(first)
        assert len(stored) == len(in_memory) == loaded.panels.taken and all(mapped(m) for m in stored)
        assert run(first, loaded) == expected
    finally:
        first.shutdown(timeout=0)

    second, loaded = start(gguf, tmp_path)
    try:
        assert loaded.panels.lease is not None and loaded.panels.lease.hit
        assert loaded.panels.taken == len(in_memory) and all(mapped(m) for m in panel_linears(second))
        assert run(second, loaded) == expected
    finally:
        second.shutdown(timeout=0)

    # a byte of the stored panels changed: the entry fails its check and is built again
    path = loaded.panels.lease.path / PANELS_FILE
    loaded.panels.lease.release()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.chmod(0o600)
    path.write_bytes(bytes(data))
    third, loaded = start(gguf, tmp_path)
    try:
        assert loaded.panels.lease is not None and loaded.panels.lease.built
        assert run(third, loaded) == expected
    finally:
        third.shutdown(timeout=0)


def test_stored_panels_are_kept_whatever_their_size(gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    """Panels packed in memory are anonymous memory, so a model whose panels would take more
    than half the machine's keeps the row layout (``native.panels_fit``); stored panels are the
    artifact cache's mapped pages, as the row layout is, so they are taken at any size."""
    monkeypatch.setattr(native, "panels_fit", lambda nbytes: False)
    rows = prepare_and_load(str(gguf), weights="int4")
    assert not panel_linears(make_engine(rows))
    cache = ArtifactCache.open(tmp_path)
    loaded = prepare_and_load(str(gguf), weights="int4", artifacts=cache)
    engine = make_engine(loaded)
    assert panel_linears(engine) and all(mapped(m) for m in panel_linears(engine))


def test_each_panel_layout_is_an_entry_of_its_own(gguf: Path, tmp_path: Path) -> None:
    """AVX-512 CPUs keep pairs of panels interleaved, AVX2 ones do not: machines of both kinds
    sharing a cache dir each map their own (two layouts of this test's own naming, beside the
    entry of this machine's layout that loading the model built)."""
    cache = ArtifactCache.open(tmp_path)
    loaded = prepare_and_load(str(gguf), weights="int4", artifacts=cache)
    quantized = loaded.quantized_artifact
    assert quantized is not None
    layouts = ("test-layout-a", "test-layout-b")
    keys = {panels_descriptor(quantized, layout).key for layout in (*layouts, native.panel_layout())}
    assert len(keys) == 3 and quantized.key not in keys
    rows = (torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.float16), None)
    one = PanelStore(cache, quantized, layouts[0])
    assert one.prepare(lambda: iter([("a", rows)])) and one.lease is not None and one.lease.built
    assert one.take("a", rows) is not None
    # stored panels of other shapes than the row layout's are not taken
    assert one.take("a", (rows[0][:, :8], rows[1], None)) is None
    other = PanelStore(cache, quantized, layouts[1])
    assert other.prepare(lambda: iter([])) and other.lease is not None and other.lease.built
    assert other.take("a", rows) is None
    again = PanelStore(cache, quantized, layouts[0])
    assert again.prepare(lambda: iter([])) and again.lease is not None and again.lease.hit
    assert again.take("a", rows) is not None
