"""The forward of the hybrid Qwen3.5/3.6 text models (``Qwen3_5ForCausalLM``, and
``Qwen3_5MoeForCausalLM``: routed experts and a gated shared expert for the MLP): three Gated
DeltaNet layers (``engine/deltanet.py``) to one gated full-attention layer, walked op for op
over transformers' weights.

transformers' own modules cannot run a packed step: their linear attention keeps its state in
a ``Cache`` object per batch row and computes prompts in 64-token chunks. This walk is the
only path these models take (``lean_forward = false`` does not apply to them). Its attention
layers are transformers' (the query projection holds each head's query and output gate side
by side; query and key heads RMS-normalized, partial RoPE) over the paged KV pool, which holds
only these layers (pool layer ``i``: the ``i``-th attention layer); the linear-attention
layers continue each sequence's recurrent state (``cache/state_pool.py``). Every RMS norm is
the zero-centred one, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32. Where kvcellar's
kernels run the linear attention (the KV namespace then names their revision,
``native.RECURRENCE``), the norms and the MLPs' silu run on them too: one call each where torch
took ~10 operations, or a silu in single-threaded pieces (``rowwise``) and their concatenation.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcellar.engine import native
from kvcellar.engine.attention import StepMeta, paged_attention
from kvcellar.engine.deltanet import GatedDeltaNet, rowwise
from kvcellar.engine.experts import RoutedExperts, Router
from kvcellar.engine.linears import call_of as _linear
from kvcellar.engine.linears import call_together, logits_call_of
from kvcellar.engine.native.layer import SILU_ACTS, silu_for
from kvcellar.engine.native.norm import rms_norm_for

CAUSAL_LMS = frozenset({"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"})


def is_hybrid(model: Any) -> bool:
    """A model with linear-attention layers (they need the state pool and this walk)."""
    text = model.config.get_text_config()
    return "linear_attention" in (getattr(text, "layer_types", None) or ())


@dataclass(frozen=True)
class _PoolLayer:
    layer_idx: int  # what ``paged_attention`` reads: the layer's place in the KV pool


def _zero_centred_norm(module: Any, kernels: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ``Qwen3_5RMSNorm``, op for op (its ``1 + w`` computed once); ``kernels``: on
    kvcellar's kernels where they take it (``native.rms_norm_for``, the weight applied before the
    one rounding, as here; its own order of sums)."""
    scale, eps = 1.0 + module.weight.float(), float(module.eps)

    def norm(x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out: torch.Tensor = (h * scale).type_as(x)
        return out

    fast = rms_norm_for(scale, eps, True, norm) if kernels else None
    return fast or norm


class _Attention:
    def __init__(self, attn: Any, index: int, kernels: bool) -> None:
        self.pool_layer = _PoolLayer(index)
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.qkv = call_together([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = _linear(attn.o_proj)
        self.q_norm, self.k_norm = _zero_centred_norm(attn.q_norm, kernels), _zero_centred_norm(attn.k_norm, kernels)


class _MLP:
    """A gated MLP (the dense models', the MoE models' shared expert)."""

    def __init__(self, mlp: Any, kernels: bool) -> None:
        self.gate_up = call_together([mlp.gate_proj, mlp.up_proj])
        self.down = _linear(mlp.down_proj)
        act: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn
        fast = silu_for(functools.partial(rowwise, act)) if kernels and type(act).__name__ in SILU_ACTS else None
        self.act: Callable[[torch.Tensor], torch.Tensor] = fast or functools.partial(rowwise, act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(self.act(gate) * up)


class _Experts:
    """The MoE models' block: routed experts (kvcellar's, ``engine/experts.py``) plus a shared
    expert scaled by a sigmoid gate of its own."""

    def __init__(self, block: Any, kernels: bool) -> None:
        if not isinstance(block.gate, Router) or not isinstance(block.experts, RoutedExperts):
            raise ValueError("a Qwen3.5 MoE block whose experts were not split (engine/experts.py)")
        self.router, self.experts = block.gate, block.experts
        self.shared = _MLP(block.shared_expert, kernels)
        self.shared_gate = _linear(block.shared_expert_gate)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1, x.shape[-1])
        _, weights, index = self.router.forward(flat)
        routed = self.experts.forward(flat, index, weights)
        shared = rowwise(torch.sigmoid, self.shared_gate(flat)) * self.shared(flat)
        return (routed + shared).view(x.shape)


class _Layer:
    def __init__(self, layer: Any, mixer: _Attention | GatedDeltaNet, kernels: bool) -> None:
        self.mixer = mixer
        mlp = layer.mlp
        self.mlp: _MLP | _Experts = _Experts(mlp, kernels) if hasattr(mlp, "experts") else _MLP(mlp, kernels)
        self.input_norm = _zero_centred_norm(layer.input_layernorm, kernels)
        self.post_norm = _zero_centred_norm(layer.post_attention_layernorm, kernels)


def qwen35_forward_for(model: Any) -> Qwen35Forward | None:
    """The walk over ``model``, or None if it is not a Qwen3.5 text model this file knows."""
    if type(model).__name__ not in CAUSAL_LMS:
        return None
    layers = model.model.layers
    rope = getattr(sys.modules[type(layers[0]).__module__], "apply_rotary_pos_emb", None)
    if rope is None or len(layers) != model.config.num_hidden_layers:
        return None
    return Qwen35Forward(model, rope)


class Qwen35Forward:
    def __init__(self, model: Any, rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        inner = model.model
        self.embed: Callable[[torch.Tensor], torch.Tensor] = inner.embed_tokens
        self.rotary: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = inner.rotary_emb
        self.rope = rope
        self.layers: list[_Layer] = []
        text = model.config.get_text_config()
        # the recurrence's kernels decide it (the KV namespace then names their revision)
        kernels = native.runs_gated_delta(inner.norm.weight.device, int(text.linear_value_head_dim))
        attention = linear = 0
        for layer in inner.layers:
            mixer: _Attention | GatedDeltaNet
            if hasattr(layer, "linear_attn"):
                mixer, linear = GatedDeltaNet(layer.linear_attn, linear, _linear, call_together), linear + 1
            else:
                mixer, attention = _Attention(layer.self_attn, attention, kernels), attention + 1
            self.layers.append(_Layer(layer, mixer, kernels))
        self.norm = _zero_centred_norm(inner.norm, kernels)
        self.lm_head = logits_call_of(model.lm_head)  # float32 logits

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 meta: StepMeta) -> torch.Tensor:
        """Logits ``[1, len(logits_to_keep), vocab]`` of the packed step (``ModelRunner.build``)."""
        if meta.recurrent is None:
            raise RuntimeError("a hybrid model's step needs its recurrent-state slots (StepMeta.recurrent)")
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, position_ids)
        lead = h.shape[:-1]
        for layer in self.layers:
            x = layer.input_norm(h)
            mixer = layer.mixer
            if isinstance(mixer, GatedDeltaNet):
                h = h + mixer(x, meta.recurrent)
            else:
                h = h + self._attend(mixer, x, cos, sin, meta, lead)
            h = h + layer.mlp(layer.post_norm(h))
        h = self.norm(h)
        return self.lm_head(h[:, logits_to_keep, :])

    def _attend(self, attn: _Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: StepMeta,
                lead: torch.Size) -> torch.Tensor:
        shape = (*lead, -1, attn.head_dim)
        q, k, v = attn.qkv(x)
        q, gate = torch.chunk(q.view(*lead, -1, attn.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*lead, -1)
        q = attn.q_norm(q.reshape(shape)).transpose(1, 2)
        k = attn.k_norm(k.view(shape)).transpose(1, 2)
        v = v.view(shape).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        o, _ = paged_attention(attn.pool_layer, q, k, v, None, scaling=attn.scaling, kvcellar_meta=meta)
        o = o.reshape(*lead, -1).contiguous()
        return attn.o(o * rowwise(torch.sigmoid, gate))
