"""Weight-only int8 linears for decode (``--weights int8``).

A batch-1 decode step is bound by reading the weights: 269 MB of bf16 per step for the
embedded model. Each ``nn.Linear`` of the decoder layers (and the LM head) becomes a
``WeightOnlyInt8Linear``: int8 weights with one scale per output channel (symmetric,
``w ~= q * scale``), half the bytes. Activations stay in the compute dtype.

Two kernels, picked per call by the number of rows (tokens in the step):

* up to ``INT8_KERNEL_MAX_ROWS`` rows: ``torch.ops.aten._weight_int8pack_mm``, torch's own
  CPU kernel that reads the int8 weights directly (decode, short tails);
* more rows: the weight is dequantized to the compute dtype for that call and multiplied by
  oneDNN (prefill chunks); the int8 kernel does not block over rows and loses there
  (measured: 1.6x faster than bf16 ``linear`` at 1 row, 1.4x slower at 8, far slower at
  prefill sizes). The cut-off is the measured cross-over (docs/performance.md).

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
# Rows up to which the int8 kernel beats dequantize + oneDNN (measured cross-over, bf16, 2 cores).
INT8_KERNEL_MAX_ROWS = 4


class WeightOnlyInt8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
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
        if rows.shape[0] <= INT8_KERNEL_MAX_ROWS and rows.device.type == "cpu":
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
    """Replace the model's linears by weight-only quantized ones, in place. Returns how many
    were replaced (0 for ``full``)."""
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
