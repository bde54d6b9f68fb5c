"""The lean forward of Gemma 4 (``Gemma4ForCausalLM``, and the text model inside
``Gemma4ForConditionalGeneration``): transformers' decoder layer walked op for op, as
``lean_forward.LeanForward`` walks the Llama-like families, so its logits are bitwise the
module path's (tested) with less Python per step.

A Gemma 4 layer: norm -> attention (query, key and value heads normalized, the value norm
without a weight; keys as values on global layers that have no value projection; each
layer kind its own rotary frequencies and head size; layers past ``num_kv_shared_layers``
attend over the KV the last earlier layer of their kind computed in this step) -> norm ->
residual -> norm -> gated MLP, and beside it where the layer has experts the routed experts
(their own norms; the router reads the residual) -> norm -> residual -> the per-layer input
gate (E2B/E4B) -> times the layer's scalar. The logits are soft-capped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvcellar.engine.attention import StepMeta, paged_attention
from kvcellar.engine.experts import RoutedExperts, Router
from kvcellar.engine.linears import call_of as _linear
from kvcellar.engine.linears import call_together

CAUSAL_LMS = frozenset({"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"})


def text_model(model: Any) -> Any | None:
    """The Gemma 4 text model inside ``model`` (its ``language_model`` for the multimodal class)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", inner)


class _Layer:
    def __init__(self, layer: Any, shared: bool) -> None:
        attn = layer.self_attn
        self.attn: nn.Module = attn
        self.kind: str = attn.layer_type
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.window: int | None = attn.sliding_window
        self.shared = shared  # reads the KV of the last earlier layer of its kind
        self.stores = bool(attn.store_full_length_kv)
        self.q, self.o = _linear(attn.q_proj), _linear(attn.o_proj)
        self.q_norm = attn.q_norm.forward
        self.k = self.v = self.k_norm = self.v_norm = None
        if not shared:
            self.k = _linear(attn.k_proj)
            self.v = _linear(attn.v_proj) if attn.v_proj is not None else None
            self.k_norm, self.v_norm = attn.k_norm.forward, attn.v_norm.forward
        mlp = layer.mlp
        self.gate_up, self.down = call_together([mlp.gate_proj, mlp.up_proj]), _linear(mlp.down_proj)
        self.act: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn
        self.input_norm = layer.input_layernorm.forward
        self.post_attn_norm = layer.post_attention_layernorm.forward
        self.pre_ff_norm = layer.pre_feedforward_layernorm.forward
        self.post_ff_norm = layer.post_feedforward_layernorm.forward
        self.router: Router | None = None
        self.experts: RoutedExperts | None = None
        if layer.enable_moe_block:
            self.router, self.experts = layer.router, layer.experts
            self.post_ff_norm_1 = layer.post_feedforward_layernorm_1.forward
            self.pre_ff_norm_2 = layer.pre_feedforward_layernorm_2.forward
            self.post_ff_norm_2 = layer.post_feedforward_layernorm_2.forward
        self.per_layer = bool(layer.hidden_size_per_layer_input)
        if self.per_layer:
            self.pl_gate = _linear(layer.per_layer_input_gate)
            self.pl_act: Callable[[torch.Tensor], torch.Tensor] = layer.act_fn
            self.pl_proj = _linear(layer.per_layer_projection)
            self.pl_norm = layer.post_per_layer_input_norm.forward
        self.scalar: torch.Tensor = layer.layer_scalar


def gemma4_forward_for(model: Any) -> Gemma4Forward | None:
    """A ``Gemma4Forward`` over ``model``, or None where its parts are not the ones this file
    walks (any other class, experts or routers run by transformers' code)."""
    if type(model).__name__ not in CAUSAL_LMS:
        return None
    inner = text_model(model)
    layers = getattr(inner, "layers", None)
    if inner is None or not layers or any(type(layer).__name__ != "Gemma4TextDecoderLayer" for layer in layers):
        return None
    for layer in layers:
        if layer.enable_moe_block and not (isinstance(layer.experts, RoutedExperts)
                                           and isinstance(layer.router, Router)):
            return None
    rope = getattr(sys.modules[type(layers[0]).__module__], "apply_rotary_pos_emb", None)
    if rope is None or getattr(inner.config, "use_bidirectional_attention", None) is not None:
        return None
    return Gemma4Forward(model, inner, rope)


class Gemma4Forward:
    def __init__(self, model: Any, inner: Any, rope: Callable[..., torch.Tensor]) -> None:
        config = inner.config
        self.inner = inner
        self.rope = rope
        first_shared = config.num_hidden_layers - config.num_kv_shared_layers
        self.layers = [_Layer(layer, i >= first_shared) for i, layer in enumerate(inner.layers)]
        self.kinds = sorted({layer.kind for layer in self.layers})
        self.per_layer = bool(inner.hidden_size_per_layer_input)
        self.norm = inner.norm.forward
        self.lm_head = _linear(model.lm_head)
        self.softcap: float | None = model.config.get_text_config().final_logit_softcapping

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 meta: StepMeta) -> torch.Tensor:
        """Logits ``[1, len(logits_to_keep), vocab]`` of the packed step (``ModelRunner.build``)."""
        inner, rope = self.inner, self.rope
        h = inner.embed_tokens(input_ids)
        per_layer = None
        if self.per_layer:
            per_layer = inner.project_per_layer_inputs(h, inner.get_per_layer_inputs(input_ids, h))
        positions = {kind: inner.rotary_emb(h, position_ids, kind) for kind in self.kinds}
        lead = h.shape[:-1]
        shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            cos, sin = positions[layer.kind]
            residual = h
            x = layer.input_norm(h)
            shape = (*lead, -1, layer.head_dim)
            q = rope(layer.q_norm(layer.q(x).view(shape)), cos, sin, unsqueeze_dim=2).transpose(1, 2)
            if layer.shared:
                k, v = shared[layer.kind]
            else:
                assert layer.k is not None and layer.k_norm is not None and layer.v_norm is not None
                k = layer.k(x).view(shape)
                v = layer.v(x).view(shape) if layer.v is not None else k
                k = rope(layer.k_norm(k), cos, sin, unsqueeze_dim=2).transpose(1, 2)
                v = layer.v_norm(v).transpose(1, 2)
            if layer.stores:
                shared[layer.kind] = k, v
            o, _ = paged_attention(layer.attn, q, k, v, None, scaling=layer.scaling, sliding_window=layer.window,
                                   kvcellar_meta=meta)
            h = residual + layer.post_attn_norm(layer.o(o.reshape(*lead, -1).contiguous()))
            residual = h
            x = layer.pre_ff_norm(h)
            gate, up = layer.gate_up(x)
            x = layer.down(layer.act(gate) * up)
            if layer.experts is not None and layer.router is not None:
                flat = residual.reshape(-1, residual.shape[-1])
                _, weights, index = layer.router.forward(flat)
                routed = layer.experts.forward(layer.pre_ff_norm_2(flat), index, weights).reshape(residual.shape)
                x = layer.post_ff_norm_1(x) + layer.post_ff_norm_2(routed)
            h = residual + layer.post_ff_norm(x)
            if layer.per_layer and per_layer is not None:
                gated = layer.pl_act(layer.pl_gate(h)) * per_layer[:, :, i, :]
                h = h + layer.pl_norm(layer.pl_proj(gated))
            h = h * layer.scalar
        logits = self.lm_head(self.norm(h)[:, logits_to_keep, :])
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
