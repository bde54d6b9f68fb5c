"""A step's logits on the kernels (``logits.c``), on the calling thread: torch's conversions and
argmax over a vocabulary each wake its sleeping threads, a few hundred microseconds a decode step
in all. The same numbers as torch's."""

from __future__ import annotations

import torch

from kvcellar.engine.native import lib


def _takes(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and lib.available()


def round_bf16_(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded in place to what ``x.bfloat16().float()`` gives; returns it."""
    if not _takes(x):
        x.copy_(x.bfloat16())
        return x
    if x.numel():
        lib.call("kvc_round_bf16", x=x.data_ptr(), n=x.numel())
    return x


def argmax_rows(x: torch.Tensor) -> list[int]:
    """``x.argmax(dim=-1).tolist()`` of a float32 ``[rows, cols]``: each row's first greatest
    value's index, a NaN the greatest."""
    if x.dim() != 2 or not _takes(x) or x.shape[1] == 0:
        found: list[int] = x.argmax(dim=-1).tolist()
        return found
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.call("kvc_argmax_rows", x=x.data_ptr(), rows=x.shape[0], cols=x.shape[1], out=out.data_ptr())
    return out.tolist()


def topk_row(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k)`` of a float32 ``[n]``: the greatest first, of equal values the lower index
    first (torch leaves their order open). One pass where the kernels run (torch's where a NaN is
    among them)."""
    if x.dim() == 1 and _takes(x) and 1 <= k <= x.numel():
        values, ids = torch.empty(k), torch.empty(k, dtype=torch.int64)
        if lib.call("kvc_topk_row", x=x.data_ptr(), n=x.numel(), k=k, values=values.data_ptr(),
                    ids=ids.data_ptr()) == 0:
            return values, ids
    found: tuple[torch.Tensor, torch.Tensor] = torch.topk(x, k)  # a NaN: torch's order for it
    return found
