"""Gated DeltaNet (Qwen3.5/3.6's linear attention) over a packed step, a token at a time.

transformers computes a prompt with the chunked form of the gated delta rule (matrices over
64-token chunks) and a decode step with the recurrent form: the two round differently, and the
chunked one's numbers depend on where the chunks fall. Here every token, in a prefill chunk of
any length or in a decode batch of any size, runs the same recurrence in the same order:

    S = S * exp(g);  delta = (v - S^T k) * beta;  S = S + k delta^T;  o = S^T q

(``S [key_dim, value_dim]`` per value head; q and k L2-normalized, q scaled by
``key_dim ** -0.5``), so a token's numbers do not depend on the step it runs in, the
precondition for exact cache hits. Its cost is small beside the linears: per token and head
``3 * key_dim * value_dim`` multiply-adds over a state that stays in cache.

The causal convolution (kernel 4 over the last inputs, then SiLU) is written out as a sum
over the kernel's taps in a fixed order for the same reason. Both states live in the
``StatePool`` slot the prefix cache gave the sequence; ``RecurrentStep`` says which slot
each of a step's rows continues.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvcellar.cache.state_pool import STATE_DTYPE, StatePool
from kvcellar.engine import native

L2_EPS = 1e-6  # transformers' l2norm (and the FLA library's)
VECTOR_ALIGN = 32  # float32 elements: two AVX-512 vectors, the most torch's CPU loops take a step
SERIAL_ELEMENTS = 32768  # torch's grain size: an elementwise call this small runs on one thread


@dataclass
class RecurrentStep:
    """The state slots a packed step continues (``ModelRunner.build``)."""

    pool: StatePool
    decode_slots: torch.Tensor | None  # [decodes] slot of each decode row (packed rows [0, decodes))
    spans: list[tuple[int, int, int]]  # prefill spans: (first packed row, rows, slot)
    # packed row -> a slot to copy the state after that row's token into (a sequence's
    # checkpoint at a block boundary)
    captures: dict[int, int]
    # a speculative verification's live slot -> a replay per layer: ``replay(row, dst)`` turns
    # ``dst``, holding the state before the verification, into the state after its ``row``
    # (``ModelRunner.rewind``); filled by the layers as the step runs
    verifies: dict[int, list[Callable[[int, int], None]]] = field(default_factory=dict)
    _rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def row_slots(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per packed row, the slot it continues and the slot its state is captured into (-1:
        none), as kvcellar's kernels take them: built once a step, for every layer."""
        if self._rows is None:
            slots = torch.empty(rows, dtype=torch.int64)
            if self.decode_slots is not None:
                slots[: self.decode_slots.shape[0]] = self.decode_slots
            for first, length, slot in self.spans:
                slots[first : first + length] = slot
            captures = torch.full((rows,), -1, dtype=torch.int64)
            for row, target in self.captures.items():
                captures[row] = target
            self._rows = slots, captures
        return self._rows


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of ``x [..., channels, rows]`` continuing ``state [...,
    channels, kernel - 1]`` (the inputs before, oldest first), float32, before its activation;
    the state is updated in place to the last ``kernel - 1`` inputs. Also returns the inputs
    joined after the state (the state after row t: columns ``t + 1 .. t + kernel - 1``)."""
    taps = weight.shape[-1]
    rows = x.shape[-1]
    joined = torch.cat([state, x.to(STATE_DTYPE)], dim=-1)
    w = weight.to(STATE_DTYPE)
    out = joined[..., 0:rows] * w[:, 0:1]
    for j in range(1, taps):
        out = out + joined[..., j : j + rows] * w[:, j : j + 1]
    state.copy_(joined[..., joined.shape[-1] - (taps - 1) :])
    return out, joined


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` such that each element rounds the same whatever the
    step: torch's CPU loops compute the elements of a remainder shorter than their vector step,
    and those of each thread's share, with other code (sigmoid, SiLU and softplus then round
    differently), so a row's values would depend on the rows before it. Here rows are padded to
    ``VECTOR_ALIGN`` elements and go through ``fn`` in single-threaded pieces, laid out row after
    row (the result too: a reduction over a strided layout sums in another order)."""
    if x.device.type != "cpu":
        return fn(x)
    cols = x.shape[-1]
    width = -(-cols // VECTOR_ALIGN) * VECTOR_ALIGN
    flat = x.reshape(-1, cols)
    flat = F.pad(flat, (0, width - cols)) if width != cols else flat.contiguous()
    per_call = max(1, SERIAL_ELEMENTS // width)
    out = fn(flat) if flat.shape[0] <= per_call else torch.cat([fn(part) for part in flat.split(per_call)])
    return out[:, :cols].reshape(x.shape)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule for a batch of states: ``q, k [..., heads, key_dim]``
    (normalized and scaled), ``v [..., heads, value_dim]``, ``decay`` (``exp(g)``) and ``beta
    [..., heads]``, ``state [..., heads, key_dim, value_dim]`` updated in place. Returns ``o
    [..., heads, value_dim]``. Multiplications, additions and sums only: no element's rounding
    depends on the batch."""
    state.mul_(decay[..., None, None])
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(dim=-2)


class GatedDeltaNet:
    """One Gated DeltaNet layer of a transformers ``Qwen3_5GatedDeltaNet`` module, over packed
    steps; ``index``: its place among the model's linear-attention layers (its pool slice)."""

    def __init__(self, module: Any, index: int, linear: Callable[[Any], Callable[[torch.Tensor], torch.Tensor]],
                 together: Callable[[list[Any]], Callable[[torch.Tensor], list[torch.Tensor]]]) -> None:
        """``linear``: how to call a linear of the module (``linears.call_of``); ``together``: how to
        call linears of the same input (``linears.call_together``)."""
        self.index = index
        self.key_heads = int(module.num_k_heads)
        self.value_heads = int(module.num_v_heads)
        self.key_dim = int(module.head_k_dim)
        self.value_dim = int(module.head_v_dim)
        self.key_size = self.key_heads * self.key_dim
        self.projections = together([module.in_proj_qkv, module.in_proj_z, module.in_proj_b, module.in_proj_a])
        self.out = linear(module.out_proj)
        self.conv_weight: torch.Tensor = module.conv1d.weight.squeeze(1)  # [channels, kernel]
        self.conv_taps = self.conv_weight.t().to(STATE_DTYPE).contiguous()  # [kernel, channels]
        self.neg_a: torch.Tensor = -module.A_log.float().exp()
        self.dt_bias: torch.Tensor = module.dt_bias
        self.norm_weight: torch.Tensor = module.norm.weight
        self.norm_eps = float(module.norm.variance_epsilon)
        self.scale = self.key_dim ** -0.5

    def __call__(self, x: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        """``x [1, rows, hidden]`` (normed) -> the layer's output ``[1, rows, hidden]``."""
        rows = x.shape[1]
        mixed, z, b, a = self.projections(x[0])  # mixed: [rows, channels]
        kernels = native.runs_gated_delta(x.device, self.value_dim)
        core = self._native(mixed, b, a, step) if kernels else self._torch(mixed, b, a, step)
        if kernels:  # float32, rounded once to a bf16 model's dtype
            normed = native.gated_norm(core, z, self.norm_weight, self.norm_eps).to(x.dtype)
        else:
            normed = self._gated_norm(core, z.view(rows, self.value_heads, self.value_dim), x.dtype)
        return self.out(normed.reshape(1, rows, -1))

    def _native(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        """The layer's work between its projections on kvcellar's kernels: a call each for the
        convolution, the rule's inputs and the rule, over every row of the step."""
        slots, captures = step.row_slots(mixed.shape[0])
        conv = step.pool.conv[self.index]
        recurrent = step.pool.recurrent[self.index]
        inputs = mixed.to(STATE_DTYPE).contiguous()
        convolved = native.delta_conv(inputs, conv, slots, captures, self.conv_taps)
        q, k, v, decay, beta = native.delta_inputs(convolved, a, b, self.neg_a, self.dt_bias, self.key_heads,
                                                   self.key_dim, self.scale, L2_EPS)
        for first, length, slot in step.spans:
            if slot in step.verifies:
                span = slice(first, first + length)
                step.verifies[slot].append(self._native_replay(inputs[span], q[span], k[span], v[span], decay[span],
                                                               beta[span], conv, recurrent))
        return native.gated_delta(q, k, v, decay, beta, recurrent, slots, captures)

    def _native_replay(self, inputs: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       decay: torch.Tensor, beta: torch.Tensor, conv: torch.Tensor,
                       recurrent: torch.Tensor) -> Callable[[int, int], None]:
        """``_replay`` on the kernels: the span's rows 0..row run again through the convolution
        and the rule, from the state before the span that ``dst`` holds."""

        def replay(row: int, dst: int) -> None:
            n = row + 1
            slots, none = torch.full((n,), dst, dtype=torch.int64), torch.full((n,), -1, dtype=torch.int64)
            native.delta_conv(inputs[:n], conv, slots, none, self.conv_taps)
            native.gated_delta(q[:n], k[:n], v[:n], decay[:n], beta[:n], recurrent, slots, none)

        return replay

    def _torch(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        """The layer's work between its projections in torch (where kvcellar's kernels do not run)."""
        rows = mixed.shape[0]
        conv = step.pool.conv[self.index]
        recurrent = step.pool.recurrent[self.index]
        taps = self.conv_weight.shape[-1]
        decay = rowwise(torch.exp, self.neg_a * rowwise(F.softplus, a.float() + self.dt_bias))  # [rows, value_heads]
        beta = rowwise(torch.sigmoid, b.float())
        # per group of rows (the decode rows, then each prefill span): its rows, q, k, v, slots
        groups: list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | int]] = []
        if step.decode_slots is not None:
            n = step.decode_slots.shape[0]
            slots = step.decode_slots
            conv_state = conv.index_select(0, slots)
            convolved, _ = causal_conv(mixed[:n, :, None], conv_state, self.conv_weight)
            conv.index_copy_(0, slots, conv_state)
            for row in range(n):
                target = step.captures.get(row)
                if target is not None:
                    conv[target].copy_(conv_state[row])
            groups.append((slice(0, n), *self._heads(rowwise(F.silu, convolved[..., 0])), slots))
        for first, length, slot in step.spans:
            convolved, joined = causal_conv(mixed[first : first + length].t(), conv[slot], self.conv_weight)
            for t in range(length):
                target = step.captures.get(first + t)
                if target is not None:
                    conv[target].copy_(joined[:, t + 1 : t + taps])
            groups.append((slice(first, first + length), *self._heads(rowwise(F.silu, convolved.t())), slot))
            if slot in step.verifies:
                step.verifies[slot].append(self._replay(joined, *groups[-1][1:4], decay[first : first + length],
                                                        beta[first : first + length], conv, recurrent))
        return self._torch_rule(groups, rows, decay, beta, recurrent, step.captures)

    @staticmethod
    def _replay(joined: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> Callable[[int, int], None]:
        """What turns a slot holding the state before a span into the state after the span's
        ``row``: its convolution inputs after that row, and the rule run again over rows 0..row
        of the span's inputs, by the code that ran them in the step (the same bits)."""
        taps = joined.shape[-1] - q.shape[0] + 1

        def replay(row: int, dst: int) -> None:
            n = row + 1
            conv[dst].copy_(joined[:, n : n + taps - 1])
            state = recurrent[dst]
            for t in range(n):
                gated_delta(q[t], k[t], v[t], decay[t], beta[t], state)

        return replay

    @staticmethod
    def _torch_rule(groups: list[Any], rows: int, decay: torch.Tensor, beta: torch.Tensor, recurrent: torch.Tensor,
                    captures: dict[int, int]) -> torch.Tensor:
        """Every row of the step in torch: the decode rows as one batch of states, each
        prefill span a token at a time."""
        core = torch.empty((rows, *groups[0][3].shape[1:]), dtype=STATE_DTYPE, device=recurrent.device)
        for span, q, k, v, slot in groups:
            if isinstance(slot, torch.Tensor):  # the decode rows
                state = recurrent.index_select(0, slot)
                core[span] = gated_delta(q, k, v, decay[span], beta[span], state)
                recurrent.index_copy_(0, slot, state)
                for row in range(span.stop):
                    target = captures.get(row)
                    if target is not None:
                        recurrent[target].copy_(state[row])
                continue
            state = recurrent[slot]
            ds, bs = decay[span], beta[span]
            for t in range(span.stop - span.start):
                core[span.start + t] = gated_delta(q[t], k[t], v[t], ds[t], bs[t], state)
                target = captures.get(span.start + t)
                if target is not None:
                    recurrent[target].copy_(state)
        return core

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved channels ``[rows, channels]`` as normalized, scaled query and key heads
        (repeated to the value heads) and value heads, float32."""
        rows = mixed.shape[0]
        ks = self.key_size
        q = mixed[:, :ks].reshape(rows, self.key_heads, self.key_dim).contiguous()
        k = mixed[:, ks : 2 * ks].reshape(rows, self.key_heads, self.key_dim).contiguous()
        v = mixed[:, 2 * ks :].reshape(rows, self.value_heads, self.value_dim).contiguous()
        q, k = l2_normalized(q) * self.scale, l2_normalized(k)
        repeat = self.value_heads // self.key_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        return q, k, v

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """transformers' ``Qwen3_5RMSNormGated``: RMS norm per head, weighted, times SiLU(z)."""
        h = core.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        h = self.norm_weight * h.to(dtype)
        out: torch.Tensor = (h * rowwise(F.silu, z.float())).to(dtype)
        return out
