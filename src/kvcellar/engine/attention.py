"""Attention over the paged KV pool, plugged into transformers' attention registry.

The model runs with every sequence of a step packed into one row (``[1, T]``) and
``use_cache=False``; our ``StepMeta`` rides along as the keyword argument ``kvcellar_meta``
and transformers hands it, untouched, to ``paged_attention`` in every layer. Because our
function is not in transformers' mask registry, no mask is built: causality is ours.

Packed order: decode tokens first (one per sequence), then one span per prefilling
sequence. For each layer the function

1. writes this step's K/V (post-RoPE) into the pool at the step's slots,
2. with kvcellar's CPU kernels (``KVPool.attends``, a layer without soft-cap; sliding windows
   and gpt-oss's attention sinks included): every decode token and every prefill position
   attends by one kernel that reads the blocks where they lie (``KVPool.attend``), each position by the same
   operations in the same order whatever else its step holds: a token's numbers do not
   depend on whether a cache hit or a cold prefill, a chunk of 13 or of 512, computed it;
3. otherwise decodes gather each decode sequence's blocks into one padded batch for one SDPA
   call with a key-length mask (GQA folded into the query axis: measured 5-8x faster in
   bf16 on CPU than ``enable_gqa``), and prefills make one SDPA call per span over its
   gathered context, with a bottom-right causal mask when the span sits on top of earlier
   tokens (SDPA's ``is_causal`` is top-left aligned, right only when query length equals
   key length). These agree with the kernel to float rounding, not to the bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcellar.cache.kv_pool import KVPool

if TYPE_CHECKING:
    from kvcellar.engine.deltanet import RecurrentStep

ATTENTION_NAME = "kvcellar_paged"  # must not start with "paged|": the registry strips that prefix
# Spans up to this many queries fold GQA groups into query rows: bf16 SDPA with enable_gqa
# is several times slower for short queries over long contexts (docs/performance.md).
FOLD_GQA_MAX_QUERIES = 32
# A prefill chunk on top of at least this many earlier tokens takes the mask-free split path
# (``_chunk_over_past``): 15 % faster at 4096 earlier tokens, no gain below a few hundred.
SPLIT_MIN_PAST = 256

SDPA_PATHS = frozenset({"decode", "decode_masked", "prefill_folded", "prefill_split", "prefill_causal",
                        "prefill_masked"})
DIRECT_PATHS = frozenset({"decode", "decode_masked", "prefill_direct"})


def attention_paths(device: torch.device, direct: bool) -> frozenset[str]:
    """The paths ``paged_attention`` takes on ``device`` for a model without sliding windows
    or soft-capping: over a pool that attends in place (``direct``: kvcellar's kernel) one for
    prefill; otherwise SDPA's, of which the split prefill calls CPU's flash kernel."""
    if direct:
        return DIRECT_PATHS
    return SDPA_PATHS if device.type == "cpu" else SDPA_PATHS - {"prefill_split"}


@dataclass
class PrefillSpan:
    start: int  # packed index of the span's first query token
    length: int  # query tokens in this step
    context: int  # keys visible to the span's last token (earlier tokens + this span)
    block_table: torch.Tensor  # [1, ceil(context / block_size)]


@dataclass
class DecodeBatch:
    count: int  # decode sequences; they occupy packed positions [0, count)
    block_tables: torch.Tensor  # [count, max_blocks], padded with the null block
    contexts: torch.Tensor  # [count] keys per sequence, including this step's token
    mask: torch.Tensor | None  # [count, 1, 1, max_blocks * block_size], None if nothing to mask


@dataclass
class StepMeta:
    pool: KVPool
    slot_blocks: torch.Tensor  # [T] block id of each packed token
    slot_offsets: torch.Tensor  # [T] offset inside that block
    decode: DecodeBatch | None
    prefills: list[PrefillSpan]
    # Threads of the kernel that reads blocks in place (0: torch's count for the step). The
    # runner gives all of its threads, also to decode steps whose matmuls run on fewer: a
    # long context splits into chunks that keep every core busy (a short one is one chunk).
    attend_threads: int = 0
    _mask_cache: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)
    _direct: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Names of the attention code paths this step ran (recorded by layer 0): the runner counts
    # paths a request runs for the first time, which warm-up exists to make zero.
    paths: set[str] = field(default_factory=set)
    # Hybrid models: the recurrent-state slots the step's rows continue (``engine/deltanet.py``).
    recurrent: RecurrentStep | None = None

    def span_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """Bottom-right causal (and sliding-window) mask of span ``i``; None when plain causal."""
        span = self.prefills[i]
        past = span.context - span.length
        if past == 0 and (window is None or window >= span.context):
            return None
        key = ("span", i, window)
        mask = self._mask_cache.get(key)
        if mask is None:
            device = self.slot_blocks.device
            q_pos = torch.arange(past, span.context, device=device)[:, None]
            k_pos = torch.arange(span.context, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._mask_cache[key] = mask
        return mask

    def direct_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole step as one call of the kernel that reads blocks in place: block tables
        (padded with the null block), contexts and query rows of its decodes (a row each) and
        spans, in packed order."""
        if self._direct is None:
            tables: list[torch.Tensor] = []
            contexts: list[torch.Tensor] = []
            rows: list[int] = []
            if self.decode is not None:
                tables.extend(self.decode.block_tables)
                contexts.append(self.decode.contexts)
                rows.extend([1] * self.decode.count)
            for span in self.prefills:
                tables.append(span.block_table[0])
                contexts.append(torch.tensor([span.context]))
                rows.append(span.length)
            width = max(t.shape[0] for t in tables)
            padded = torch.zeros((len(tables), width), dtype=torch.int64)  # the null block: never read
            for i, t in enumerate(tables):
                padded[i, :t.shape[0]] = t
            self._direct = (padded, torch.cat(contexts).to(torch.int64), torch.tensor(rows, dtype=torch.int64))
        return self._direct

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        batch = self.decode
        assert batch is not None
        if window is None:
            return batch.mask
        key = ("decode", window)
        mask = self._mask_cache.get(key)
        if mask is None:
            width = batch.block_tables.shape[1] * self.pool.layout.block_size
            k_pos = torch.arange(width, device=batch.contexts.device)[None, :]
            last = (batch.contexts - 1)[:, None]
            mask = ((k_pos <= last) & (k_pos > last - window))[:, None, None, :]
            self._mask_cache[key] = mask
        return mask


def paged_attention(
    module: Any,  # the model's attention module; only its ``layer_idx`` is read
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    meta: StepMeta | None = kwargs.get("kvcellar_meta")
    if meta is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} needs the kvcellar engine's step metadata; "
            "run this model through kvcellar.engine.Engine"
        )
    sinks: torch.Tensor | None = kwargs.get("s_aux")  # gpt-oss: a sink logit per query head
    window = kwargs.get("sliding_window") or None
    layer: int = module.layer_idx
    pool = meta.pool
    # query [1, Hq, T, D]; key/value [1, Hkv, T, D]
    _, n_q_heads, total, head_dim = query.shape
    n_kv_heads = key.shape[1]
    groups = n_q_heads // n_kv_heads
    record = meta.paths.add if layer == 0 else _ignore

    pool.write(layer, meta.slot_blocks, meta.slot_offsets, key[0].transpose(0, 1), value[0].transpose(0, 1))

    q = query[0]  # [Hq, T, D]

    # A kernel that reads the blocks where they lie (kvcellar's CPU kernels): one query
    # position attends without a gathered copy of its context, which SDPA would read again
    # (quantized: several times the packed blocks' bytes). Every position of the step goes in
    # one call: its decodes, prefill chunks and drafts alike (a call per span cost more in
    # Python than a verification's attention).
    direct = pool.attends and kwargs.get("softcap") is None
    scale = scaling if scaling is not None else head_dim ** -0.5
    if direct:
        if layer == 0:
            record_direct_paths(meta, window)
        tables, contexts, rows = meta.direct_batch()
        qa = q.transpose(0, 1).reshape(total, n_kv_heads, groups, head_dim)
        o = pool.attend(layer, tables, contexts, qa, scale, meta.attend_threads, rows, sinks, window or 0)
        return o.reshape(1, total, n_q_heads, head_dim), None

    out = torch.empty((total, n_q_heads, head_dim), dtype=query.dtype, device=query.device)

    batch = meta.decode
    if batch is not None:
        n = batch.count
        # [Hq, n, D] -> [n, Hkv, groups, D]: query heads of one KV head act as query rows.
        qd = q[:, :n].transpose(0, 1).reshape(n, n_kv_heads, groups, head_dim)
        mask = meta.decode_mask(window)
        record("decode" if mask is None else "decode_masked")
        if sinks is not None:
            k, v = pool.gather(layer, batch.block_tables)
            o = _attend_with_sinks(qd, k, v, mask, scale, sinks.view(1, n_kv_heads, groups, 1), causal=False)
        else:
            k, v = pool.gather(layer, batch.block_tables)  # [n, Hkv, L, D]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scaling)
        out[:n] = o.reshape(n, n_q_heads, head_dim)

    for i, span in enumerate(meta.prefills):
        k, v = pool.gather(layer, span.block_table)
        k = k[:, :, : span.context]
        v = v[:, :, : span.context]
        n = span.length
        qp = q[None, :, span.start : span.start + n]  # [1, Hq, n, D]
        mask = meta.span_mask(i, window)
        if sinks is not None:
            record("prefill_sinks")
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            o = _attend_with_sinks(qp, k, v, mask, scale, sinks.view(1, n_q_heads, 1, 1), causal=mask is None)
        elif groups > 1 and n <= FOLD_GQA_MAX_QUERIES:
            # Short spans (the tail after a prefix hit): fold the query heads of each KV head
            # into the query rows, as for decode; a causal mask is repeated per head.
            record("prefill_folded")
            folded = qp.reshape(1, n_kv_heads, groups * n, head_dim)
            if mask is None and n > 1:
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
            if mask is not None:
                mask = mask.repeat(groups, 1)
            o = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scaling)
            o = o.reshape(1, n_q_heads, n, head_dim)  # CUDA kernels may return another layout
        elif mask is not None and window is None and q.device.type == "cpu" and \
                span.context - n >= SPLIT_MIN_PAST:
            record("prefill_split")
            o = _chunk_over_past(qp, k, v, span.context - n, n_kv_heads, groups, scaling)
        else:
            record("prefill_causal" if mask is None else "prefill_masked")
            o = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=mask, is_causal=mask is None and n > 1, scale=scaling, enable_gqa=groups > 1,
            )
        out[span.start : span.start + n] = o[0].transpose(0, 1)

    return out[None], None


def record_direct_paths(meta: StepMeta, window: int | None) -> None:
    """The paths a step takes over a pool that attends in place (layer 0's record)."""
    if meta.decode is not None:
        meta.paths.add("decode" if meta.decode_mask(window) is None else "decode_masked")
    if meta.prefills:
        meta.paths.add("prefill_direct")


def _ignore(_path: str) -> None:
    pass


# Query rows per pass of ``_attend_with_sinks`` (bounds its float32 scores: rows x heads x keys).
SINK_ROWS = 32


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       sinks: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention with a sink (gpt-oss): ``q [B, H, n, D]`` over ``k``/``v [B, H, L, D]`` whose
    softmax also holds each row's ``sinks`` logit (broadcast to ``[B, H, n, 1]``), a key
    without a value; ``mask`` (True: visible) or ``causal`` (bottom-right) as SDPA takes them.
    In float32, as transformers' eager attention for gpt-oss computes it."""
    n, length = q.shape[2], k.shape[2]
    kf, vf = k.float(), v.float()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, n, SINK_ROWS):
        end = min(n, start + SINK_ROWS)
        scores = (q[:, :, start:end].float() @ kf.transpose(-1, -2)) * scale
        if mask is not None:
            rows_mask = mask if mask.shape[-2] == 1 else mask[..., start:end, :]
            scores = scores.masked_fill(~rows_mask, float("-inf"))
        elif causal:
            rows = torch.arange(start, end, device=q.device)[:, None] + (length - n)
            scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > rows, float("-inf"))
        sink = sinks.float().expand(*scores.shape[:2], end - start, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[:, :, start:end] = (probs @ vf).to(q.dtype)
    return out


def _chunk_over_past(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, n_kv_heads: int,
                     groups: int, scale: float | None) -> torch.Tensor:
    """Attention of a prefill chunk ``q [1, Hq, n, D]`` on top of ``past`` earlier tokens,
    without a mask: (a) every query against the earlier keys, all visible, and (b) against
    the chunk's own keys, causal; the two softmax partials merge exactly through their
    log-sum-exp. SDPA with a [n, past + n] boolean mask was ~18 % slower on CPU (it expands
    the mask per call and cannot skip masked tiles), and attention is most of a long prefill."""
    _, n_q_heads, n, head_dim = q.shape
    flash: Callable[..., tuple[torch.Tensor, ...]] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    folded = q.reshape(1, n_kv_heads, groups * n, head_dim)  # all past keys visible: fold GQA
    o_past, lse_past = flash(folded, k[:, :, :past], v[:, :, :past], 0.0, False, scale=scale)[:2]
    k_own, v_own = k[:, :, past:], v[:, :, past:]
    if groups > 1:
        k_own = k_own.repeat_interleave(groups, dim=1)
        v_own = v_own.repeat_interleave(groups, dim=1)
    o_own, lse_own = flash(q, k_own, v_own, 0.0, True, scale=scale)[:2]
    lse_past = lse_past.reshape(1, n_q_heads, n, 1)
    lse_own = lse_own.reshape(1, n_q_heads, n, 1)
    top = torch.maximum(lse_past, lse_own)
    w_past = torch.exp(lse_past - top)
    w_own = torch.exp(lse_own - top)
    merged = o_past.reshape(1, n_q_heads, n, head_dim).float() * w_past + o_own.float() * w_own
    return (merged / (w_past + w_own)).to(q.dtype)


AttentionInterface.register(ATTENTION_NAME, paged_attention)
