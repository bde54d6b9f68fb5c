"""Weight-only quantized linears (``--weights int8|int4``): the numbers, not the kernels.

A batch-1 decode step is bound by reading the weights (269 MB of bf16 per step for the
embedded model). Quantized weights are fewer bytes: int8 with one scale per output channel
(``w ~= q * scale``), or int4 in groups of 32 inputs with a scale and an offset per group
(``w ~= q * scale + offset``, q in 0..15, scale and offset in float16: the layout of GGUF's
Q4_1, so the embedded SmolLM2, which ships as Q4_1, is reproduced from its own blocks). Activations stay in the
compute dtype. ``engine/linears.py`` runs them (torch's own int8/int4 CPU kernels for small
steps, the dequantized weights for the rest).

``quantize_model`` quantizes a loaded model's linears *and replaces their weights by the
dequantized ones*: the model then computes exactly the function the quantized kernels
compute (up to rounding), so transformers' own forward over it is the reference, and the
dense path of a linear (prefill chunks) and its quantized kernel (decode) agree. Which
weights a mode quantizes: every decoder linear; the LM head in int8 (int4 mode too: the
logits are its output, and GGUF sources keep the output matrix at 8 bits or more).
Quantizing changes the KV a model produces, so the loader puts the mode into the weights
identity (another KV namespace).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

INT4_GROUP = 32
# MXFP4: inputs per E8M0 exponent, and the numbers its E2M1 codes stand for.
MXFP4_GROUP = 32
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
LM_HEAD = "lm_head"
# What each mode stores, as the artifact cache keys it: change the string when the rules of
# ``kind_for`` or a quantizer change, and older entries become misses.
SCHEMES = {"int8": "int8-channel", "int4": f"int4-g{INT4_GROUP}-asym-f16+lm_head-int8-channel"}
# float16's largest number and smallest positive one (subnormal): int4 scales and offsets
# are kept in float16, the bytes kvcellar's kernels read (``engine/native``).
FP16_MAX = 65504.0
FP16_TINY = 2.0**-24


@dataclass
class QuantizedWeight:
    """One linear's weight ``[out, in]`` in a portable form (the kernels' own layouts are
    built from it by ``engine/linears.py``).

    * int8: ``qweight`` int8 ``[out, in]``, float32 ``scales [out]``, ``w = q * scale``;
    * int4: ``qweight`` uint8 ``[out, in / 2]`` (input ``2j`` in the low nibble, ``2j + 1`` in
      the high one), float16 ``scales``/``offsets [out, in / group]``, ``w = q * scale + offset``
      (in float32);
    * mxfp4 (OCP microscaling, gpt-oss's experts as GGUF stores them): ``qweight`` as int4's,
      each nibble an E2M1 code (``MXFP4_VALUES``), uint8 E8M0 ``scales [out, in / 32]``:
      ``w = value * 2^(scale - 127)``; no offsets. Read from GGUF blocks as they are
      (``artifacts/gguf_convert.py``), never made from float weights.

    ``panels``: int4 or MXFP4 tensors in kvcellar's panel layout (``native.pack_int4``/
    ``pack_mxfp4``: the same shapes, each 8 rows' bytes together; int4 offsets None where they
    are -8 x the scales), as the artifact cache stores them for this CPU's kernels
    (``engine.linears.row_layout`` gives the layout above).
    """

    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None
    group_size: int = 0
    panels: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        out, cols = self.qweight.shape
        return out, cols if self.kind == "int8" else cols * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.offsets) if t is not None)

    def _rows_only(self) -> None:
        if self.panels:  # the kernels' own layout: ``engine.linears.row_layout`` gives the rows
            raise ValueError("a weight in the panel layout has no rows to read here")

    def int4_values(self) -> torch.Tensor:
        """The 4-bit values as int32 ``[out, in]``."""
        self._rows_only()
        lo = (self.qweight & 0xF).to(torch.int32)
        hi = (self.qweight >> 4).to(torch.int32)
        return torch.stack([lo, hi], dim=-1).reshape(self.shape)

    def kernel_params(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scales (and int4 zero points) as the kernels take them, in ``dtype``: int8
        ``scales [out]``; int4 ``scale`` and ``zero = offset + 8 * scale`` (torch's kernels
        compute ``(q - 8) * scale + zero``)."""
        if self.kind == "int8":
            return self.scales.to(dtype), None
        self._rows_only()
        assert self.offsets is not None
        return self.scales.to(dtype), (self.offsets.float() + 8 * self.scales.float()).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the kernels compute with, from the scales rounded to ``dtype`` as the
        kernels take them: int8 ``q * scale``, int4 ``dequantize_int4`` (what a lean linear
        computes, ``engine/linears.py``)."""
        self._rows_only()
        if self.kind == "mxfp4":
            return dequantize_mxfp4(self.qweight, self.scales).to(dtype)
        scale, zero = self.kernel_params(dtype)
        if self.kind == "int8":
            return (self.qweight.float() * scale.float()[:, None]).to(dtype)
        assert zero is not None
        return dequantize_int4(self.int4_values().to(torch.uint8), scale, zero, self.group_size)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named tensors for a safetensors file (``from_tensors`` reads them back)."""
        if self.panels:  # their own file (``artifacts/panels.py``): the kernels need them aligned
            raise ValueError(f"{prefix}: panels are not stored as safetensors")
        out = {f"{prefix}.qweight": self.qweight, f"{prefix}.scales": self.scales}
        if self.offsets is not None:
            out[f"{prefix}.offsets"] = self.offsets
        return {k: v.contiguous() for k, v in out.items()}

    @classmethod
    def from_tensors(cls, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        q = tensors[f"{prefix}.qweight"]
        offsets = tensors.get(f"{prefix}.offsets")
        if q.dtype == torch.int8:
            return cls("int8", q, tensors[f"{prefix}.scales"])
        scales = tensors[f"{prefix}.scales"]
        if q.dtype == torch.uint8 and offsets is None and scales.dtype == torch.uint8:
            return cls("mxfp4", q, scales, group_size=MXFP4_GROUP)
        if q.dtype != torch.uint8 or offsets is None:
            raise ValueError(f"{prefix}: not a quantized weight this version reads")
        return cls("int4", q, scales, offsets, group_size=(q.shape[1] * 2) // scales.shape[1])

    @staticmethod
    def concat(parts: Iterable[QuantizedWeight]) -> QuantizedWeight:
        """The weights stacked along the output dimension (fused QKV / gate-up)."""
        parts = list(parts)
        for p in parts:
            p._rows_only()
        kinds = {(p.kind, p.group_size) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights quantized differently: {sorted(kinds)}")
        offsets = (None if parts[0].offsets is None
                   else torch.cat([p.offsets for p in parts]))  # type: ignore[misc]  # one kind: all have offsets
        return QuantizedWeight(parts[0].kind, torch.cat([p.qweight for p in parts]),
                               torch.cat([p.scales for p in parts]), offsets, parts[0].group_size)


def dequantize_mxfp4(nibbles: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """An MXFP4 weight (``QuantizedWeight`` layout) as float32 ``[out, in]``: each code's value
    times its block's power of two, both exact in float32 (the kernels' numbers)."""
    rows = nibbles.shape[0]
    codes = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, -1, MXFP4_GROUP).long()
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=nibbles.device)[codes]
    e = exponents.to(torch.int32)
    # 2^(e - 127): the float whose exponent field is e (e = 0: the subnormal 2^-127)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    return (values * bits.view(torch.float32)[:, :, None]).reshape(rows, -1)


def dequantize_int4(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``(q - 8) * scale + zero`` (torch's int4 kernels' form) as ``q * scale + (zero - 8 *
    scale)``: one multiply-add in the dtype of ``scale`` (float32 inside, one rounding), the
    fewest passes over a weight that prefill dequantizes a layer at a time.
    ``values`` uint8 ``[rows, cols]``; ``scale``/``zero`` ``[rows, cols / group_size]``."""
    rows, cols = values.shape
    dtype = scale.dtype
    zero8 = (zero.float() - 8 * scale.float()).to(dtype)[:, :, None]
    grouped = values.view(rows, cols // group_size, group_size).to(dtype)
    if out is None:
        return torch.addcmul(zero8, grouped, scale[:, :, None]).view(rows, cols)
    torch.addcmul(zero8, grouped, scale[:, :, None], out=out.view(rows, cols // group_size, group_size))
    return out


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8, rounded to nearest."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scale)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """Asymmetric int4 per group of ``group_size`` inputs: ``scale = (max - min) / 15``,
    ``offset = min``, both rounded to float16 before the values are (GGUF Q4_1: quantizing a
    dequantized Q4_1 tensor gives its blocks back)."""
    out, cols = weight.shape
    if cols % group_size or cols % 2:
        raise ValueError(f"int4 needs input features divisible by {group_size}, not {cols}")
    w = weight.detach().float().view(out, cols // group_size, group_size)
    lo = w.amin(dim=-1).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    hi = w.amax(dim=-1)
    scale = ((hi - lo.float()) / 15.0).clamp(FP16_TINY, FP16_MAX).to(torch.float16)
    q = torch.round((w - lo.float()[:, :, None]) / scale.float()[:, :, None])
    q = q.clamp_(0, 15).to(torch.uint8).view(out, cols)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return QuantizedWeight("int4", packed.contiguous(), scale, lo, group_size)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    return quantize_int8(weight) if kind == "int8" else quantize_int4(weight)


def kind_for(mode: str, name: str, linear: nn.Linear) -> str | None:
    """The quantization of one linear under ``mode`` (None: it stays dense)."""
    if mode == "full":
        return None
    if mode == "int4" and name.rpartition(".")[2] != LM_HEAD and linear.in_features % INT4_GROUP == 0:
        return "int4"
    return "int8"


class QuantizedEmbedding(nn.Module):
    """An input embedding kept as int4 groups (a GGUF's own Q4_0/Q4_1 blocks): a lookup
    dequantizes the rows it takes in float32, then rounds them to ``dtype``, as the dense
    entry's embedding was written, so the numbers are the same; the table itself takes an
    eighth of float32's memory, and no page of a dense table is touched while serving."""

    def __init__(self, quant: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        assert quant.kind == "int4" and quant.offsets is not None
        self.quant = quant
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = quant.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        q = self.quant
        assert q.offsets is not None
        rows = QuantizedWeight("int4", q.qweight[flat], q.scales[flat], q.offsets[flat], q.group_size)
        return rows.dequantize(torch.float32).to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int4 groups of {self.quant.group_size}"


def take_embedding(model: nn.Module, quantized: dict[str, QuantizedWeight]) -> bool:
    """Replace ``model``'s input embedding by a ``QuantizedEmbedding`` where ``quantized``
    holds it (under its module name, taken out of the dict); whether it did."""
    get = getattr(model, "get_input_embeddings", None)
    module = get() if callable(get) else None
    name = next((n for n, m in model.named_modules() if m is module), None)
    if module is None or name not in quantized:
        return False
    quant = quantized.pop(name)
    if type(module) is not nn.Embedding or quant.kind != "int4" or quant.shape != tuple(module.weight.shape):
        raise ValueError(f"{name}: a quantized embedding of shape {quant.shape} does not fit {module}")
    device = module.weight.device
    if device.type != "cpu":
        quant = QuantizedWeight("int4", quant.qweight.to(device), quant.scales.to(device),
                                None if quant.offsets is None else quant.offsets.to(device), quant.group_size)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, QuantizedEmbedding(quant, module.weight.dtype))
    return True


def quantize_linears(model: nn.Module, mode: str) -> dict[str, QuantizedWeight]:
    """The quantized weights of every ``nn.Linear`` of ``model`` under ``mode``, by module
    name, without touching the model (e.g. to store them in the artifact cache)."""
    out: dict[str, QuantizedWeight] = {}
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        kind = kind_for(mode, name, linear)
        if kind is not None:
            out[name] = quantize(linear.weight, kind)
    return out


def from_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    names = sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".qweight")})
    return {name: QuantizedWeight.from_tensors(name, tensors) for name in names}


def quantize_model(model: nn.Module, mode: str, given: dict[str, QuantizedWeight] | None = None, *,
                   materialize: bool = True) -> dict[str, QuantizedWeight]:
    """Quantize every ``nn.Linear`` of ``model`` under ``mode`` (or take ``given``, e.g.
    read from the artifact cache), and give each linear its dequantized weight in the
    model's dtype, in place. Returns the quantized weights by module name.

    ``materialize=False`` leaves the weights as loaded: for an engine whose quantized kernels
    run, whose linears (``engine/linears.py``) compute from the quantized weights alone, so
    a dequantized copy of the whole model is never made."""
    if mode not in ("full", "int8", "int4"):  # "auto" is the loader's to resolve first
        raise ValueError(f"unknown weights mode {mode!r}; use one of full, int8, int4")
    if mode == "full":
        return {}
    weights = given if given is not None else quantize_linears(model, mode)
    result: dict[str, QuantizedWeight] = {}
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if kind_for(mode, name, linear) is None:
            continue
        q = weights[name]
        if q.shape != tuple(linear.weight.shape):
            raise ValueError(f"{name}: quantized shape {q.shape} is not the weight's {tuple(linear.weight.shape)}")
        result[name] = q
        if not materialize:
            continue
        # A new Parameter, not a write into the old one: a tied embedding keeps its weight.
        linear.weight = nn.Parameter(q.dequantize(linear.weight.dtype).to(linear.weight.device), requires_grad=False)
    # The LM head no longer shares its weight with the embedding: keep transformers from
    # re-tying them (e.g. on a later ``tie_weights`` call).
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
        text = getattr(config, "get_text_config", lambda: config)()
        text.tie_word_embeddings = False
    return result
