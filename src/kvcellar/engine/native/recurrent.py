"""Hybrid models' linear attention on kvcellar's kernels (``recurrent.c``): the gated delta
rule for every row of a step in one call, each row continuing its sequence's state slot, the
same arithmetic for a prefill chunk's rows and a decode batch's."""

from __future__ import annotations

import torch

from kvcellar.engine.native import lib

# The revision of the numbers ``gated_delta`` computes (part of a hybrid model's KV namespace):
# bumped whenever a change moves a bit of its output.
RECURRENCE = "kvc-delta-1"


def runs_gated_delta(device: torch.device, value_dim: int) -> bool:
    """Whether ``gated_delta`` takes heads of ``value_dim`` values on ``device``."""
    return device.type == "cpu" and value_dim % 8 == 0 and lib.available()


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                states: torch.Tensor, slots: torch.Tensor, captures: torch.Tensor) -> torch.Tensor:
    """Rows ``q, k [rows, heads, key_dim]`` (normalized, q scaled), ``v [rows, heads,
    value_dim]``, ``decay``, ``beta [rows, heads]``, each continuing the state ``states[slot]``
    (``states [slots, heads, key_dim, value_dim]``, updated in place; rows of one slot in
    order), the state after row r copied into slot ``captures[r]`` unless it is -1. Returns
    ``o [rows, heads, value_dim]``, float32."""
    rows, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    f32 = [t.contiguous() for t in (q, k, v, decay, beta)]
    if any(t.dtype != torch.float32 for t in (*f32, states)) or not states.is_contiguous():
        raise ValueError("gated_delta takes float32 tensors and a contiguous state")
    if tuple(states.shape[1:]) != (heads, key_dim, value_dim) or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"gated_delta: q {tuple(q.shape)}, v {tuple(v.shape)}, states {tuple(states.shape)}")
    slots = slots.to(torch.int64).contiguous()
    captures = captures.to(torch.int64).contiguous()
    if slots.numel() != rows or captures.numel() != rows:
        raise ValueError(f"gated_delta: {rows} rows, {slots.numel()} slots, {captures.numel()} captures")
    out = torch.empty((rows, heads, value_dim), dtype=torch.float32)
    q, k, v, decay, beta = f32
    rc = lib.call("kvc_gated_delta", q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), decay=decay.data_ptr(),
                  beta=beta.data_ptr(), states=states.data_ptr(), n_slots=states.shape[0], slots=slots.data_ptr(),
                  captures=captures.data_ptr(), rows=rows, heads=heads, key_dim=key_dim, value_dim=value_dim,
                  out=out.data_ptr(), threads=torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"kvc_gated_delta refused its arguments ({rc}): a slot outside the state pool?")
    return out
