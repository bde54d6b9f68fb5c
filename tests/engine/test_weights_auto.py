"""``--weights auto`` on GGUFs as people download them, the architecture check before any
load, and the per-kernel summary of a prepared model.

The GGUFs here are headers with real tensor types and shapes (what ``auto`` and the check
read) over zeroed or missing data: no test loads their weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvcellar.engine import SamplingParams, loader, native
from kvcellar.engine.linears import FastLinear, prepare_model, quant_kernels_run
from kvcellar.engine.loader import (
    LoadedModel,
    gguf_weights_mode,
    linear_kernels,
    load_model,
    native_kernels_pay,
    quantized_mode_pays,
    resolve_weights,
    wrap_model,
)
from kvcellar.errors import ModelLoadError
from kvcellar.gguf_info import read_gguf_info
from kvcellar.model_source import MODEL_TYPES, find_embedded_gguf, resolve_source
from kvcellar.quantization import quantize_model
from tests._models import chat_ids, make_engine, reference_greedy, tiny_model

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
HIDDEN, FFN = 256, 512  # K-quants store rows in blocks of 256
LINEARS = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN, HIDDEN), "attn_v": (HIDDEN, HIDDEN),
           "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
           "ffn_down": (HIDDEN, FFN)}


def write_gguf(path: Path, linear_type: Callable[[str], T], *, arch: str = "llama", biases: bool = False,
               data: bool = True) -> Path:
    """A two-layer GGUF header of ``arch`` whose decoder linears have the types
    ``linear_type(part)`` gives, F32 norms (and F32 q/k/v biases, as Qwen2 has), Q8_0
    embeddings and a Q6_K output matrix; tensor data zeroed, or left out (``data=False``)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_block_count(2)
    w.add_embedding_length(HIDDEN)

    def tensor(name: str, shape: tuple[int, int] | tuple[int], qtype: T) -> None:
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, np.zeros(shape, dtype=np.float32 if qtype == T.F32 else np.float16))
            return
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = shape
        w.add_tensor(name, np.zeros((rows, cols // block * size), dtype=np.uint8), raw_dtype=qtype)

    tensor("token_embd.weight", (512, HIDDEN), T.Q8_0)
    for i in range(2):
        tensor(f"blk.{i}.attn_norm.weight", (HIDDEN,), T.F32)
        tensor(f"blk.{i}.ffn_norm.weight", (HIDDEN,), T.F32)
        for part, shape in LINEARS.items():
            tensor(f"blk.{i}.{part}.weight", shape, linear_type(part))
            if biases and part in ("attn_q", "attn_k", "attn_v"):
                tensor(f"blk.{i}.{part}.bias", (shape[0],), T.F32)
    tensor("output_norm.weight", (HIDDEN,), T.F32)
    tensor("output.weight", (512, HIDDEN), T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if data:
        w.write_tensors_to_file()
    else:
        w.write_ti_data_to_file()
    w.close()
    return path


def q4_k_m(part: str) -> T:
    """llama.cpp's Q4_K_M: Q4_K, with ``attn_v`` and ``ffn_down`` in Q6_K (here in every layer)."""
    return T.Q6_K if part in ("attn_v", "ffn_down") else T.Q4_K


# name -> (types of the linears, Qwen2-like biases, the mode the file ships in)
FILES = {
    "qwen2-q4_0": (lambda part: T.Q4_0, True, "int4"),
    "q4_k_m": (q4_k_m, False, "int4"),
    "q5_k_m": (lambda part: T.Q6_K if part in ("attn_v", "ffn_down") else T.Q5_K, True, "int4"),
    "q3_k_m": (lambda part: T.Q5_K if part in ("attn_v", "ffn_down") else T.Q3_K, False, "int4"),
    "q8_0": (lambda part: T.Q8_0, True, "int8"),
    "q6_k": (lambda part: T.Q6_K, False, "int8"),
    "mostly-q8_0": (lambda part: T.Q4_0 if part == "attn_q" else T.Q8_0, False, "int8"),
    "f16": (lambda part: T.F16, True, "full"),
    "q8_0-one-f16": (lambda part: T.F16 if part == "attn_output" else T.Q8_0, False, "full"),
}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("weights-auto")
    arch = {"qwen2-q4_0": "qwen2", "q5_k_m": "qwen2", "q8_0": "qwen2"}
    return {name: write_gguf(folder / f"{name}.gguf", types, arch=arch.get(name, "llama"), biases=biases)
            for name, (types, biases, _) in FILES.items()}


@pytest.mark.parametrize("name", FILES)
def test_the_rule_reads_the_precision_the_linears_ship_in(ggufs: dict[str, Path], name: str) -> None:
    assert gguf_weights_mode(read_gguf_info(ggufs[name])) == FILES[name][2]


def test_the_embedded_q4_1_model_ships_in_int4() -> None:
    assert gguf_weights_mode(read_gguf_info(find_embedded_gguf())) == "int4"


def test_the_header_reader_agrees_with_ggufs_own(ggufs: dict[str, Path]) -> None:
    path = ggufs["qwen2-q4_0"]
    info = read_gguf_info(path)
    reader = gguf.GGUFReader(str(path))
    assert [(t.name, t.type, t.params) for t in info.tensors] == \
        [(t.name, t.tensor_type.name, int(t.n_elements)) for t in reader.tensors]
    assert info.architecture == "qwen2" and info.metadata["general.name"] == "qwen2-q4_0"


@pytest.mark.parametrize("pays", [True, False])
def test_auto_serves_that_mode_only_where_its_kernel_pays(ggufs: dict[str, Path], pays: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The capability is forced both ways (this host has one answer); the rule is the file's."""
    monkeypatch.setattr(loader, "quantized_mode_pays", lambda mode, dtype, device: pays)
    for name, (_, _, mode) in FILES.items():
        source = resolve_source(str(ggufs[name]))
        assert resolve_weights("auto", source, torch.bfloat16, CPU) == (mode if pays else "full")
        assert resolve_weights("int8", source, torch.bfloat16, CPU) == "int8"  # asked for: served as asked
        assert resolve_weights("full", source, torch.bfloat16, CPU) == "full"


def test_auto_with_the_real_capability(ggufs: dict[str, Path]) -> None:
    q4 = resolve_source(str(ggufs["q4_k_m"]))
    assert resolve_weights("auto", q4, torch.float32, CPU) == "full"  # no fast kernel for fp32 activations
    expected = "int4" if quantized_mode_pays("int4", torch.bfloat16, CPU) else "full"
    assert resolve_weights("auto", q4, torch.bfloat16, CPU) == expected
    with pytest.raises(ValueError, match="weights mode"):
        resolve_weights("int3", q4, torch.float32, CPU)


def test_the_probe_reads_its_weights_from_memory_as_a_decode_step_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """One 8 MB weight stays in a large last-level cache, where the dense weights won the probe
    that a 7-8B model's 15 GB lost: the probe takes copies of the weight in turn, each its own
    storage, ``PROBE_DENSE_BYTES`` of dense weights together."""
    if not quant_kernels_run(torch.bfloat16, CPU):
        pytest.skip("no int4/int8 kernel for bf16 on this CPU")
    monkeypatch.setattr(loader, "PROBE_DENSE_BYTES", 20 << 20)  # 2.5 bf16 weights of 2048 x 2048
    runs: dict[str, set[int]] = {"dense": set(), "quantized_kernel": set()}
    storages: dict[str, set[int]] = {"dense": set(), "quantized_kernel": set()}
    for name in runs:
        original = getattr(FastLinear, name)

        def recorded(self: FastLinear, x: torch.Tensor, name: str = name, original: Any = original) -> torch.Tensor:
            runs[name].add(id(self))
            held = self._q if name == "quantized_kernel" else self._dense
            if held is not None and not held.is_mkldnn:
                storages[name].add(held.untyped_storage().data_ptr())
            return original(self, x)
        monkeypatch.setattr(FastLinear, name, recorded)
    quantized_ms, dense_ms, batch_ms = loader._time_probe_linear("int4", torch.bfloat16, torch.bfloat16, CPU,
                                                                 repeats=1)
    assert 0 < quantized_ms < float("inf") and dense_ms > 0 and 0 < batch_ms < float("inf")
    assert len(runs["dense"]) == len(runs["quantized_kernel"]) == 3
    assert len(storages["quantized_kernel"]) == 3 and len(storages["dense"]) in (0, 3)  # packed: opaque


def test_the_probe_is_measured_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel choice is part of the KV namespace: a later process (here: this one with its
    memory of the probe dropped) reads the first one's figures instead of measuring again,
    where another measurement could land on the other side of a near-tie and miss every
    cached prefix. A damaged file is measured again."""
    monkeypatch.setenv("KVCELLAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "_probed", {})
    measured: list[tuple[float, float, float]] = [(0.2, 0.5, 0.6), (0.6, 0.5, 0.9), (0.3, 0.4, 0.7),
                                                  (0.25, 0.5, 0.8)]
    monkeypatch.setattr(loader, "_time_probe_linear", lambda *args: measured.pop(0))
    assert loader._probe("int4", torch.bfloat16, torch.bfloat16, CPU) == (0.2, 0.5, 0.6)
    assert quantized_mode_pays("int4", torch.bfloat16, CPU) == quant_kernels_run(torch.bfloat16, CPU)
    monkeypatch.setattr(loader, "_probed", {})  # a new process
    assert loader._probe("int4", torch.bfloat16, torch.bfloat16, CPU) == (0.2, 0.5, 0.6)
    assert len(measured) == 3
    assert loader._probe("int8", torch.bfloat16, torch.bfloat16, CPU) == (0.6, 0.5, 0.9)  # another key: measured
    files = list((tmp_path / "probes").iterdir())
    assert len(files) == 1 and len(json.loads(files[0].read_text())) == 2
    files[0].write_text("{not json")
    monkeypatch.setattr(loader, "_probed", {})
    assert loader._probe("int4", torch.bfloat16, torch.bfloat16, CPU) == (0.3, 0.4, 0.7)
    stored = json.loads(files[0].read_text())
    stored["int4|torch.bfloat16|torch.bfloat16|cpu"] = [0.3, 0.4]  # an older kvcellar's: measured again
    files[0].write_text(json.dumps(stored))
    monkeypatch.setattr(loader, "_probed", {})
    assert loader._probe("int4", torch.bfloat16, torch.bfloat16, CPU) == (0.25, 0.5, 0.8)
    assert not measured


@pytest.mark.parametrize(("theirs", "ours_picked"), [((0.2, 0.5, 0.5), True), ((0.15, 0.5, 1.0), True),
                                                     ((0.15, 0.5, 0.5), False)])
def test_torchs_kernel_is_picked_only_where_clearly_faster_at_one_row_and_batched(
        monkeypatch: pytest.MonkeyPatch, theirs: tuple[float, float, float], ours_picked: bool) -> None:
    """kvcellar's kernel measures (0.2 ms, dense 0.5, 0.7 at 8 rows): torch's is picked only
    where it is ``PROBE_MIN_SPEEDUP`` times faster at one row and at ``PROBE_BATCH_ROWS``."""
    if not (native.available() and quant_kernels_run(torch.int8, CPU) and quant_kernels_run(torch.bfloat16, CPU)):
        pytest.skip("kvcellar's and torch's int4 kernels are not both a choice here")
    monkeypatch.setattr(loader, "_probed", {("int4", torch.int8, torch.bfloat16, CPU): (0.2, 0.5, 0.7),
                                            ("int4", torch.bfloat16, torch.bfloat16, CPU): theirs})
    assert native_kernels_pay("int4", torch.bfloat16, torch.bfloat16, CPU) is ours_picked


def test_auto_serves_hf_format_sources_in_full(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert resolve_weights("auto", resolve_source(str(tmp_path)), torch.bfloat16, CPU) == "full"


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_the_kernel_is_measured_once_and_quickly(mode: str) -> None:
    assert quantized_mode_pays(mode, torch.float32, CPU) is False  # no kernel: nothing to measure
    if not quant_kernels_run(torch.bfloat16, CPU):
        pytest.skip("no int4/int8 kernel for bf16 on this CPU")
    t0 = time.perf_counter()
    first = quantized_mode_pays(mode, torch.bfloat16, CPU)
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    assert quantized_mode_pays(mode, torch.bfloat16, CPU) is first
    assert time.perf_counter() - t0 < 0.01  # remembered for the process


@pytest.mark.parametrize("arch", ["mamba", "bert", "gemma2", "qwen3next"])
def test_an_unsupported_gguf_is_refused_before_any_weight_is_read(tmp_path: Path, arch: str) -> None:
    """The tensor data is garbage and too short: only the header may be read."""
    path = write_gguf(tmp_path / f"{arch}.gguf", lambda part: T.Q4_0, arch=arch, data=False)
    with path.open("ab") as f:
        f.write(b"\xff" * 1000)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match=f"does not serve the '{arch}' architecture") as err:
        resolve_source(str(path))
    assert "llama" in str(err.value) and "qwen2" in str(err.value)  # what is served instead
    if arch == "gemma2":
        assert "soft-caps" in str(err.value)
    with pytest.raises(ModelLoadError, match=f"'{arch}'"):
        load_model(str(path), dtype="float32", device="cpu")
    assert time.perf_counter() - t0 < 1.0
    # the same garbage under a supported architecture passes the check: it read no data
    ok = write_gguf(tmp_path / "llama.gguf", lambda part: T.Q4_0, data=False)
    with ok.open("ab") as f:
        f.write(b"\xff" * 1000)
    assert resolve_source(str(ok)).kind == "gguf"


@pytest.mark.parametrize(("config", "needle"), [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "does not serve the 'bert' architecture"),
    ({"architectures": ["Something"]}, "names no architecture"),
])
def test_an_unsupported_hf_directory_is_refused_from_its_config(tmp_path: Path, config: dict, needle: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ModelLoadError, match=needle):
        resolve_source(str(tmp_path))


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        resolve_source(str(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_kernels_say_which_linears_run_which_kernel(dtype: torch.dtype) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype).eval()
    assert linear_kernels(model) == {}  # not prepared yet
    prepare_model(model, quantize_model(model, "int4"))
    if quant_kernels_run(dtype, CPU):  # decoder linears int4, the LM head int8
        # every one runs its kernel for every step and keeps no dense copy
        want = {"int4": 14, "int8": 1, "dense": 0, "lean": 15, "panels": 0}  # torch's kernels: no panels
    else:
        want = {"int4": 0, "int8": 0, "dense": 15, "lean": 0, "panels": 0}
    assert linear_kernels(model) == want


# Gemma 4's global layers: wider heads, fewer of them, a quarter of each rotated (its defaults).
GEMMA4_TEXT = {"global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
               "sliding_window": 24, "hidden_size_per_layer_input": 0,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}


# Qwen3.5: three linear-attention layers and a full-attention one, small linear heads (its
# defaults are a 9B's). ``qwen3_5`` folders are its multimodal checkpoints, whose text model is
# what transformers builds for them (tests/integration/test_qwen35.py loads one); here both types
# build that text model.
QWEN35_TEXT = {"num_hidden_layers": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}


# Qwen3.5 MoE (Qwen3.5-35B-A3B, Qwen3.6): the same layers, routed experts and a shared expert.
QWEN35_MOE_TEXT = {**QWEN35_TEXT, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64}


def _tiny_of_model_type(model_type: str, tokenizer: Any) -> LoadedModel:
    if model_type in ("qwen3_5", "qwen3_5_text"):
        return tiny_model("qwen3_5_text", tokenizer, name=f"tiny-{model_type}", **QWEN35_TEXT)
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return tiny_model("qwen3_5_moe_text", tokenizer, name=f"tiny-{model_type}", **QWEN35_MOE_TEXT)
    if model_type not in ("gemma3", "gemma4"):
        extra = {"sliding_window": 24} if model_type in ("mistral", "ministral", "gemma3_text") else {}
        return tiny_model(model_type, tokenizer, **(GEMMA4_TEXT if model_type == "gemma4_text" else extra))
    from transformers import AutoConfig, AutoModelForCausalLM

    text = {"vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 24,
            "tie_word_embeddings": False, **(GEMMA4_TEXT if model_type == "gemma4" else {})}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    if model_type == "gemma3":
        config = AutoConfig.for_model("gemma3", text_config=text, mm_tokens_per_image=4,
                                      vision_config={**vision, "image_size": 28, "patch_size": 14})
    else:  # the vision tower loads, unused; no audio tower
        config = AutoConfig.for_model("gemma4", text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    return wrap_model(model, tokenizer, name=f"tiny-{model_type}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_served_model_type_generates_what_transformers_does(model: Any, model_type: str) -> None:
    """What ``MODEL_TYPES`` promises: kvcellar's paged attention runs the family as
    transformers does (greedy tokens of a fresh run and of a prefix hit, across blocks and
    prefill chunks, past the sliding window where there is one)."""
    tiny = _tiny_of_model_type(model_type, model.tokenizer)
    prompt = chat_ids(tiny, "Hello there, how are you doing today? Tell me a story about a dragon.")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny, block_size=8, max_step_tokens=16)
    fresh, hit = (engine.generate([prompt], params)[0] for _ in range(2))
    assert hit.num_cached_tokens > 0
    tiny.model.generation_config.eos_token_id = None
    want, _ = reference_greedy(tiny.model, prompt, 8)
    assert fresh.token_ids == hit.token_ids == want
