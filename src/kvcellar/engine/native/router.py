"""Mixture-of-experts routers on kvcellar's kernels (``router.c``)."""

from __future__ import annotations

import torch

from kvcellar.engine.native import lib

# A router's choice as ``kvc_route`` names it: a softmax over every expert then the top k
# (Qwen MoE), or the top k logits then a softmax over them (gpt-oss).
ROUTER_ORDERS = {"softmax_topk": 0, "topk_softmax": 1}


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, order: str, normalize: bool,
          threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x`` float32 ``[rows, cols]`` through a router of ``weight`` float32 ``[experts,
    cols]`` (``bias`` ``[experts]`` or None): ``(logits, weights, index)`` as ``experts.Router``
    returns them, the logits float64 dot products rounded to float32, then the softmax and top k
    in float32 (``order``: ``ROUTER_ORDERS``; ``normalize``: the top k's weights divided by
    their sum). Each row's numbers are its own, whatever else shares the step."""
    rows, cols = x.shape
    experts = weight.shape[0]
    if (x.dtype, weight.dtype) != (torch.float32, torch.float32) or weight.shape[1] != cols or x.is_cuda:
        raise ValueError("a router takes float32 CPU rows and weight of one width")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (experts,)):
        raise ValueError("a router's bias is float32, one per expert")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    logits = torch.empty(rows, experts)
    index = torch.empty(rows, k, dtype=torch.int64)
    weights = torch.empty(rows, k)
    rc = lib.call("kvc_route", x=x.data_ptr(), weight=weight.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
                  rows=rows, cols=cols, experts=experts, k=k, order=ROUTER_ORDERS[order], normalize=int(normalize),
                  logits=logits.data_ptr(), index=index.data_ptr(), weights=weights.data_ptr(), threads=threads)
    if rc != 0:
        raise ValueError(f"a router of {experts} experts cannot take {k} a token")
    return logits, weights, index
