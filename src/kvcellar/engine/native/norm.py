"""RMSNorm of hidden states on kvcellar's kernels (``norm.c``): one call where torch runs ~10
operations, each row by the same arithmetic whatever the step's rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcellar.engine.native import lib


def rms_norm_for(weight: torch.Tensor, eps: float, weight_first: bool,
                 otherwise: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """RMSNorm over the last dimension with ``weight`` (the hidden size's, float32 or bf16) on
    the kernels: ``x`` in ``weight``'s dtype (or either where ``weight_first``), the result in
    ``x``'s; h = x / sqrt(mean(x²) + eps) in float32, then weight × h rounded after h is
    (transformers' Llama/Qwen RMSNorm) or, ``weight_first``, before (gpt-oss's). None where the
    kernels cannot run it (another device or dtype, no library, a size not in 8s); the norm
    returned gives ``otherwise(x)`` for an input they do not take, or once the library is not
    there (a process that switched the kernels off: its engines' norms are torch's)."""
    cols = weight.shape[-1]
    if (weight.dim() != 1 or weight.is_cuda or weight.dtype not in (torch.float32, torch.bfloat16) or cols % 8
            or not lib.available()):
        return None
    w32 = weight.detach().float().contiguous()
    dtypes = (torch.float32, torch.bfloat16) if weight_first else (weight.dtype,)

    def norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in dtypes or x.is_cuda or x.shape[-1] != cols or not lib.available():
            return otherwise(x)
        x = x.contiguous()
        out = torch.empty_like(x)
        lib.call("kvc_rms_norm", x=x.data_ptr(), bf16=int(x.dtype == torch.bfloat16), weight=w32.data_ptr(),
                 rows=x.numel() // cols, cols=cols, eps=eps, weight_first=int(weight_first), out=out.data_ptr(),
                 threads=torch.get_num_threads())
        return out

    return norm
