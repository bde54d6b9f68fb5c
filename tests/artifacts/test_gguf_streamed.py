"""GGUF preparation a tensor at a time (``artifacts/gguf_convert.py``): the same weights as
transformers' whole-model GGUF loading, 4-bit blocks taken as they are, bounded memory.

The reference is ``prepare._load_gguf``: ``from_pretrained(gguf_file=...)``, which holds the
whole model (the way entries were prepared before).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcellar.artifacts import prepare
from kvcellar.artifacts.gguf_convert import EXACT_EMBEDDING_TYPES, GgufFile, int4_from_blocks
from kvcellar.quantization import INT4_GROUP, QuantizedWeight, kind_for, quantize, quantize_linears
from tests.artifacts.gguf_files import ENCODERS, write_gguf

REPO = Path(__file__).resolve().parents[2]
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
# Every type once, over two layers: the linears of layer 0, then those of layer 1.
EVERY_TYPE = {
    "0": dict(attn_q="Q4_0", attn_k="Q4_1", attn_v="Q4_K", attn_output="Q5_0", ffn_gate="Q5_1", ffn_up="Q6_K",
              ffn_down="Q8_0"),
    "1": dict(attn_q="F16", attn_k="F32", attn_v="BF16", attn_output="Q4_0", ffn_gate="Q4_1", ffn_up="Q4_K",
              ffn_down="Q4_0"),
}


def every_type(name: str) -> str:
    if name == "token_embd.weight":
        return "Q8_0"
    if name == "output.weight":
        return "Q6_K"
    _, layer, role, _ = name.split(".")
    return EVERY_TYPE[layer][role]


def moe_types(name: str) -> str:
    role = name.split(".")[-2]
    return "F32" if role == "ffn_gate_inp" else "Q8_0" if role.endswith("_exps") else "Q4_0"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf-streamed")
    return {
        "llama-q4_k_m": write_gguf(folder / "llama-q4_k_m.gguf", seed=1),
        "llama-every-type": write_gguf(folder / "llama-every-type.gguf", seed=2, types=every_type),
        "qwen2-tied-q4_0": write_gguf(folder / "qwen2-tied-q4_0.gguf", arch="qwen2", seed=3, tied=True,
                                      types=lambda n: "Q8_0" if n == "token_embd.weight" else "Q4_0"),
        "llama-q4_1": write_gguf(folder / "llama-q4_1.gguf", seed=4, types="Q4_1"),
        "qwen2moe": write_gguf(folder / "qwen2moe.gguf", arch="qwen2moe", seed=5, hidden=64, types=moe_types),
    }


@pytest.fixture(scope="module")
def references(ggufs: dict[str, Path]) -> dict[str, Any]:
    """Each file loaded whole by transformers, in float32."""
    return {name: prepare._load_gguf(path, torch.float32) for name, path in ggufs.items()}


def _gguf_types(path: Path) -> dict[str, str]:
    """``{HF weight name: GGUF type}``."""
    with GgufFile(path) as source:
        stored = {t.name: t.type.name for t in source.stored}
        return {hf: stored[g] for g, hf in source.key_map.items() if g in stored}


def _blocks(x: np.ndarray, gguf_type: str) -> np.ndarray:
    import gguf

    encode = ENCODERS.get(gguf_type) or (lambda a: gguf.quants.quantize(a, gguf.GGMLQuantizationType[gguf_type]))
    return encode(x)


def test_the_tensor_table_is_what_ggufs_own_reader_gives(ggufs: dict[str, Path]) -> None:
    """``GgufFile`` reads the tensor table from the header alone (``read_gguf_info``):
    for files of every type, each tensor where and as gguf's reader has it."""
    import gguf

    from kvcellar.model_source import find_embedded_gguf

    for path in [*ggufs.values(), find_embedded_gguf()]:
        reader = gguf.GGUFReader(str(path))
        want = [(t.name, t.tensor_type, tuple(t.data.shape), t.data.dtype, int(t.data_offset), int(t.shape[0]))
                for t in reader.tensors]
        with GgufFile(path) as source:
            got = [(t.name, t.type, t.shape, t.dtype, t.offset, t.cols) for t in source.stored]
        assert got == want, path.name


def fp16_rounding(q: QuantizedWeight) -> torch.Tensor:
    """Per weight, the most that rounding its group's scale and offset to float16 (half a
    unit in the last of 11 bits) can move ``q * scale + offset``."""
    groups = q.int4_values().float().view(*q.scales.shape, INT4_GROUP)
    return (groups * q.scales.float().abs()[..., None] + q.offsets.float().abs()[..., None]) * 2.0**-11 + 1e-7


@pytest.mark.parametrize("gguf_type", FOUR_BIT)
def test_4bit_blocks_are_int4_groups_value_for_value(gguf_type: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, 512)) * np.linspace(0.01, 1.0, 24)[:, None]).astype(np.float32)
    x[3, :256] = 0.0  # a block of zeros: scale 0
    raw = _blocks(x, gguf_type)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[gguf_type]))
    x = torch.from_numpy(x)
    assert (theirs - x).abs().mean() < 0.15 * x.abs().mean()  # the encoder makes real blocks

    q = int4_from_blocks(raw, gguf_type)
    assert (q.kind, q.group_size, q.shape) == ("int4", INT4_GROUP, (24, 512))
    assert q.qweight.dtype == torch.uint8 and q.scales.dtype == q.offsets.dtype == torch.float16
    groups = q.int4_values().float().view(24, -1, INT4_GROUP)
    ours = (groups * q.scales.float()[:, :, None] + q.offsets.float()[:, :, None]).view(24, 512)
    if gguf_type == "Q4_K":  # d * sc and dmin * m rounded to float16
        assert torch.all((ours - theirs).abs() <= fp16_rounding(q).view(24, 512))
        assert not torch.equal(ours, theirs)  # (so the bound above is what is tested)
    else:
        assert torch.equal(ours, theirs)  # q * scale + offset is gguf's own arithmetic, its float16 numbers
    # ... and what the kernels compute from them, within float32 rounding
    assert torch.allclose(q.dequantize(torch.float32), ours, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("name", "dtype", "shard_bytes"), [
    ("llama-q4_k_m", torch.float32, 1 << 30),
    ("llama-every-type", torch.float32, 300_000),  # sharded
    ("qwen2-tied-q4_0", torch.float32, 1 << 30),
    ("llama-every-type", torch.bfloat16, 1 << 30),
    ("qwen2moe", torch.float32, 1 << 30),  # experts fused by the processor across tensors
])
def test_dense_entry_holds_what_transformers_loads(ggufs: dict[str, Path], references: dict[str, Any],
                                                   tmp_path: Path, name: str, dtype: torch.dtype,
                                                   shard_bytes: int) -> None:
    from transformers import AutoModelForCausalLM

    info = prepare.gguf_builder(ggufs[name], dtype, name=name, progress=False, shard_bytes=shard_bytes)(tmp_path)
    reference = references[name] if dtype == torch.float32 else prepare._load_gguf(ggufs[name], dtype)
    entry = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=dtype)
    ours, theirs = entry.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    assert entry.config.tie_word_embeddings == reference.config.tie_word_embeddings
    if reference.config.tie_word_embeddings:
        assert entry.lm_head.weight is entry.model.embed_tokens.weight
    skip = {"_name_or_path", "architectures", "quantization_config"}
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in saved
    assert {k: v for k, v in entry.config.to_dict().items() if k not in skip} == \
        {k: v for k, v in reference.config.to_dict().items() if k not in skip}
    assert info["architecture"] == [type(reference).__name__]
    assert info["num_parameters"] == sum(p.numel() for p in reference.parameters())

    shards = sorted(tmp_path.glob("model*.safetensors"))
    if shard_bytes < 1 << 30:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(shards) > 2 and {p.name for p in shards} == set(index["weight_map"].values())
        assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
        for shard in shards:  # a shard over the size holds one tensor
            assert shard.stat().st_size <= shard_bytes + 4096 or \
                list(index["weight_map"].values()).count(shard.name) == 1
    else:
        assert [p.name for p in shards] == ["model.safetensors"]
    assert not list(tmp_path.glob("*.partial"))


def assert_embedding_taken(quantized: dict[str, Any], reference: Any, types: dict[str, str]) -> None:
    """Takes the embedding out of ``quantized``: there where its GGUF type is one int4 holds
    exactly, and then the reference's embedding value for value."""
    embedding = quantized.pop("model.embed_tokens", None)
    assert (embedding is not None) == (types["model.embed_tokens.weight"] in EXACT_EMBEDDING_TYPES)
    if embedding is not None:
        assert torch.equal(embedding.dequantize(torch.float32), reference.get_input_embeddings().weight)


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("name", ["llama-q4_k_m", "llama-every-type", "qwen2-tied-q4_0", "qwen2moe"])
def test_quantized_linears_take_4bit_blocks_and_quantize_the_rest(ggufs: dict[str, Path],
                                                                  references: dict[str, Any], name: str,
                                                                  mode: str) -> None:
    """The set of linears ``quantize_linears`` gives for the loaded model (the LM head from the
    embedding where tied); int4 linears stored in 4 bits are their blocks, exactly; every other
    one is what quantizing transformers' float32 weight gives. An embedding stored in Q4_0/Q4_1
    comes along as its own blocks, whatever the mode: exactly transformers' embedding."""
    reference = references[name]
    types = _gguf_types(ggufs[name])
    ours = prepare.quantize_gguf(ggufs[name], mode)
    assert_embedding_taken(ours, reference, types)
    assert sorted(ours) == sorted(quantize_linears(reference, mode))
    assert ours["lm_head"].kind == "int8"
    block_exact = 0
    for module_name, linear in [(n, m) for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)]:
        q, weight = ours[module_name], linear.weight.detach()
        kind = kind_for(mode, module_name, linear)
        assert q.kind == kind and q.shape == tuple(weight.shape), module_name
        stored = types.get(f"{module_name}.weight", types.get("model.embed_tokens.weight"))
        if kind == "int4" and stored in FOUR_BIT:
            out, cols = q.shape
            groups = q.int4_values().float().view(out, -1, INT4_GROUP)
            values = (groups * q.scales.float()[:, :, None] + q.offsets.float()[:, :, None]).view(out, cols)
            if stored == "Q4_K":  # its scales' products rounded to float16
                assert torch.all((values - weight).abs() <= fp16_rounding(q).view(out, cols)), module_name
            else:
                assert torch.equal(values, weight), module_name  # q/k rows permuted as transformers does
            block_exact += 1
        else:
            expected = quantize(weight, kind)
            assert torch.equal(q.qweight, expected.qweight) and torch.equal(q.scales, expected.scales), module_name
            assert (q.offsets is None) == (expected.offsets is None)
            assert q.offsets is None or torch.equal(q.offsets, expected.offsets)
    assert block_exact == (0 if mode == "int8" else sum(t in FOUR_BIT for n, t in types.items() if ".layers." in n))


def test_q4_1_gives_what_quantizing_its_dequantization_gave(ggufs: dict[str, Path],
                                                            references: dict[str, Any]) -> None:
    """Q4_1 blocks quantize back to themselves (``quantize_int4``): the previous way, from the
    float32 model, and the blocks taken as they are agree."""
    before = quantize_linears(references["llama-q4_1"], "int4")
    now = prepare.quantize_gguf(ggufs["llama-q4_1"], "int4")
    assert_embedding_taken(now, references["llama-q4_1"], _gguf_types(ggufs["llama-q4_1"]))
    assert sorted(now) == sorted(before)
    for name, q in before.items():
        assert torch.equal(now[name].qweight, q.qweight), name
        assert torch.equal(now[name].scales, q.scales), name
        assert torch.allclose(now[name].dequantize(torch.float32), q.dequantize(torch.float32), rtol=0, atol=1e-6)


def test_a_processor_that_does_more_than_reorder_rows_is_applied_whole(ggufs: dict[str, Path],
                                                                       references: dict[str, Any]) -> None:
    """Values changed (not a row order): the tensor is converted whole. Put aside by the
    processor (as MoE processors fuse gate and up): written once its block is done."""
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor

    with GgufFile(ggufs["llama-q4_k_m"]) as source:
        processor = source.processor

        class Doubling(type(processor)):  # type: ignore[misc]
            def process(self, weights: Any, name: str, **kwargs: Any) -> Any:
                if ".ffn_up." in name:
                    return GGUFTensor(weights * 2, name, {})
                if ".ffn_gate." in name:
                    hf = kwargs["tensor_key_mapping"][name]
                    kwargs["parsed_parameters"]["tensors"][hf] = torch.from_numpy(np.copy(weights))
                    return GGUFTensor(weights, None, {})
                return processor.process(weights, name, **kwargs)

        source.processor = Doubling(processor.config)
        got = {t.name: t for t in source.tensors()}
        theirs = references["llama-q4_k_m"].state_dict()
        assert sorted(got) == sorted(theirs)
        for key, t in got.items():
            value = t.fill(torch.empty(t.shape))
            assert (t.whole is not None) == ("up_proj" in key or "gate_proj" in key or value.dim() == 1), key
            assert torch.equal(value, theirs[key] * 2 if "up_proj" in key else theirs[key]), key
        # The gate is put aside until the last tensor of its block has been read.
        order = [t.name for t in source.tensors()]
        assert order.index("model.layers.0.mlp.gate_proj.weight") > order.index("model.layers.0.mlp.down_proj.weight")


CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    import torch
    import kvcellar
    from kvcellar.artifacts import prepare

    warm, big, out, shard = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def measured(fn):
        peak, done = [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.0002)

        base = rss()
        sampler = threading.Thread(target=sample, name="rss-sampler")
        sampler.start()
        try:
            result = fn()
        finally:
            done.set()
            sampler.join()
        return max(peak[0], rss()) - base, result

    def dense(path, name):
        (out / name).mkdir()
        prepare.gguf_builder(path, torch.float32, name=name, progress=False, shard_bytes=shard)(out / name)

    dense(warm, "warm")  # imports and first-use allocations, before measuring
    prepare.quantize_gguf(warm, "int4")
    dense_growth, _ = measured(lambda: dense(big, "big"))
    quant_growth, weights = measured(lambda: prepare.quantize_gguf(big, "int4"))
    kept = sum(q.nbytes for q in weights.values())
    print(json.dumps({"dense": dense_growth, "quantized": quant_growth, "kept": kept}))
""")


def test_preparing_holds_a_tensor_and_a_shard_not_the_model(tmp_path: Path) -> None:
    """The resident memory of a preparation in its own process, over the same process after
    preparing a tiny model first: about a shard and a tensor, far from the whole model."""
    hidden, ffn, layers = 2048, 4096, 2
    big = write_gguf(tmp_path / "big.gguf", hidden=hidden, heads=16, kv_heads=16, ffn=ffn, layers=layers,
                     types=lambda n: "Q8_0" if n.split(".")[-2] in ("attn_q", "attn_v", "ffn_up") else "F16")
    warm = write_gguf(tmp_path / "warm.gguf", types="Q8_0")
    largest = ffn * hidden * 4  # float32
    whole = layers * (4 * hidden * hidden + 3 * ffn * hidden) * 4
    shard = 32 << 20
    out = tmp_path / "out"
    out.mkdir()
    # glibc raises its mmap threshold as large blocks are freed, after which freed chunks stay
    # resident or not by the order of allocations (tens of MiB between runs): a fixed
    # threshold makes the figure what the preparation holds, not the allocator's history.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    run = subprocess.run([sys.executable, "-c", CHILD, str(warm), str(big), str(out), str(shard)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    grew = json.loads(run.stdout.strip().splitlines()[-1])
    mib = {k: round(v / 2**20) for k, v in grew.items()}
    assert grew["dense"] < 2.5 * largest + shard, mib
    assert grew["dense"] < whole / 3, mib
    assert grew["quantized"] < grew["kept"] + 2.5 * largest, mib
    assert grew["quantized"] < whole / 2, mib


def test_architectures_transformers_maps_otherwise_are_prepared_whole(ggufs: dict[str, Path],
                                                                      references: dict[str, Any], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Architectures transformers converts with its weight conversion mappings (lfm2; not
    Qwen3.5's, whose steps ``gguf_convert`` has) are not followed tensor by tensor: loaded
    whole, as before, same entries."""
    from transformers import AutoModelForCausalLM

    from kvcellar.artifacts import gguf_convert

    monkeypatch.setattr(gguf_convert, "_converted_by_mapping", lambda arch: True)
    path = ggufs["qwen2-tied-q4_0"]
    with pytest.raises(gguf_convert.NotStreamable):
        GgufFile(path)
    prepare.gguf_builder(path, torch.float32, name="whole", progress=False)(tmp_path)
    entry = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).state_dict()
    theirs = references["qwen2-tied-q4_0"].state_dict()
    assert sorted(entry) == sorted(theirs) and all(torch.equal(entry[k], v) for k, v in theirs.items())
    quantized = prepare.quantize_gguf(path, "int8")
    expected = quantize_linears(references["qwen2-tied-q4_0"], "int8")
    assert sorted(quantized) == sorted(expected)
    assert all(torch.equal(quantized[k].qweight, q.qweight) for k, q in expected.items())


@pytest.mark.parametrize("name", ["qwen2-tied-q4_0", "llama-q4_k_m"])
def test_the_entry_tokenizer_is_the_ggufs_own(ggufs: dict[str, Path], tmp_path: Path, name: str) -> None:
    """Loaded back from the entry, the tokenizer is the one transformers reads from the GGUF
    (same identity, same ids): ``Qwen2Tokenizer`` would otherwise rebuild it with an NFC
    normalizer the GGUF's lacks, and every start would log that they differ."""
    from transformers import AutoTokenizer

    from kvcellar.identity import tokenizer_identity

    path = ggufs[name]
    info = prepare.gguf_builder(path, torch.float32, name=name, progress=False)(tmp_path)
    own = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    entry = prepare.load_tokenizer(tmp_path)
    assert tokenizer_identity(entry) == tokenizer_identity(own) == info["source_tokenizer_id"]
    text = "cafe\u0301 <|im_start|>hello world"  # not NFC: a normalizer would change the ids
    assert entry(text).input_ids == own(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert entry.apply_chat_template(chat, tokenize=False) == own.apply_chat_template(chat, tokenize=False)
