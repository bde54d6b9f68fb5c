"""torch's elementwise math on CPU, made to give one process's numbers in every process.

torch built with MKL computes float32 ``cos``, ``sin``, ``exp``, ``log``, ``tanh``, ``erf`` (and
the other functions MKL's vector math library has) through that library. The first such call
in a process sometimes returns other last bits than every later call of the same inputs: in
about one fresh process of six on the Xeon of docs/performance.md's stop 80, half of its values
(those MKL's second thread takes), whichever function came first; not once after an earlier
call. A serving process's first such call is its first step's RoPE (transformers' rotary
module: ``cos`` and ``sin`` of the positions), so that step's keys, its KV blocks and its tokens
came out otherwise in such a process than a restart or another replica recomputes them, and a
cache hit then did not give what recomputing gives. ``settle`` spends that first call on a few
values before anything is computed that counts.
"""

from __future__ import annotations

import torch

# The functions kvcellar's forward passes and sampling reach through torch (transformers' RoPE,
# activations, log-probabilities), each called once: the first of them takes the odd call.
_FUNCTIONS = (torch.cos, torch.sin, torch.exp, torch.log, torch.tanh, torch.erf, torch.sqrt)

_settled = False


def settle() -> None:
    """Make this process's first call of MKL's vector math on a few values (once a process)."""
    global _settled
    if _settled:
        return
    x = torch.linspace(0.125, 0.875, 1 << 16, dtype=torch.float32)  # enough for its threads to split it too
    for fn in _FUNCTIONS:
        fn(x)
    _settled = True
