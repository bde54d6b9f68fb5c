"""Hybrid models' linear attention on kvcellar's kernels (``recurrent.c``): the gated delta
rule for every row of a step in one call, each row continuing its sequence's state slot, the
same arithmetic for a prefill chunk's rows and a decode batch's; and the elementwise work
before and after it (``delta_inputs``, ``gated_norm``), a call each for all of a step's rows."""

from __future__ import annotations

import torch

from kvcellar.engine.native import lib

# The revision of the numbers ``gated_delta`` computes (part of a hybrid model's KV namespace):
# bumped whenever a change moves a bit of its output. 2: the rule's inputs and the gated norm
# by ``delta_inputs`` and ``gated_norm``. 3: a bf16 model's gated norm by ``gated_norm`` too, and
# the hybrid walk's RMS norms and MLP silu on the kernels (``lean_qwen35``) where these run.
RECURRENCE = "kvc-delta-3"


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


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def delta_inputs(conv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
                 key_heads: int, key_dim: int, scale: float,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's rule inputs from its convolved channels ``conv [rows, 2 *
    key_heads * key_dim + value_heads * value_dim]`` (before their SiLU) and its gate
    projections ``a, b [rows, value_heads]``: q and k (SiLU, L2-normalized with ``eps``, q times
    ``scale``, each key head repeated to its value heads) ``[rows, value_heads, key_dim]``, v
    (SiLU) ``[rows, value_heads, value_dim]``, ``decay = exp(neg_a * softplus(a + dt_bias))`` and
    ``beta = sigmoid(b)`` ``[rows, value_heads]``, float32."""
    rows, channels = conv.shape
    value_heads = a.shape[-1]
    value_size = channels - 2 * key_heads * key_dim
    if value_size <= 0 or value_size % value_heads or value_heads % key_heads or b.shape != a.shape \
            or a.shape[0] != rows or neg_a.numel() != value_heads or dt_bias.numel() != value_heads:
        raise ValueError(f"delta_inputs: conv {tuple(conv.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"{key_heads} key heads of {key_dim}")
    value_dim = value_size // value_heads
    conv, a, b, neg_a, dt_bias = map(_f32, (conv, a, b, neg_a, dt_bias))
    q = torch.empty((rows, value_heads, key_dim), dtype=torch.float32)
    k = torch.empty_like(q)
    v = torch.empty((rows, value_heads, value_dim), dtype=torch.float32)
    decay = torch.empty((rows, value_heads), dtype=torch.float32)
    beta = torch.empty_like(decay)
    rc = lib.call("kvc_delta_inputs", conv=conv.data_ptr(), a=a.data_ptr(), b=b.data_ptr(), neg_a=neg_a.data_ptr(),
                  dt_bias=dt_bias.data_ptr(), rows=rows, key_heads=key_heads, key_dim=key_dim,
                  value_heads=value_heads, value_dim=value_dim, scale=scale, eps=eps, q=q.data_ptr(),
                  k=k.data_ptr(), v=v.data_ptr(), decay=decay.data_ptr(), beta=beta.data_ptr(),
                  threads=torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"kvc_delta_inputs refused its arguments ({rc})")
    return q, k, v, decay, beta


def gated_norm(core: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen3_5RMSNormGated`` in float32: ``core [rows, heads, dim]`` RMS-normalized
    per head, times ``weight [dim]``, times SiLU of the gate ``z`` (``rows * heads * dim``
    values). Returns ``[rows, heads * dim]``."""
    rows, heads, dim = core.shape
    if z.numel() != core.numel() or weight.numel() != dim:
        raise ValueError(f"gated_norm: core {tuple(core.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    core, z, weight = map(_f32, (core, z, weight))
    out = torch.empty((rows, heads * dim), dtype=torch.float32)
    rc = lib.call("kvc_gated_norm", core=core.data_ptr(), z=z.data_ptr(), weight=weight.data_ptr(), rows=rows,
                  heads=heads, dim=dim, eps=eps, out=out.data_ptr(), threads=torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"kvc_gated_norm refused its arguments ({rc})")
    return out


def delta_conv(x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, captures: torch.Tensor,
               weight_t: torch.Tensor) -> torch.Tensor:
    """The causal convolution of rows ``x [rows, channels]``, each continuing the inputs kept in
    ``states[slot]`` (``states [slots, channels, taps - 1]``, oldest first, updated in place; rows
    of one slot in order), the state after row r copied into slot ``captures[r]`` unless it is
    -1; ``weight_t [taps, channels]`` (the depthwise weight transposed). Returns the convolved
    rows ``[rows, channels]`` (before their activation), float32."""
    rows, channels = x.shape
    taps = weight_t.shape[0]
    if states.dtype != torch.float32 or not states.is_contiguous() or tuple(states.shape[1:]) != (channels, taps - 1) \
            or tuple(weight_t.shape) != (taps, channels):
        raise ValueError(f"delta_conv: x {tuple(x.shape)}, states {tuple(states.shape)} {states.dtype}, "
                         f"weight {tuple(weight_t.shape)}")
    slots = slots.to(torch.int64).contiguous()
    captures = captures.to(torch.int64).contiguous()
    if slots.numel() != rows or captures.numel() != rows:
        raise ValueError(f"delta_conv: {rows} rows, {slots.numel()} slots, {captures.numel()} captures")
    x, weight_t = _f32(x), _f32(weight_t)
    out = torch.empty((rows, channels), dtype=torch.float32)
    rc = lib.call("kvc_delta_conv", x=x.data_ptr(), states=states.data_ptr(), n_slots=states.shape[0],
                  slots=slots.data_ptr(), captures=captures.data_ptr(), weight=weight_t.data_ptr(), rows=rows,
                  channels=channels, taps=taps, out=out.data_ptr(), threads=torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"kvc_delta_conv refused its arguments ({rc}): a slot outside the state pool?")
    return out
