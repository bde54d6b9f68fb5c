"""Weight-only int8 linears for decode (``--weights int8``).

A batch-1 decode step is bound by reading the weights: 269 MB of bf16 per step for the
embedded model. Each ``nn.Linear`` of the decoder layers (and the LM head) becomes a
``WeightOnlyInt8Linear``: int8 weights with one scale per output channel (symmetric,
``w ~= q * scale``), half the bytes. Activations stay in the compute dtype.

Two kernels, picked per call by the number of rows (tokens in the step):

* up to ``int8_kernel_max_rows(dtype)`` rows: ``torch.ops.aten._weight_int8pack_mm``,
  torch's own CPU kernel that reads the int8 weights directly (decode, short tails);
* more rows: the weight is dequantized to the compute dtype for that call and multiplied by
  oneDNN/MKL (prefill chunks); the int8 kernel does not block over rows and loses there.

Where the int8 kernel pays depends on the CPU (docs/performance.md): with bf16 activations
on AVX-512 BF16 it was 1.6x faster than bf16 ``linear`` at 1 row and 1.4x slower at 8; with
fp32 activations on an AVX2-only CPU it was 7-50x slower than fp32 ``linear`` at every row
count from 1 to 32, so there ``--weights int8`` only halves the weights' memory and the
dequantizing path runs always (slower; the loader warns).

Both compute ``x @ (q * scale).T`` up to rounding, so cached and uncached runs agree to the
same tolerance as in the compute dtype. The LM head is quantized too (a tied embedding is
untied: the lookup table stays in the compute dtype). Quantizing changes the KV a model
produces, so ``loader`` puts the weights mode into the weights identity (another KV namespace).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_MODES = ("full", "int8")
# Rows up to which the int8 kernel beats bf16 ``linear`` on AVX-512 BF16: faster at 1 row,
# slower at 8 (measured); 4 lies between the two measurements.
INT8_KERNEL_MAX_ROWS_BF16 = 4


def int8_kernel_max_rows(dtype: torch.dtype, device: torch.device) -> int:
    """Rows up to which ``_weight_int8pack_mm`` is used; 0 where it was measured to lose."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return 0
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return 0
    return INT8_KERNEL_MAX_ROWS_BF16


class WeightOnlyInt8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.kernel_max_rows = int8_kernel_max_rows(scales.dtype, qweight.device)
        self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out], compute dtype
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> WeightOnlyInt8Linear:
        qweight, scales = quantize_int8(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qweight, scales.to(linear.weight.dtype), bias)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.kernel_max_rows:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(rows, self.dequantized(), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight ~= q * scale``; returns (q, float32 scale)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_model(model: Any, mode: str) -> int:
    """Replace the model's linears by weight-only quantized ones, in place (on the model's
    final device: the kernel choice depends on it). Returns how many were replaced (0 for
    ``full``)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; use one of {', '.join(WEIGHT_MODES)}")
    if mode == "full":
        return 0
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, WeightOnlyInt8Linear.from_linear(linear))
    # The LM head no longer shares its weight with the embedding: keep transformers from
    # re-tying them (e.g. on a later ``tie_weights`` call).
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
        text = getattr(config, "get_text_config", lambda: config)()
        text.tie_word_embeddings = False
    return len(targets)
