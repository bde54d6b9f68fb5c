"""Mixture-of-experts blocks as kvcellar runs them: experts as linears, routers row-invariant.

transformers keeps a MoE block's experts as two 3-D parameters (``gate_up_proj``,
``down_proj``: every expert's weights stacked) and multiplies them with ``F.linear`` a slice
at a time. ``split_experts`` turns each MoE block's experts into ``RoutedExperts``: one
``nn.Linear`` per expert and projection (views of the stacked weights, no copy), so that
quantization (``kvcellar.quantization``) and ``engine/linears.py`` treat them as any other
linear — quantized, on kvcellar's kernels, mapped from the artifact cache — and the block's
router into a ``Router`` that computes its logits in float64.

Both serve the promise that a token's numbers do not depend on the step it runs in (a cache
hit computes a prompt's tail in a small step, a cold prompt in a large one):

* an expert's rows run through its linears grouped by expert; kvcellar's kernels give each
  row the same bits whatever the group's size, and each token's routed outputs are summed
  in its own top-k order, whatever other tokens share the step. Where every expert's
  linears run kvcellar's kernels, all routed experts of a projection run in one native call
  (``native.moe_matmul``: one wake-up of the threads a layer and projection, not one per
  expert), with the numbers each expert's linear gives alone;
* a router's logits are a float32 rounding of a float64 product, so the summation order a
  BLAS picks for the step's row count (one row: a matrix-vector product) does not reach
  them, and a near-tie between two experts cannot flip with the step (``native.route``
  sums each row in a fixed order, the whole choice in one call).

A step reads each routed expert's weights once, however many of its tokens chose it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcellar.engine import native
from kvcellar.engine.linears import FastLinear


class Router(nn.Module):
    """A MoE router: logits ``h @ W.T (+ b)`` in float64, rounded to float32, then the
    family's choice of experts and weights (``order``):

    * ``softmax_topk`` (Qwen MoE): softmax over all experts, the top k, renormalized to sum
      to 1 where ``normalize``;
    * ``topk_softmax`` (gpt-oss): the top k logits, softmax over those.

    ``prepare``: what the family does to the hidden states first (Gemma 4: an RMS norm and a
    learned scale), a row at a time; ``expert_scale``: a factor per expert on its weight
    (Gemma 4). ``forward`` returns what transformers' routers return: (logits, weights, indices);
    on a CPU with kvcellar's kernels, the families without those two run as one
    ``native.route`` call (the same float64 logits; its softmax rounds as libm's ``expf``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, order: str,
                 normalize: bool = False, prepare: nn.Module | None = None,
                 expert_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        if order not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown router order {order!r}")
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.top_k, self.order, self.normalize = top_k, order, normalize
        self.prepare = prepare
        self.expert_scale = None if expert_scale is None else nn.Parameter(expert_scale.detach(), requires_grad=False)
        self.num_experts, self.hidden_dim = weight.shape
        # (the weight it was made from, its version, weight and bias in float64)
        self._wide: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None] | None = None
        self._narrow: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None] | None = None  # float32

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.prepare is not None:
            hidden = self.prepare(hidden)
        h = hidden.reshape(-1, self.hidden_dim).to(torch.float64)
        w = self.weight  # converted once, not every step (again where it was changed)
        if self._wide is None or self._wide[0] is not w or self._wide[1] != w._version:
            bias = None if self.bias is None else self.bias.to(torch.float64)
            self._wide = (w, w._version, w.to(torch.float64), bias)
        return F.linear(h, self._wide[2], self._wide[3]).to(torch.float32)

    def routes_natively(self, hidden: torch.Tensor) -> bool:
        """Whether rows like ``hidden`` are routed by ``native.route`` (on a CPU with the kernels,
        the families without an input transform or per-expert scales)."""
        return (self.prepare is None and self.expert_scale is None and hidden.device.type == "cpu"
                and native.available())

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.routes_natively(hidden):
            w = self.weight  # as float32 once, not every step (again where it was changed)
            if self._narrow is None or self._narrow[0] is not w or self._narrow[1] != w._version:
                bias = None if self.bias is None else self.bias.float()
                self._narrow = (w, w._version, w.float(), bias)
            return native.route(hidden.reshape(-1, self.hidden_dim).float(), self._narrow[2], self._narrow[3],
                                self.top_k, self.order, self.normalize, torch.get_num_threads())
        logits = self.logits(hidden)
        if self.order == "topk_softmax":
            top, index = torch.topk(logits, self.top_k, dim=-1)
            return logits, torch.softmax(top, dim=-1), index
        probs = torch.softmax(logits, dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:
            top = top * self.expert_scale[index]
        return logits, top, index


class _Gemma4RouterInput(nn.Module):
    """Gemma 4's router input, as ``Gemma4TextRouter.forward`` computes it: its own RMS norm
    (no weight), times a learned scale and 1 / sqrt(hidden size)."""

    def __init__(self, router: Any) -> None:
        super().__init__()
        self.norm = router.norm
        self.scale = nn.Parameter(router.scale.detach(), requires_grad=False)
        self.root = float(router.scalar_root_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed: torch.Tensor = self.norm(hidden)
        return normed * self.scale * self.root


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` over ``weight`` ``[out, in]`` as it is (a view: no copy). Built without
    ``nn.Linear.__init__``, whose initialization of parameters about to be replaced took ~0.4 ms a
    linear even on the meta device: 5 s of a 128-expert, 48-layer model's start."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = weight.shape[1], weight.shape[0]
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    linear.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach(), requires_grad=False))
    return linear


class RoutedExperts(nn.Module):
    """A MoE block's experts, one gate-up and one down linear each (``gate_up[e]``,
    ``down[e]``), with transformers' ``Experts.forward`` signature: ``hidden [T, H]``, the
    routed experts ``index [T, K]`` and their weights ``[T, K]``.

    ``glu`` turns an expert's gate-up output ``[n, 2I]`` into its down projection's input
    ``[n, I]`` (the family's gating: which half is the gate, the activation, clamps)."""

    def __init__(self, gate_up: list[nn.Linear], down: list[nn.Linear],
                 glu: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError("an expert needs a gate-up and a down projection")
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.glu = glu
        self.num_experts = len(gate_up)
        self._fused_for: nn.Module | None = None
        self._fused_plan: _Fused | None = None

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        fused = self._fused()
        if fused is not None and fused.act is not None:  # the whole block in one call
            out = native.moe_glu(hidden.float(), index, weights, fused.gate_up, fused.down, fused.act,
                                 torch.get_num_threads(), alpha=fused.alpha, limit=fused.limit,
                                 gate_up_bias=fused.gate_up_bias, down_bias=fused.down_bias)
            return out.to(hidden.dtype)
        tokens, k = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, k) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = hidden[order // k]
        if fused is not None:
            out = self._run_fused(fused, rows, flat[order], counts)
        else:
            out = torch.empty_like(rows)
            start = 0
            for expert, n in enumerate(counts):
                if n:
                    end = start + n
                    out[start:end] = self.down[expert](self.glu(self.gate_up[expert](rows[start:end])))
                    start = end
        slots = torch.empty_like(out)
        slots[order] = out
        # Summed over k in each token's own order, whatever else shares the step.
        weighted = slots.view(tokens, k, -1) * weights.to(out.dtype).unsqueeze(-1)
        return weighted.sum(dim=1)

    def _fused(self) -> _Fused | None:
        """Both projections of every expert as one call each (``native.moe_matmul``), where
        every expert's linears run kvcellar's kernels; found once per set of linears (they are
        replaced when ``linears.prepare_model`` prepares the model)."""
        first = self.gate_up[0]
        if self._fused_for is not first:
            self._fused_for, self._fused_plan = first, _Fused.of(self)
        return self._fused_plan

    def _run_fused(self, fused: _Fused, rows: torch.Tensor, experts: torch.Tensor, counts: list[int]) -> torch.Tensor:
        starts = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
        threads = torch.get_num_threads()
        dtype = rows.dtype
        gate_up = native.moe_matmul(rows.float(), fused.gate_up, starts, threads).to(dtype)
        if fused.gate_up_bias is not None:
            gate_up = gate_up + fused.gate_up_bias[experts].to(dtype)
        out = native.moe_matmul(self.glu(gate_up).float(), fused.down, starts, threads).to(dtype)
        return out if fused.down_bias is None else out + fused.down_bias[experts].to(dtype)


@dataclass(frozen=True)
class _Fused:
    """A ``RoutedExperts``' projections as ``native.moe_matmul`` takes them, and their biases
    ``[experts, out]`` (or None)."""

    gate_up: native.ExpertWeights
    down: native.ExpertWeights
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    act: str | None = None  # where ``native.moe_glu`` runs the whole block: its gating
    alpha: float = 1.0  # the clamped gating's
    limit: float = float("inf")

    @classmethod
    def of(cls, block: RoutedExperts) -> _Fused | None:
        if not native.available():
            return None
        parts = []
        for linears in (block.gate_up, block.down):
            fast = [m for m in linears if isinstance(m, FastLinear)]
            found = [m.native_weight() for m in fast]
            weights = [f for f in found if f is not None]
            if len(weights) != len(linears) or len({(f[0], f[1].shape) for f in weights}) != 1:
                return None
            kind = weights[0][0]
            panels = {m.panels for m in fast}
            if len(panels) != 1:
                return None
            experts = native.expert_weights(kind, [f[1] for f in weights], [f[2] for f in weights],
                                            [f[3] for f in weights] if kind == "int4" else None, panels=panels.pop())
            biases = [m.bias for m in fast if m.bias is not None]
            if biases and len(biases) != len(fast):
                return None
            parts.append((experts, torch.stack(biases).float().contiguous() if biases else None))
        (gate_up, gate_up_bias), (down, down_bias) = parts
        return cls(gate_up, down, gate_up_bias, down_bias, getattr(block.glu, "kernel_act", None),
                   getattr(block.glu, "alpha", 1.0), getattr(block.glu, "limit", float("inf")))


# transformers' activation modules whose gating ``native.moe_glu`` computes (its ``act``).
_KERNEL_ACTS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh"}


class _HalvesGlu:
    """Qwen MoE's and Gemma 4's gating: the gate is the first half, ``act(gate) * up``;
    ``kernel_act``: the same gating as ``native.moe_glu`` names it, where it computes it."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.act = act
        self.kernel_act = _KERNEL_ACTS.get(type(act).__name__)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


def _stacked_halves(experts: Any) -> RoutedExperts:
    """Qwen MoE's experts: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, no biases."""
    gate_up = [_linear(experts.gate_up_proj[e], None) for e in range(experts.num_experts)]
    down = [_linear(experts.down_proj[e], None) for e in range(experts.num_experts)]
    return RoutedExperts(gate_up, down, _HalvesGlu(experts.act_fn))


class _ClampedGlu:
    """gpt-oss's gating, as transformers' ``GptOssExperts._apply_gate``: gate and up interleaved
    (even and odd outputs), both clamped, ``(up + 1) * gate * sigmoid(alpha * gate)``;
    ``native.moe_glu`` computes it as ``clamped``."""

    kernel_act = "clamped"

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _stacked_inputs_first(experts: Any) -> RoutedExperts:
    """gpt-oss's experts: ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` stored inputs
    first (each expert's linear is the transpose: a view), with biases."""
    gate_up = [_linear(experts.gate_up_proj[e].t(), experts.gate_up_proj_bias[e]) for e in range(experts.num_experts)]
    down = [_linear(experts.down_proj[e].t(), experts.down_proj_bias[e]) for e in range(experts.num_experts)]
    return RoutedExperts(gate_up, down, _ClampedGlu(float(experts.alpha), float(experts.limit)))


# transformers' experts class -> how its weights become linears.
_EXPERTS: dict[str, Callable[[Any], RoutedExperts]] = {
    "Qwen3MoeExperts": _stacked_halves,
    "Qwen3_5MoeExperts": _stacked_halves,
    "Gemma4TextExperts": _stacked_halves,
    "GptOssExperts": _stacked_inputs_first,
}
# transformers' router class -> how it becomes a ``Router``.
_ROUTERS: dict[str, Callable[[Any], Router]] = {
    "Qwen3MoeTopKRouter": lambda r: Router(r.weight, None, r.top_k, "softmax_topk", bool(r.norm_topk_prob)),
    "Qwen3_5MoeTopKRouter": lambda r: Router(r.weight, None, r.top_k, "softmax_topk", True),
    "GptOssTopKRouter": lambda r: Router(r.weight, r.bias, r.top_k, "topk_softmax"),
    "Gemma4TextRouter": lambda r: Router(r.proj.weight, None, r.config.top_k_experts, "softmax_topk", True,
                                         _Gemma4RouterInput(r), r.per_expert_scale),
}


def split_experts(model: nn.Module) -> int:
    """Turn every MoE block of ``model`` into kvcellar's (see the module docstring), in
    place; how many experts modules it turned. An experts or router class not known here is
    a ``ValueError``: run by transformers' own code it would not keep kvcellar's promises."""
    done = 0
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        make: Callable[[Any], nn.Module] | None = _EXPERTS.get(kind) or _ROUTERS.get(kind)
        if make is None:
            if kind.endswith(("Experts", "Router")) and not isinstance(module, (RoutedExperts, Router)):
                raise ValueError(f"{name}: kvcellar does not run {kind} modules")
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, make(module))
        done += kind in _EXPERTS
    return done


# A stacked experts' biases -> the ``RoutedExperts`` linears that hold them, one row each.
_STACKED_BIASES = {"gate_up_proj_bias": "gate_up", "down_proj_bias": "down"}
# A router's parameters in transformers' module -> in the ``Router`` made of it (Gemma 4's).
_ROUTER_NAMES = {"router.proj.weight": "router.weight", "router.scale": "router.prepare.scale",
                 "router.per_expert_scale": "router.expert_scale"}


def split_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict written for transformers' MoE modules as the model ``split_experts`` made
    loads it: stacked experts' biases (gpt-oss's ``gate_up_proj_bias [E, 2I]``,
    ``down_proj_bias [E, H]``) as each expert's linear's bias (views, no copy); a router's
    parameters under the ``Router``'s names."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        owner, _, leaf = key.rpartition(".")
        renamed = next((key[: -len(old)] + new for old, new in _ROUTER_NAMES.items() if key.endswith("." + old)),
                       None)
        if renamed is not None:
            out[renamed] = tensor
            continue
        linears = _STACKED_BIASES.get(leaf)
        if linears is None:
            out[key] = tensor
            continue
        for e in range(tensor.shape[0]):
            out[f"{owner}.{linears}.{e}.bias"] = tensor[e]
    return out


def moe_blocks(model: nn.Module) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def runs_moe_kernels(model: nn.Module) -> bool:
    """Whether a MoE block of ``model`` (its linears prepared) is routed by ``native.route`` or
    runs its experts as one ``native.moe_glu`` call: then their rounding is kvcellar's, and the
    KV namespace says so."""
    if not isinstance(model, nn.Module):  # another framework's model (``--engine mlx``)
        return False
    if any(r.routes_natively(r.weight) for r in model.modules() if isinstance(r, Router)):
        return True
    return any((f := block._fused()) is not None and f.act is not None for block in moe_blocks(model))
