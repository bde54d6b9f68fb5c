"""KV blocks of the pool on kvcellar's kernels (``kv.c``), read and written where they lie:
quantized blocks gathered and written bit for bit as ``kv_pool``'s torch code does, and
attention of query positions over a sequence's blocks (every position by the same arithmetic,
a decode step's or a prefill chunk's)."""

from __future__ import annotations

import torch

from kvcellar.cache.kv_pool import KVLayout
from kvcellar.engine.native import lib


def gathers_kv(layout: KVLayout, device: torch.device) -> bool:
    """Whether ``gather_kv`` (and ``attend_kv``, ``write_kv``) take this quantized KV layout:
    on CPU, float32 or bf16, groups of a multiple of 16 values, at most 512."""
    return (device.type == "cpu" and layout.quantized and layout.kv_group_size % 16 == 0
            and layout.kv_group_size <= 512 and layout.dtype in (torch.float32, torch.bfloat16) and lib.available())


def _check_pool(pool: torch.Tensor, layout: KVLayout, layer: int) -> None:
    if not pool.is_contiguous() or pool.dtype != layout.storage_dtype or pool.shape[1:] != layout.storage_shape:
        raise ValueError(f"the pool is not a contiguous [blocks, {layout.storage_shape}] {layout.storage_dtype} tensor")
    if not 0 <= layer < layout.num_layers:
        raise IndexError(f"layer {layer} of {layout.num_layers}")


def _block_ids(ids: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < pool.shape[0]:
        raise IndexError(f"block ids outside the pool's {pool.shape[0]} blocks")  # C would read past it
    return ids


def gather_kv(pool: torch.Tensor, layout: KVLayout, layer: int, kv: int, blocks: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s K (``kv`` 0) or V (1) of ``blocks`` (int64 block ids) in a quantized
    KV pool (``pool`` uint8 ``[num_blocks, *layout.storage_shape]``), dequantized in one pass
    into ``[len(blocks) * block_size, kv_heads, head_dim]`` of ``layout.dtype``: what
    ``kv_pool.dequantize_kv`` gives for those blocks, bit for bit."""
    _check_pool(pool, layout, layer)
    if not layout.quantized:
        raise ValueError("gather_kv reads quantized KV blocks")
    blocks = _block_ids(blocks, pool)
    kv_heads, head_dim = layout.heads(layer)
    out = torch.empty(blocks.numel() * layout.block_size, kv_heads, head_dim, dtype=layout.dtype)
    lib.call("kvc_gather_kv", pool=pool.data_ptr(), block_bytes=layout.bytes_per_block,
             region=(layer * 2 + kv) * layout.storage_shape[-1], values_bytes=layout.layer_values_bytes(layer),
             blocks=blocks.data_ptr(), n_blocks=blocks.numel(), rows=layout.block_size * kv_heads,
             head_dim=head_dim, group=layout.kv_group_size, bits=layout.kv_bits, out=out.data_ptr(),
             bf16=layout.dtype == torch.bfloat16, threads=torch.get_num_threads())
    return out


def attends_kv(layout: KVLayout, device: torch.device) -> bool:
    """Whether ``attend_kv`` takes this KV layout: on CPU, the quantized layouts ``gathers_kv``
    takes, or float32 and bf16 blocks with heads of a multiple of 16 values."""
    if layout.quantized:
        return gathers_kv(layout, device)
    return (device.type == "cpu" and layout.dtype in (torch.float32, torch.bfloat16)
            and all(layout.heads(i)[1] % 16 == 0 for i in range(layout.num_layers)) and lib.available())


def regions(layout: KVLayout, layer: int) -> tuple[int, int, int, int]:
    """Where the kernels find layer ``layer``'s K and V in a block: their bytes into it, a
    quantized block's values bytes (0 otherwise) and the bits of a value as stored."""
    if layout.quantized:
        layer_bytes, values_bytes, bits = layout.storage_shape[-1], layout.layer_values_bytes(layer), layout.kv_bits
    elif layout.dtype in (torch.float32, torch.bfloat16):  # 32 or 16 bits as stored
        layer_bytes = layout.bytes_per_block // (layout.num_layers * 2)
        values_bytes, bits = 0, layout.dtype.itemsize * 8
    else:
        raise ValueError(f"the kernels read float32, bf16 or quantized blocks, not {layout.dtype}")
    return layer * 2 * layer_bytes, (layer * 2 + 1) * layer_bytes, values_bytes, bits


def attend_kv(pool: torch.Tensor, layout: KVLayout, layer: int, tables: torch.Tensor, contexts: torch.Tensor,
              q: torch.Tensor, scale: float, threads: int = 0, rows: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of query positions over a KV pool's blocks, read where they lie:
    sequence ``i`` has ``rows[i]`` query positions (default one each), the last seeing the
    first ``contexts[i]`` tokens of ``tables[i]`` (``[n, width]`` block ids) and each earlier
    one a token fewer; ``q [sum(rows), kv_heads, groups, head_dim]`` (the query heads of each
    KV head; a sequence's positions one after the other). Returns ``q``'s shape and dtype.
    Computed in float32 from the stored values (packed ones dequantized as ``gather_kv``
    does in float32), with its own order of sums: within float32 rounding of SDPA over the
    gathered context, not bit for bit; but a position's result is the same to the bit
    whatever the other positions of its call (a decode step, a prefill chunk of any size).
    ``sinks``: per query head, an attention sink's logit (gpt-oss): a key without a value that
    takes its share of each position's softmax. ``window``: each position sees its last
    ``window`` keys only (a sliding-window layer; 0: all of its context)."""
    _check_pool(pool, layout, layer)
    total, kv_heads, groups, head_dim = q.shape
    if (kv_heads, head_dim) != layout.heads(layer) or head_dim % 16:
        raise ValueError(f"queries {tuple(q.shape)} do not fit layer {layer}'s KV heads {layout.heads(layer)}")
    n = contexts.shape[0]
    tables = tables.to(torch.int64).contiguous()
    contexts = contexts.to(torch.int64).contiguous()
    rows = torch.ones(n, dtype=torch.int64) if rows is None else rows.to(torch.int64).contiguous()
    if tables.shape[0] != n or rows.shape[0] != n or int(rows.sum()) != total:
        raise ValueError("block tables, contexts and query rows disagree on the sequences")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        if sinks.shape != (kv_heads * groups,):
            raise ValueError(f"one sink per query head ({kv_heads * groups}), not {tuple(sinks.shape)}")
    k_region, v_region, values_bytes, bits = regions(layout, layer)
    status = lib.call("kvc_attend_kv", pool=pool.data_ptr(), n_blocks=pool.shape[0],
                      block_bytes=layout.bytes_per_block, k_region=k_region,
                      v_region=v_region, values_bytes=values_bytes, tables=tables.data_ptr(),
                      table_width=tables.shape[1], contexts=contexts.data_ptr(), rows=rows.data_ptr(), n_seq=n,
                      block_size=layout.block_size, kv_heads=kv_heads, head_dim=head_dim,
                      group=layout.kv_group_size, bits=bits, q=qf.data_ptr(), gq=groups, scale=scale,
                      sinks=None if sinks is None else sinks.data_ptr(), window=window, out=out.data_ptr(),
                      threads=threads or torch.get_num_threads())
    if status == -2:
        raise IndexError("a block outside the pool, or a context longer than its block table or shorter than its rows")
    if status != 0:
        raise MemoryError("no scratch memory for attention over the pool")
    return out.to(q.dtype)


def write_kv(pool: torch.Tensor, layout: KVLayout, layer: int, kv: int, blocks: torch.Tensor,
             offsets: torch.Tensor, x: torch.Tensor) -> None:
    """``x [n, kv_heads, head_dim]`` (float32 or bf16) quantized into layer ``layer``'s K
    (``kv`` 0) or V (1) at (block, offset) pairs of a quantized KV pool: what
    ``kv_pool.quantize_kv`` and the pool's indexed stores write, bit for bit."""
    _check_pool(pool, layout, layer)
    n = x.shape[0]
    if not layout.quantized or layout.kv_group_size > 512 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("write_kv writes float32 or bf16 rows into quantized blocks of groups up to 512")
    kv_heads, head_dim = layout.heads(layer)
    if x.shape != (n, kv_heads, head_dim) or blocks.numel() != n or offsets.numel() != n:
        raise ValueError(f"rows {tuple(x.shape)} and their slots do not fit the pool's heads")
    blocks = blocks.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    x = x.contiguous()
    status = lib.call("kvc_write_kv", pool=pool.data_ptr(), n_blocks=pool.shape[0], block_size=layout.block_size,
                      block_bytes=layout.bytes_per_block, region=(layer * 2 + kv) * layout.storage_shape[-1],
                      values_bytes=layout.layer_values_bytes(layer), blocks=blocks.data_ptr(),
                      offsets=offsets.data_ptr(), n_rows=n, kv_heads=kv_heads, head_dim=head_dim,
                      group=layout.kv_group_size, bits=layout.kv_bits, x=x.data_ptr(),
                      x_bf16=x.dtype == torch.bfloat16, threads=torch.get_num_threads())
    if status != 0:
        raise IndexError("a slot outside the pool")
