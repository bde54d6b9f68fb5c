"""A lean forward for supported architectures, over transformers' own weights and functions.

transformers' model code runs each step through ~15 module calls per layer (hooks, keyword
plumbing, the attention-interface lookup, output dataclasses) and builds a causal mask our
paged attention never reads. ``LeanForward`` walks the same layers itself: the same weight
tensors, the same functions in the same order (the model's own ``apply_rotary_pos_emb``,
``act_fn`` and rotary module, RMSNorm written out exactly as transformers computes it or, on
CPU, kvcellar's kernel, which the model's norm modules then run too; our ``paged_attention``),
so its logits are bitwise those of the module path (tested), with less Python per step. The
linears are those ``engine/linears.py`` prepared (prepacked, quantized, QKV and gate-up fused
into one call each: the module path calls the same fused linear and slices it, so both paths
still give the same numbers). On CPU the gated MLP's silu is kvcellar's kernel too (the
module runs it as well), and where every part of a Llama/Qwen2/Qwen3 layer runs on the kernels a
decode-sized step runs all layers in one call (``native.DenseLayers``), the same operations
rounded as torch rounds them: the same bits again, without Python between a layer's kernels.

Supported: the Llama, Qwen2, Qwen3, Qwen3-MoE and gpt-oss families (``SUPPORTED``), Gemma 4
(its own walk, ``engine/lean_gemma4.py``) and the hybrid Qwen3.5 (``engine/lean_qwen35.py``,
the only path that runs it). The first ones' decoder layer is norm -> attention ->
residual -> norm -> gated MLP or routed experts -> residual (Qwen3's attention normalizes each
query and key head before RoPE; gpt-oss's has a sink per head and its norms multiply by the
weight before rounding). Anything else, or a model whose parts differ from what this file
expects, runs through transformers' modules
(``lean_forward = false`` in ``[engine]``, or ``KVCELLAR_LEAN_FORWARD=0``, forces that).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvcellar.engine.attention import StepMeta, paged_attention, record_direct_paths
from kvcellar.engine.experts import RoutedExperts, Router
from kvcellar.engine.lean_gemma4 import CAUSAL_LMS as GEMMA4_CAUSAL_LMS
from kvcellar.engine.lean_gemma4 import Gemma4Forward, gemma4_forward_for
from kvcellar.engine.lean_qwen35 import CAUSAL_LMS as QWEN35_CAUSAL_LMS
from kvcellar.engine.lean_qwen35 import Qwen35Forward, qwen35_forward_for
from kvcellar.engine.linears import FastLinear, FusedPart, call_together, kernel_group, logits_call_of
from kvcellar.engine.linears import call_of as _linear
from kvcellar.engine.native.layer import SILU_ACTS, DenseLayer, DenseLayers, silu_for
from kvcellar.engine.native.lib import available as lib_available
from kvcellar.engine.native.norm import rms_norm_for

# CausalLM class -> the decoder layer class it must hold.
SUPPORTED = {"LlamaForCausalLM": "LlamaDecoderLayer", "Qwen2ForCausalLM": "Qwen2DecoderLayer",
             "Qwen3ForCausalLM": "Qwen3DecoderLayer", "Qwen3MoeForCausalLM": "Qwen3MoeDecoderLayer",
             "GptOssForCausalLM": "GptOssDecoderLayer"}
# Families whose RMSNorm multiplies by its weight before rounding to the input's dtype
# (``(w * h).to(dtype)``, the weight kept in float32), not after.
WEIGHT_FIRST_NORM = frozenset({"GptOssForCausalLM"})
# Families whose rotary module gives half-width cos/sin (their own RoPE function applies them).
HALF_ROPE = frozenset({"GptOssForCausalLM"})


def _rotate_joint(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama/Qwen2 RoPE (transformers' ``apply_rotary_pos_emb``, op for op) on query and key
    heads side by side ``[1, Hq + Hkv, T, D]``: one set of elementwise ops instead of two,
    the same numbers."""
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return (qk * cos) + (rotated * sin)


def fusion_groups(model: Any) -> list[tuple[str, list[str]]]:
    """The linears ``linears.prepare_model`` fuses for a supported architecture: per layer
    q/k/v into ``<layer>.self_attn.qkv`` and gate/up into ``<layer>.mlp.gate_up`` (none for
    Gemma 4, whose walk calls each linear)."""
    if not isinstance(lean_forward_for(model), LeanForward):
        return []
    groups: list[tuple[str, list[str]]] = []
    for i in range(len(model.model.layers)):
        path = f"model.layers.{i}"
        groups.append((f"{path}.self_attn.qkv", [f"{path}.self_attn.{p}_proj" for p in "qkv"]))
        if hasattr(model.model.layers[i].mlp, "gate_proj"):  # routed experts have their own linears
            groups.append((f"{path}.mlp.gate_up", [f"{path}.mlp.gate_proj", f"{path}.mlp.up_proj"]))
    return groups


def _rms_norm(module: Any, weight: torch.Tensor | None = None, weight_first: bool = False,
              kernels: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' LlamaRMSNorm/Qwen2RMSNorm/Qwen3RMSNorm forward, op for op (GptOssRMSNorm's
    where ``weight_first``); ``weight``: another than the module's that broadcasts the same
    way (every element gets the same operations). ``kernels``: on kvcellar's kernels where they
    run it (``native.rms_norm_for``: its own order of sums); the module then runs it too, so the
    module path keeps the lean path's numbers."""
    eps: float = module.variance_epsilon
    scale = module.weight if weight is None else weight

    def norm(x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + eps)
        return (scale * h).to(dtype) if weight_first else scale * h.to(dtype)

    if kernels and weight is None:
        fast = rms_norm_for(module.weight, eps, weight_first, norm)
        if fast is not None:
            module.forward = fast
            return fast
    return norm


class _Layer:
    def __init__(self, layer: Any, weight_first_norm: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn: nn.Module = attn
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        self.sliding_window: int | None = getattr(attn, "sliding_window", None)
        self.sinks: torch.Tensor | None = getattr(attn, "sinks", None)  # gpt-oss: a sink logit per head
        # Fused QKV / gate-up where ``linears.prepare_model`` fused them: one call, then views.
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        self.qkv: Callable[[torch.Tensor], torch.Tensor] | None = (
            q.fused if isinstance(q, FusedPart) and k.fused is q.fused and v.fused is q.fused else None)
        self.qkv_sizes: list[int] = [q.out_features, k.out_features, v.out_features]
        self.qk_heads: int = (q.out_features + k.out_features) // self.head_dim
        self.q_heads: int = q.out_features // self.head_dim
        self.q_k_v = call_together([q, k, v])  # unfused: one call where their kernel allows
        self.o = _linear(attn.o_proj)
        # Qwen3: each query and key head RMS-normalized before RoPE; side by side (joint RoPE)
        # as one norm over the heads, whose weights are the two norms' own.
        # On kvcellar's kernels where they run (the modules then run them too), else torch's.
        self.q_norm = self.k_norm = self.qk_norm = None
        if hasattr(attn, "q_norm"):
            self.q_norm, self.k_norm = _rms_norm(attn.q_norm, kernels=True), _rms_norm(attn.k_norm, kernels=True)
            on_kernels = "forward" in vars(attn.q_norm) or "forward" in vars(attn.k_norm)
            if not on_kernels and attn.q_norm.variance_epsilon == attn.k_norm.variance_epsilon:
                kv_heads = k.out_features // self.head_dim
                joint = torch.cat([attn.q_norm.weight.expand(self.q_heads, -1),
                                   attn.k_norm.weight.expand(kv_heads, -1)])
                self.qk_norm = _rms_norm(attn.q_norm, joint)
        # Routed experts (Qwen3-MoE) or a gated MLP.
        self.router: Router | None = None
        self.experts: RoutedExperts | None = None
        if isinstance(getattr(mlp, "experts", None), RoutedExperts):
            self.router, self.experts = _router(mlp), mlp.experts
            fused_gate_up = None
        else:
            gate, up = mlp.gate_proj, mlp.up_proj
            fused_gate_up = gate.fused if isinstance(gate, FusedPart) and up.fused is gate.fused else None
            self.gate_up_sizes: list[int] = [gate.out_features, up.out_features]
            self.gate_and_up = call_together([gate, up])
            self.down = _linear(mlp.down_proj)
            self.act: Callable[[torch.Tensor], torch.Tensor] = _act(mlp.act_fn)
        self.gate_up: Callable[[torch.Tensor], torch.Tensor] | None = fused_gate_up
        self.input_norm = _rms_norm(layer.input_layernorm, weight_first=weight_first_norm, kernels=True)
        self.post_norm = _rms_norm(layer.post_attention_layernorm, weight_first=weight_first_norm, kernels=True)


def _act(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gated MLP's act: silu on kvcellar's kernels where they run it (``native.silu_for``: its
    own exp), which the module then runs too, as the norms; the module otherwise."""
    if type(module).__name__ in SILU_ACTS:
        fast = silu_for(functools.partial(type(module).forward, module))
        if fast is not None:
            module.forward = fast
            return fast
    act: Callable[[torch.Tensor], torch.Tensor] = module
    return act


def _kernel_linear(modules: list[Any],
                   dtype: torch.dtype) -> tuple[torch.Tensor, Any, list[torch.Tensor | None]] | None:
    """Linears that take the same input (one, fused or not, or a group) as ``layer.c`` runs
    them: ``kvc_linear``'s spec, what keeps its addresses alive, and each linear's bias."""
    if not all(isinstance(m, FastLinear) and m.dtype == dtype and m.out_features % 8 == 0 for m in modules):
        return None
    if any(m.bias is not None and m.bias.dtype != dtype for m in modules):
        return None
    owner: Any = modules[0] if len(modules) == 1 else kernel_group(modules)
    spec = None if owner is None else (owner.kernel_spec() if len(modules) == 1 else owner.spec)
    if spec is None or int(spec[1]) != len(modules):
        return None
    return spec, owner, [None if m.bias is None else m.bias.contiguous() for m in modules]


def _dense_layers(model: Any, layers: list[_Layer], joint_rope: bool) -> DenseLayers | None:
    """The layers as ``native.DenseLayers`` runs them in one call a step, where every part is
    one it runs (Llama/Qwen2/Qwen3: norms, Qwen3's per-head ones too, silu and every linear on
    the kernels, rotate-half RoPE, no sinks or windows); None otherwise."""
    dtype = model.dtype
    if not joint_rope or dtype not in (torch.float32, torch.bfloat16) or model.device.type != "cpu":
        return None
    parts = []
    for walk, layer in zip(layers, model.model.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        q_norm: Any = getattr(attn, "q_norm", None)
        k_norm: Any = getattr(attn, "k_norm", None)
        if q_norm is not None and (walk.q_norm is not getattr(q_norm, "forward", None)
                                   or walk.k_norm is not getattr(k_norm, "forward", None)
                                   or q_norm.variance_epsilon != k_norm.variance_epsilon):
            return None
        if (walk.experts is not None or walk.sinks is not None
                or walk.sliding_window is not None or walk.act is not getattr(mlp.act_fn, "forward", None)
                or walk.input_norm is not getattr(layer.input_layernorm, "forward", None)
                or walk.post_norm is not getattr(layer.post_attention_layernorm, "forward", None)
                or walk.head_dim % 16 or walk.q_heads % (walk.qkv_sizes[1] // walk.head_dim)
                or walk.gate_up_sizes[0] != walk.gate_up_sizes[1]):
            return None
        linears = (_kernel_linear([walk.qkv] if walk.qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj],
                                  dtype),
                   _kernel_linear([attn.o_proj], dtype),
                   _kernel_linear([walk.gate_up] if walk.gate_up is not None else [mlp.gate_proj, mlp.up_proj], dtype),
                   _kernel_linear([mlp.down_proj], dtype))
        norms = layer.input_layernorm, layer.post_attention_layernorm
        if any(linear is None for linear in linears) or norms[0].variance_epsilon != norms[1].variance_epsilon:
            return None
        head_norms = None if q_norm is None else (q_norm.weight.detach().float().contiguous(),
                                                  k_norm.weight.detach().float().contiguous(),
                                                  float(q_norm.variance_epsilon))
        parts.append(DenseLayer(walk.q_heads, walk.qkv_sizes[1] // walk.head_dim, walk.head_dim,
                                walk.gate_up_sizes[0], norms[0].weight.detach().float().contiguous(),
                                norms[1].weight.detach().float().contiguous(), norms[0].variance_epsilon,
                                walk.scaling, tuple(linear for linear in linears if linear is not None), head_norms))
    hidden = model.config.get_text_config().hidden_size
    return DenseLayers(parts, hidden, dtype) if hidden % 8 == 0 else None


def _router(mlp: Any) -> Router | None:
    """A MoE block's router: ``gate`` (Qwen MoE) or ``router`` (gpt-oss), where it is kvcellar's."""
    router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
    return router if isinstance(router, Router) else None


def lean_forward_for(model: Any) -> LeanForward | Gemma4Forward | Qwen35Forward | None:
    """A ``LeanForward`` (or Gemma 4's or Qwen3.5's walk) over ``model``, or None if its
    architecture is not one reproduced exactly."""
    if type(model).__name__ in GEMMA4_CAUSAL_LMS:
        return gemma4_forward_for(model)
    if type(model).__name__ in QWEN35_CAUSAL_LMS:
        return qwen35_forward_for(model)
    layer_class = SUPPORTED.get(type(model).__name__)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layer_class is None or inner is None or not layers:
        return None
    if any(type(layer).__name__ != layer_class for layer in layers):
        return None
    rope = getattr(sys.modules[type(layers[0]).__module__], "apply_rotary_pos_emb", None)
    norms = [inner.norm, *(n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)),
             *(getattr(layer.self_attn, n) for layer in layers for n in ("q_norm", "k_norm")
               if hasattr(layer.self_attn, n))]
    for layer in layers:  # a MoE block runs as kvcellar's (``engine/experts.py``) or not here
        mlp = layer.mlp
        if hasattr(mlp, "experts") and not (isinstance(mlp.experts, RoutedExperts) and _router(mlp) is not None):
            return None
        if not hasattr(mlp, "experts") and not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return None
    if rope is None or not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
        return None
    if len(layers) != model.config.get_text_config().num_hidden_layers:
        return None
    return LeanForward(model, rope)


class LeanForward:
    def __init__(self, model: Any, rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        inner = model.model
        self.embed: Callable[[torch.Tensor], torch.Tensor] = inner.embed_tokens
        self.rotary: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = inner.rotary_emb
        self.rope = rope
        family = type(model).__name__
        self.layers = [_Layer(layer, family in WEIGHT_FIRST_NORM) for layer in inner.layers]
        self.norm = _rms_norm(inner.norm, weight_first=family in WEIGHT_FIRST_NORM, kernels=True)
        self._norms_on_kernels = getattr(inner.norm, "forward", None) is self.norm
        self.lm_head = logits_call_of(model.lm_head)  # float32 logits
        # The other families' RoPE is the standard rotate-half one; applied to query and key
        # heads at once (``_rotate_joint``) when QKV is fused, their own function otherwise.
        self.joint_rope = getattr(rope, "__name__", "") == "apply_rotary_pos_emb" and family not in HALF_ROPE
        # A dense model's decode-sized steps: every layer in one call on the kernels.
        self.dense = _dense_layers(model, self.layers, self.joint_rope) if lib_available() else None

    @property
    def kernel_norms(self) -> bool:
        """Whether the hidden states' norms run on kvcellar's kernels (their numbers are the
        kernels' arithmetic revision's: the KV namespace names it)."""
        return self._norms_on_kernels and lib_available()

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 meta: StepMeta) -> torch.Tensor:
        """Float32 logits ``[1, len(logits_to_keep), vocab]`` of the packed step (``ModelRunner.build``)."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, position_ids)
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)
        lead = h.shape[:-1]
        rope, attention = self.rope, paged_attention
        if self.dense is not None and self.dense.takes(meta.pool, h.shape[1]):
            record_direct_paths(meta, None)
            self.dense(h, cos, sin, meta)
            return self.lm_head(self.norm(h)[:, logits_to_keep, :])
        for layer in self.layers:
            x = layer.input_norm(h)
            shape = (*lead, -1, layer.head_dim)
            if layer.qkv is not None and self.joint_rope and (layer.q_norm is None or layer.qk_norm is not None):
                qkv = layer.qkv(x)
                qk = qkv[..., : layer.qk_heads * layer.head_dim].view(shape)
                if layer.qk_norm is not None:
                    qk = layer.qk_norm(qk)
                qk = _rotate_joint(qk.transpose(1, 2), cos_h, sin_h)
                q, k = qk[:, : layer.q_heads], qk[:, layer.q_heads :]
                v = qkv[..., layer.qk_heads * layer.head_dim :].view(shape).transpose(1, 2)
            else:
                if layer.qkv is not None:
                    q, k, v = layer.qkv(x).split(layer.qkv_sizes, dim=-1)
                else:
                    q, k, v = layer.q_k_v(x)
                q, k, v = q.view(shape), k.view(shape), v.view(shape)
                if layer.q_norm is not None and layer.k_norm is not None:
                    q, k = layer.q_norm(q), layer.k_norm(k)
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                q, k = rope(q, k, cos, sin)
            o, _ = attention(layer.attn, q, k, v, None, scaling=layer.scaling, sliding_window=layer.sliding_window,
                             kvcellar_meta=meta, s_aux=layer.sinks)
            h = h + layer.o(o.reshape(*lead, -1).contiguous())
            x = layer.post_norm(h)
            if layer.experts is not None and layer.router is not None:
                flat = x.view(-1, x.shape[-1])
                _, weights, index = layer.router.forward(flat)
                h = h + layer.experts.forward(flat, index, weights).view(h.shape)
                continue
            if layer.gate_up is not None:
                gate, up = layer.gate_up(x).split(layer.gate_up_sizes, dim=-1)
            else:
                gate, up = layer.gate_and_up(x)
            h = h + layer.down(layer.act(gate) * up)
        h = self.norm(h)
        return self.lm_head(h[:, logits_to_keep, :])


def module_forward(model: nn.Module) -> Callable[..., Any]:
    """transformers' own forward, with the same signature as ``LeanForward``."""

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                meta: StepMeta) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep,
                                     use_cache=False, kvcellar_meta=meta).logits
        return logits

    return forward
