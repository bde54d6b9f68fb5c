"""Loading a causal LM and its tokenizer with transformers, from local files.

``load_model`` loads a model source (``kvcellar.model_source``) as it is: a HF-format
directory, a hub snapshot, or a GGUF read directly (transformers dequantizes it in memory,
~20 s for the embedded model). Given ``folder``, a prepared copy of the source (e.g. a
dequantized GGUF in the artifact cache), it loads that instead, while the identities still
name the source (``kvcellar.identity``). Where prepared copies come from is not the loader's
business: ``runtime.prepare_and_load`` brings a source through the artifact cache first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcellar.engine.config import WEIGHT_MODES
from kvcellar.errors import ModelLoadError
from kvcellar.gguf_info import GGUFInfo, read_gguf_info
from kvcellar.identity import tokenizer_identity, weights_identity
from kvcellar.model_source import ModelSource, check_architecture, resolve_source

if TYPE_CHECKING:
    from kvcellar.artifacts import ArtifactLease
    from kvcellar.quantization import QuantizedWeight

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    source: ModelSource
    name: str
    dtype: torch.dtype
    device: torch.device
    weights_id: str  # stable identity of the weights
    tokenizer_id: str  # stable identity of tokenizer + chat template
    eos_token_ids: frozenset[int]
    max_context: int
    load_seconds: dict[str, float] = field(default_factory=dict)
    weights: str = "full"  # the weights mode served (``auto`` resolved: ``resolve_weights``)
    # Quantized weights by linear name (``--weights int8|int4``; kvcellar/quantization.py): the
    # model's linears hold their dequantized weights, the engine runs these where faster.
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    # The activations' dtype in the quantized kernels where it is not ``dtype``
    # (``resolve_serving``: bf16 under a float32 model on a CPU without native bf16).
    kernel_dtype: torch.dtype | None = None
    # The artifact-cache entry this model was loaded from, held so that it isn't evicted while
    # the model is served (set by ``runtime.prepare_and_load``); None when loaded from the source.
    artifact: ArtifactLease | None = None
    # The entry of its quantized linears (``--weights int8|int4`` on a GGUF), held the same way.
    quantized_artifact: ArtifactLease | None = None
    # The framework computing it: ``torch`` (``model`` a transformers model), or ``mlx`` (an
    # ``engine/mlx`` model, ``--engine mlx``).
    engine: str = "torch"

    @property
    def config(self) -> Any:
        return self.model.config

    def take_quantized(self) -> dict[str, QuantizedWeight]:
        """Hand the quantized weights over (to the engine's kernels, which keep their own
        copies): kept here too they would only take memory (0.75 bytes a weight for int4)."""
        quantized, self.quantized = self.quantized, {}
        return quantized


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 where the hardware computes it fast, else fp32 (CPU) / fp16 (old GPUs)."""
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype != "auto":
        try:
            return names[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float32 or float16") from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


# ``--weights auto`` serves a GGUF in the mode nearest the precision its decoder linears ship
# in (``gguf_weights_mode``). Only their weights count, by parameters; biases, norms, the
# embeddings and the output matrix never do.
_LINEAR_GGUF_TENSORS = frozenset({"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up",
                                  "ffn_down", "ffn_gate_up", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
# At most 5 bits a weight: the 4- and 5-bit types, and those below 4 bits (int4 is no coarser).
LOW_BIT_GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS",
                                "Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                                "TQ1_0", "TQ2_0"})
EIGHT_BIT_GGUF_TYPES = frozenset({"Q6_K", "Q8_0", "Q8_1", "Q8_K"})
# The linear ``quantized_mode_pays`` times: a typical decoder linear, 2048 x 2048, in copies
# that hold at least this many dense bytes together, taken in turn as a decode step takes a
# model's linears: one 8 MB bf16 weight stays in a large last-level cache, where dense weights
# won a probe that a model too big for the cache (a 7-8B's 15 GB) loses.
PROBE_FEATURES = 2048
PROBE_DENSE_BYTES = 128 << 20
# The quantized kernel must be this much faster than the dense weights to be picked: the
# choice is part of the weights identity (the KV namespace), so a near-tie must not flip it.
PROBE_MIN_SPEEDUP = 1.2
# Activation rows of the probe's batched run (8 sequences decoding together): where two
# quantized kernels tie at one row (kvcellar's and torch's int4 on a CPU with native bf16),
# torch's must be ahead here too to be picked.
PROBE_BATCH_ROWS = 8
# The probe's figures, by (mode, kernel dtype, dense dtype, device): ms through the kernel at
# one row, dense at one row, through the kernel at PROBE_BATCH_ROWS; a race only measures twice.
_probed: dict[tuple[str, torch.dtype, torch.dtype, torch.device], tuple[float, float, float]] = {}


@dataclass(frozen=True)
class ServingPrecision:
    """What ``--dtype`` and ``--weights`` resolve to (``resolve_serving``)."""

    dtype: torch.dtype  # the model's: activations, norms, attention, KV, dense weights
    weights: str  # full, int8 or int4
    kernel_dtype: torch.dtype | None = None  # the quantized kernels' activations, where not ``dtype``

    @property
    def weights_suffix(self) -> str:
        """What the weights identity (and so the KV namespace) adds: another mode or kernel
        precision computes other KV (``kernels=int8``: kvcellar's kernels, activations
        quantized to 8 bits)."""
        if self.weights == "full":
            return ""
        kernels = f"|kernels={str(self.kernel_dtype).removeprefix('torch.')}" if self.kernel_dtype else ""
        return f"|weights={self.weights}{kernels}"


def resolve_serving(dtype: str, weights: str, source: ModelSource, device: torch.device) -> ServingPrecision:
    """``--dtype`` and ``--weights`` resolved together.

    ``auto`` dtype is bf16 where the hardware computes it natively, else float32 on CPU
    (``resolve_dtype``). torch's int4/int8 kernels take bf16 activations only, and on a CPU
    without native bf16 a float32 model would keep the quantized linears dequantized (a 7B
    Q4 GGUF: 30 GB of float32). There, for quantized weights (asked for, or ``auto`` on a
    4-8-bit GGUF), the model stays float32 and its quantized linears run their kernel on bf16
    activations for decode-sized steps, where it is measured faster than float32 dense
    weights (``quantized_mode_pays``); larger steps dequantize to float32. An explicit
    ``--dtype`` is served as asked.

    Where kvcellar's own kernels were built (``engine/native``: x86-64 with AVX2), quantized
    weights run them on ``int8`` activations instead, if they are measured faster than the
    dense weights and torch's kernels are not measured ``PROBE_MIN_SPEEDUP`` times faster
    than them (``native_kernels_pay``)."""
    torch_dtype = resolve_dtype(dtype, device)
    if weights != "full" and device.type == "cpu":
        mode = requested_mode(weights, source)
        torch_kernel = torch.bfloat16 if dtype == "auto" or torch_dtype == torch.bfloat16 else None
        if mode != "full" and native_kernels_pay(mode, torch_dtype, torch_kernel, device):
            return ServingPrecision(torch_dtype, mode, torch.int8)
    if dtype == "auto" and device.type == "cpu" and torch_dtype == torch.float32 and weights != "full":
        mode = requested_mode(weights, source)
        if mode != "full" and quantized_mode_pays(mode, torch.bfloat16, device, dense_dtype=torch.float32):
            return ServingPrecision(torch.float32, mode, torch.bfloat16)
        return ServingPrecision(torch.float32, "full" if weights == "auto" else mode)
    return ServingPrecision(torch_dtype, resolve_weights(weights, source, torch_dtype, device))


def gguf_weights_mode(info: GGUFInfo) -> str:
    """The weights mode a GGUF's decoder linears ship in: the ``--weights auto`` rule.

    Over the weights of the decoder linears (``blk.<n>.{attn_q,attn_k,attn_v,attn_qkv,
    attn_output,ffn_gate,ffn_up,ffn_down,ffn_gate_up}.weight``), by parameter count:

    * ``full`` if any of them is in a float type (F32, F16, BF16) or a type not listed
      below, or none is found;
    * ``int4`` if those in types of at most 5 bits (``LOW_BIT_GGUF_TYPES``: Q4_0, Q4_1,
      Q4_K, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS, and the 1.5-3-bit types) hold at least half of
      the parameters; the rest is 6/8-bit, as K-quant mixes keep some linears (Q4_K_M:
      ``attn_v`` and ``ffn_down`` of some layers in Q6_K);
    * ``int8`` otherwise: mostly 6/8-bit (``EIGHT_BIT_GGUF_TYPES``: Q6_K, Q8_0, Q8_1, Q8_K).

    MXFP4 experts (``ffn_*_exps``: every gpt-oss file, whatever its label) are served as
    stored in every quantized mode and do not vote; where the other linears would make the
    mode ``full`` (an F16 gpt-oss), it is ``int8``: ``full`` would hold the experts in floats
    (gpt-oss-20b: 84 GB of float32).
    """
    low = high = other = 0
    mxfp4_experts = False
    for t in info.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LINEAR_GGUF_TENSORS or parts[3] != "weight":
            continue
        if t.mxfp4_experts:
            mxfp4_experts = True
            continue
        if t.type in LOW_BIT_GGUF_TYPES:
            low += t.params
        elif t.type in EIGHT_BIT_GGUF_TYPES:
            high += t.params
        else:
            other += t.params
    if other or not low + high:
        return "int8" if mxfp4_experts else "full"
    return "int4" if low >= high else "int8"


def quantized_mode_pays(mode: str, dtype: torch.dtype, device: torch.device,
                        dense_dtype: torch.dtype | None = None) -> bool:
    """Whether ``mode``'s kernel (int8/int4) runs on ``dtype`` activations on ``device``
    (``linears.quant_kernels_run``) and is faster there than the dense weights in
    ``dense_dtype`` (default ``dtype``): measured once per process and (mode, dtypes,
    device), on a ``PROBE_FEATURES``-square linear at one row (a decode step), in well under
    a second."""
    from kvcellar.engine.linears import quant_kernels_run

    dense_dtype = dense_dtype or dtype
    if not quant_kernels_run(dtype, device):
        return False
    quantized_ms, dense_ms, _ = _probe(mode, dtype, dense_dtype, device)
    return quantized_ms * PROBE_MIN_SPEEDUP <= dense_ms


def native_kernels_pay(mode: str, dtype: torch.dtype, torch_kernel: torch.dtype | None,
                       device: torch.device) -> bool:
    """Whether ``mode`` runs kvcellar's kernels under a ``dtype`` model: they pay against its
    dense weights (``quantized_mode_pays``), and torch's kernels on ``torch_kernel``
    activations (None: not a choice) are not ``PROBE_MIN_SPEEDUP`` times faster both at one
    row and at ``PROBE_BATCH_ROWS``."""
    from kvcellar.engine.linears import quant_kernels_run

    if not quantized_mode_pays(mode, torch.int8, device, dense_dtype=dtype):
        return False
    if torch_kernel is None or not quant_kernels_run(torch_kernel, device):
        return True
    ours, theirs = _probe(mode, torch.int8, dtype, device), _probe(mode, torch_kernel, dtype, device)
    return not (theirs[0] * PROBE_MIN_SPEEDUP <= ours[0] and theirs[2] * PROBE_MIN_SPEEDUP <= ours[2])


def _probe(mode: str, dtype: torch.dtype, dense_dtype: torch.dtype,
           device: torch.device) -> tuple[float, float, float]:
    """The probe's ms (kernel, dense, kernel at ``PROBE_BATCH_ROWS``), measured once per
    machine: the first measurement is kept under the cache dir (``_probe_file``) and read
    back by every later process. The choice it drives is part of the KV namespace, and
    kernels within noise of each other must not move a restart to another namespace, away
    from its cached prefixes."""
    key = (mode, dtype, dense_dtype, device)
    if key in _probed:
        return _probed[key]
    name = "|".join([mode, str(dtype), str(dense_dtype), str(device)])
    figures = MachineFigures(_probe_file(device))
    found = figures.get(name)
    if isinstance(found, list) and len(found) == 3 and all(isinstance(v, (int, float)) for v in found):
        _probed[key] = (float(found[0]), float(found[1]), float(found[2]))
        return _probed[key]
    _probed[key] = quantized_ms, dense_ms, batch_ms = _time_probe_linear(mode, dtype, dense_dtype, device)
    log.info("a %dx%d %s matmul at one row takes %.3f ms (%s activations; %.3f ms at %d rows), %.3f ms dense (%s)"
             " on %s", PROBE_FEATURES, PROBE_FEATURES, mode, quantized_ms, str(dtype).removeprefix("torch."),
             batch_ms, PROBE_BATCH_ROWS, dense_ms, str(dense_dtype).removeprefix("torch."), device)
    figures.put(name, [quantized_ms, dense_ms, batch_ms])
    return _probed[key]


class MachineFigures:
    """Figures measured once on a machine and read back by every later process (a JSON file:
    ``machine_figures``). Another process may write between a ``get`` and a ``put``: each
    ``put`` reads the file again and replaces it whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, name: str) -> Any:
        return _read_probes(self.path).get(name)

    def put(self, name: str, value: Any) -> None:
        _write_probes(self.path, {**_read_probes(self.path), name: value})


def machine_figures(device: torch.device) -> MachineFigures:
    """This machine's figures for ``device`` (``_probe_file``: its CPU, torch and kernels' build)."""
    return MachineFigures(_probe_file(device))


def _probe_file(device: torch.device) -> Path:
    """Where this machine's probe figures are kept: one file per CPU (model and flags), device
    name, torch, kvcellar's kernels build and probe shape, under the default cache dir (a
    machine's facts, whatever ``--cache-dir`` a server is given)."""
    from kvcellar.engine import native
    from kvcellar.paths import resolve_cache_dir

    lib = native.library()
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
                   "")
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    parts = [platform.machine(), cpu, " ".join(sorted(native.cpu_flags())), gpu, torch.__version__,
             "" if lib is None else Path(lib._name).name, str(PROBE_FEATURES), str(PROBE_DENSE_BYTES)]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return resolve_cache_dir() / "probes" / f"{device.type}-{digest}.json"


def _read_probes(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: measured again
        return {}
    return found if isinstance(found, dict) else {}


def _write_probes(path: Path, probes: dict[str, Any]) -> None:
    """Atomically, so a process starting beside this one reads a whole file; a cache dir
    that cannot be written leaves the figures to this process alone."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(probes, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the kernel probe's figures in %s: %s", path.parent, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _time_probe_linear(mode: str, dtype: torch.dtype, dense_dtype: torch.dtype, device: torch.device,
                       repeats: int = 5) -> tuple[float, float, float]:
    """Median ms of one matmul at one row through ``mode``'s kernel on ``dtype`` activations
    and through the dense weights in ``dense_dtype``, each as the engine runs it (a
    ``FastLinear`` of a ``dense_dtype`` model), and through the kernel at
    ``PROBE_BATCH_ROWS``, over copies of the weight that do not fit in a cache together
    (``PROBE_DENSE_BYTES``); the kernel's are inf if it refuses the shape."""
    import dataclasses
    import statistics

    from kvcellar.engine.linears import FastLinear, KernelTable
    from kvcellar.quantization import quantize

    gen = torch.Generator().manual_seed(0)
    quant = quantize(torch.randn(PROBE_FEATURES, PROBE_FEATURES, generator=gen) * 0.02, mode)
    weight = quant.dequantize(dense_dtype).to(device)
    kernel_dtype = dtype if dtype != dense_dtype else None
    copies = max(1, -(-PROBE_DENSE_BYTES // (weight.numel() * weight.element_size())))
    runs: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {"dense": [], "quantized": []}
    for _ in range(copies):  # each copy its own storage
        q = dataclasses.replace(quant, qweight=quant.qweight.clone(), scales=quant.scales.clone(),
                                offsets=None if quant.offsets is None else quant.offsets.clone())
        # a quantized FastLinear takes only the shape and dtype of ``weight`` (its values come from ``q``)
        quantized = FastLinear(weight, None, q, KernelTable(kernel_dtype=kernel_dtype))
        if quantized.quantized:
            runs["quantized"].append(quantized.quantized_kernel)
        runs["dense"].append(FastLinear(weight.clone(), None, None, KernelTable()).dense)
    if runs["quantized"]:
        runs["batch"] = runs["quantized"]
    x = torch.randn(PROBE_BATCH_ROWS, PROBE_FEATURES, generator=gen).to(dtype=dense_dtype, device=device)
    inputs = {"dense": x[:1], "quantized": x[:1], "batch": x}
    times: dict[str, list[float]] = {kind: [] for kind, r in runs.items() if r}
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up; rounds interleave the kinds
            for kind in times:
                t0 = time.perf_counter()
                for run in runs[kind]:
                    run(inputs[kind])
                times[kind].append((time.perf_counter() - t0) * 1e3 / copies)
    if "quantized" not in times:
        return float("inf"), statistics.median(times["dense"][1:]), float("inf")
    return (statistics.median(times["quantized"][1:]), statistics.median(times["dense"][1:]),
            statistics.median(times["batch"][1:]))


def resolve_weights(weights: str, source: ModelSource, dtype: torch.dtype, device: torch.device) -> str:
    """The weights mode to serve. ``auto``: for a GGUF, the mode its decoder linears ship in
    (``gguf_weights_mode``: int4 for 4/5-bit files, K-quant mixes included; int8 for 6/8-bit
    ones) where that mode's kernel runs and is measured faster (``quantized_mode_pays``);
    ``full`` for everything else (float GGUFs, HF-format sources, no fast kernel)."""
    mode = requested_mode(weights, source)
    if weights != "auto":
        return mode
    return mode if mode != "full" and quantized_mode_pays(mode, dtype, device) else "full"


def requested_mode(weights: str, source: ModelSource) -> str:
    """``weights`` checked, ``auto`` read as the mode a GGUF's decoder linears ship in
    (``gguf_weights_mode``; ``full`` for other sources), before any kernel is measured."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {weights!r}; use one of {', '.join(WEIGHT_MODES)}")
    if weights != "auto":
        return weights
    return gguf_weights_mode(read_gguf_info(source.path)) if source.kind == "gguf" else "full"


def linear_kernels(model: Any) -> dict[str, int]:
    """Which kernel runs the linears of a model the engine prepared (``linears.prepare_model``),
    for ``/health``: how many run their int4 / int8 kernel (for every step; ``lean``: keeping no
    dense copy; ``panels``: kept in the panel layout, int4 or MXFP4), how many run dense
    weights; of a mixture-of-experts model, how many of them are experts' and which kernels those
    run (``experts_int4`` ...). Empty before the engine prepared the model."""
    from kvcellar.engine.experts import moe_blocks

    prepared = getattr(model, "_kvcellar_prepared", None)
    if prepared is None:
        return {}
    counts = {"int4": 0, "int8": 0, "dense": 0, "lean": 0, "panels": 0}
    for linear in prepared.linears:
        kind = linear.quant_kind or "dense"
        counts[kind] = counts.get(kind, 0) + 1  # mxfp4 where a model has it
        counts["lean"] += int(linear.lean)
        counts["panels"] += int(linear.panels)
    for block in moe_blocks(model):
        for linear in (*block.gate_up, *block.down):
            kind = f"experts_{getattr(linear, 'quant_kind', None) or 'dense'}"
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation: tokenizer EOS plus generation_config EOS (may be a list)."""
    ids: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_model(
    model: str | ModelSource | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    weights: str = "auto",
    folder: Path | None = None,
    weights_id: str | None = None,
    attn_implementation: str | None = None,
    quantized: dict[str, QuantizedWeight] | None = None,
    linears_apart: bool = False,
) -> LoadedModel:
    """Load a model (a ``--model`` argument or a resolved source) and its tokenizer.

    ``folder``: a HF-format directory holding a prepared copy of the source; weights and
    tokenizer are loaded from it. ``weights_id``: the source's identity when the caller has
    it already (hashing a GGUF takes a while); computed here otherwise.

    ``weights``: ``full`` keeps the weights in ``dtype``; ``int8``/``int4`` quantize the
    linears (``kvcellar.quantization``; a GGUF's from its float32 dequantization) or take
    ``quantized`` (the same, read from the artifact cache); ``auto`` picks one
    (``resolve_weights``). The mode becomes part of the weights identity.

    ``linears_apart``: ``folder`` holds every weight but the linears' (``prepare_gguf``), which
    come from ``quantized`` alone; no dense copy of them is ever made where the quantized
    kernels run (the linears hold placeholders until the engine prepares them).
    """
    from kvcellar.engine.linears import quant_kernels_run
    from kvcellar.quantization import quantize_model, take_embedding

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if isinstance(model, ModelSource):
        source = model
        check_architecture(source)
    else:
        source = resolve_source(model)
    dev = resolve_device(device)
    precision = resolve_serving(dtype, weights, source, dev)
    torch_dtype, weights = precision.dtype, precision.weights
    kernel_dtype = precision.kernel_dtype or (torch_dtype if quant_kernels_run(torch_dtype, dev) else None)
    timings["resolve"] = time.perf_counter() - t0
    if weights_id is None:
        t0 = time.perf_counter()
        weights_id = weights_identity(source)
        timings["source_identity"] = time.perf_counter() - t0

    if linears_apart and (folder is None or weights == "full"):
        raise ValueError("linears_apart needs a folder and a quantized weights mode")
    tokenizer, hf_model = _load_weights_and_tokenizer(source, folder, torch_dtype, dev, attn_implementation, timings,
                                                      linears_apart)

    quantized_weights: dict[str, QuantizedWeight] = {}
    if weights != "full":
        t0 = time.perf_counter()
        given = quantized is not None
        if quantized is None and source.kind == "gguf":
            from kvcellar.artifacts.prepare import quantize_gguf

            quantized = quantize_gguf(source.path, weights)  # as the artifact cache stores it
        try:
            quantized = dict(quantized) if quantized is not None else None
            if quantized is not None:
                take_embedding(hf_model, quantized)  # a GGUF's int4 embedding, where it was kept so
            quantized_weights = quantize_model(hf_model, weights, given=quantized, materialize=kernel_dtype is None)
        except (KeyError, ValueError) as exc:  # given weights of another shape or set of linears
            raise ModelLoadError(f"The quantized weights of {source.name} do not fit its model: {exc}") from exc
        if kernel_dtype is None:
            log.warning("--weights %s: torch has no fast %s kernel for %s activations on %s; the dequantized "
                        "weights run instead (same outputs, no speed-up)", weights, weights, torch_dtype, dev)
        weights_id += precision.weights_suffix  # other weights, other KV
        timings["quantized_weights" if given else "quantize"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok_id = tokenizer_identity(tokenizer)
    timings["tokenizer_identity"] = time.perf_counter() - t0

    max_ctx = int(getattr(hf_model.config, "max_position_embeddings", 0) or 4096)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=source,
        name=source.name,
        dtype=torch_dtype,
        device=dev,
        weights_id=weights_id,
        tokenizer_id=tok_id,
        eos_token_ids=eos_ids(hf_model, tokenizer),
        max_context=max_ctx,
        load_seconds=timings,
        weights=weights,
        quantized=quantized_weights,
        kernel_dtype=precision.kernel_dtype,
    )


def _load_weights_and_tokenizer(
    source: ModelSource, folder: Path | None, torch_dtype: torch.dtype, dev: torch.device,
    attn_implementation: str | None, timings: dict[str, float], linears_apart: bool = False,
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcellar.engine.attention import ATTENTION_NAME

    kwargs: dict[str, Any] = {}
    model_kwargs: dict[str, Any] = {}
    if folder is not None:
        load_dir = str(folder)
    elif source.kind == "gguf":
        from kvcellar.artifacts.gguf_convert import gguf_config

        load_dir = str(source.path.parent)
        kwargs["gguf_file"] = source.path.name
        try:
            model_kwargs["config"] = gguf_config(source.path)  # with what transformers leaves out (expert sizes)
        except Exception as exc:
            raise ModelLoadError(f"Could not read the model configuration of {source.name}: {exc}") from exc
    else:
        load_dir = str(source.path)

    t0 = time.perf_counter()
    try:
        if folder is not None:
            from kvcellar.artifacts.prepare import load_tokenizer

            tokenizer = load_tokenizer(folder)
        else:
            tokenizer = AutoTokenizer.from_pretrained(load_dir, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"Could not load the tokenizer of {source.name} from {load_dir}: {exc}") from exc
    timings["tokenizer"] = timings.get("tokenizer", 0.0) + time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        if linears_apart:
            assert folder is not None
            hf_model = _load_without_linears(folder, torch_dtype, dev, attn_implementation or ATTENTION_NAME)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(
                load_dir,
                dtype=torch_dtype,
                attn_implementation=attn_implementation or ATTENTION_NAME,
                **kwargs,
                **model_kwargs,
            )
    except Exception as exc:
        raise ModelLoadError(f"Could not load the weights of {source.name} from {load_dir}: {exc}") from exc
    _split_experts(hf_model, source.name)
    hf_model.to(dev).eval()
    hf_model.requires_grad_(False)
    timings["weights"] = timings.get("weights", 0.0) + time.perf_counter() - t0
    return tokenizer, hf_model


def linear_placeholder(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``[rows, cols]`` weight that holds no memory (one NaN, broadcast): the shape of a
    linear whose values live in its quantized form. Anything computing with it gets NaNs,
    never plausible numbers."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(rows, cols)


def _load_without_linears(folder: Path, dtype: torch.dtype, dev: torch.device, attn_implementation: str) -> Any:
    """The model of a ``linears_apart`` entry: built on the meta device, every weight of the
    entry loaded by mmap (safetensors), the linears' weights placeholders
    (``linear_placeholder``), non-persistent buffers (rotary frequencies, embedding scales)
    initialised by transformers' own ``initialize_weights``, which skips what was loaded."""
    from safetensors import safe_open
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from kvcellar.engine.experts import split_state

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    _split_experts(model, folder.name)  # experts become linears, which the entry leaves out too
    modules = dict(model.named_modules())
    apart = set()
    for name, param in list(model.named_parameters()):  # a tied weight under its first name only
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight" and isinstance(modules[owner], nn.Linear):
            rows, cols = param.shape
            modules[owner].weight = nn.Parameter(linear_placeholder(rows, cols, dtype, dev), requires_grad=False)
            apart.add(name)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device=str(dev)) as f:
            state.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    result = model.load_state_dict(split_state(state), strict=False, assign=True)
    if result.unexpected_keys:
        raise ModelLoadError(f"{folder} holds weights the model does not have: {', '.join(result.unexpected_keys)}")
    model.tie_weights()
    missing = sorted(k for k, t in model.state_dict(keep_vars=True).items() if t.is_meta and k not in apart)
    if missing:
        raise ModelLoadError(f"{folder} holds no weights for {', '.join(missing)}")
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True
    for key, buffer in list(model.named_non_persistent_buffers()):
        owner, _, leaf = key.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, torch.empty_like(buffer, device=dev))
    model.initialize_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"could not initialise {', '.join(left)} of the model in {folder}")
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    return model


def _split_experts(model: Any, name: str) -> None:
    """MoE blocks as kvcellar runs them (``engine/experts.py``), before anything quantizes
    or prepares the linears: the experts are linears from here on."""
    from kvcellar.engine.experts import split_experts

    try:
        split_experts(model)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: {exc}") from exc


def wrap_model(
    hf_model: Any, tokenizer: Any, *, name: str = "in-memory", weights_id: str | None = None
) -> LoadedModel:
    """A ``LoadedModel`` around a model object built in memory (tests, small random configs);
    its MoE blocks become kvcellar's (``engine/experts.py``), in place."""
    from kvcellar.engine.attention import ATTENTION_NAME

    _split_experts(hf_model, name)
    hf_model.set_attn_implementation(ATTENTION_NAME)
    hf_model.eval().requires_grad_(False)
    param = next(hf_model.parameters())
    if weights_id is None:
        h = hashlib.sha256()
        for key, tensor in sorted(hf_model.state_dict().items()):
            h.update(key.encode())
            h.update(tensor.detach().float().cpu().numpy().tobytes())
        weights_id = "mem-sha256:" + h.hexdigest()
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        source=ModelSource("hf_dir", Path("."), name),
        name=name,
        dtype=param.dtype,
        device=param.device,
        weights_id=weights_id,
        tokenizer_id=tokenizer_identity(tokenizer),
        eos_token_ids=eos_ids(hf_model, tokenizer),
        max_context=int(getattr(hf_model.config, "max_position_embeddings", 0) or 4096),
    )
