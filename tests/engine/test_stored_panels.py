"""int4 linears stored in the quantized entry as this CPU's panels, packed as the GGUF is
prepared and mapped by every start (``artifacts/panels.py``): a GGUF written by the test,
served through ``runtime.build_engine`` as the server builds its engine. Mapped panels give the
tokens and logprobs of panels packed in memory to the bit, the entry holds no row layout of
them beside, and a damaged entry is built again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.artifacts.panels import INDEX_FILE, PANELS_FILE, PanelLayout
from kvcellar.artifacts.prepare import prepare_quantized_gguf, quantized_descriptor, read_quantized
from kvcellar.artifacts.store import ArtifactCache
from kvcellar.engine import native
from kvcellar.engine.linears import _file_mapped, panel_form, panel_layout, row_layout
from kvcellar.engine.sampling import SamplingParams
from kvcellar.identity import file_sha256, weights_identity
from kvcellar.model_source import resolve_source
from kvcellar.runtime import build_engine, prepare_and_load
from kvcellar.settings import load_settings
from tests._models import make_engine
from tests.artifacts.gguf_files import write_gguf
from tests.engine.test_gguf_served import entry_names

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
    """The first start packs the panels into the quantized entry as it prepares it, and maps
    them, as every later one does; all give the tokens of panels packed in memory (no artifact
    cache) to the bit. The entry holds them once: not in the row layout too."""
    loaded = prepare_and_load(str(gguf), weights="int4")
    assert loaded.quantized_artifact is None and not any(q.panels for q in loaded.quantized.values())
    packed = make_engine(loaded)
    in_memory = panel_linears(packed)
    assert in_memory and not any(mapped(m) for m in in_memory)
    expected = run(packed, loaded)

    first, loaded = start(gguf, tmp_path)
    try:
        entry = loaded.quantized_artifact
        assert entry is not None and entry.built
        assert entry.manifest.info["layout"] == native.panel_layout()
        stored = panel_linears(first)
        assert len(stored) == len(in_memory) and all(mapped(m) for m in stored)
        names = {m.name for m in stored}
        assert {n for n, q in read_quantized(entry).items() if q.panels} == names
        assert not any(n.rpartition(".")[0] in names for n in entry_names(entry.path))
        assert run(first, loaded) == expected
    finally:
        first.shutdown(timeout=0)

    second, loaded = start(gguf, tmp_path)
    try:
        assert loaded.quantized_artifact is not None and loaded.quantized_artifact.hit
        assert all(mapped(m) for m in panel_linears(second)) and len(panel_linears(second)) == len(in_memory)
        assert run(second, loaded) == expected
    finally:
        second.shutdown(timeout=0)

    # a byte of the stored panels changed: the entry fails its check and is built again
    path = loaded.quantized_artifact.path / PANELS_FILE
    loaded.quantized_artifact.release()
    loaded.artifact.release()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.chmod(0o600)
    path.write_bytes(bytes(data))
    third, loaded = start(gguf, tmp_path)
    try:
        assert loaded.quantized_artifact is not None and loaded.quantized_artifact.built
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
    sharing a cache dir each map their own quantized entry (this machine's, one of a layout of
    this test's own naming, and the row layout's, which a GPU reads), and all hold the same
    values."""
    cache = ArtifactCache.open(tmp_path)
    source = resolve_source(str(gguf))
    weights_id = weights_identity(source, file_sha256)
    here = panel_layout()
    assert here is not None
    layouts = [here, PanelLayout("test-layout", panel_form), None]
    keys = {quantized_descriptor(weights_id=weights_id, mode="int4", name=source.name, path=source.path,
                                 layout=None if layout is None else layout.name).key for layout in layouts}
    assert len(keys) == 3
    leases = [prepare_quantized_gguf(cache, source, weights_id, "int4", layout=layout) for layout in layouts]
    assert all(lease is not None and lease.built for lease in leases)
    assert {lease.key for lease in leases if lease is not None} == keys
    got = [read_quantized(lease) for lease in leases if lease is not None]
    assert not (leases[2].path / INDEX_FILE).exists() and not any(q.panels for q in got[2].values())
    kept = next(q for q in got[0].values() if q.panels)
    with pytest.raises(ValueError):  # the panel layout has no rows to read: ``row_layout`` unpacks them
        kept.dequantize(torch.float32)
    for name, rows in got[2].items():
        for weights in got[:2]:
            one = row_layout(weights[name])
            assert torch.equal(one.qweight, rows.qweight) and torch.equal(one.scales, rows.scales)
            assert (one.offsets is rows.offsets is None) or torch.equal(one.offsets, rows.offsets)
    again = prepare_quantized_gguf(cache, source, weights_id, "int4", layout=layouts[1])
    assert again is not None and again.hit
