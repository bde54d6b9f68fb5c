"""torch's first call of MKL's vector math in a process, spent by ``torch_math.settle`` before a
model's numbers: every process's RoPE then gives the numbers every later call gives."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from kvcellar.engine import torch_math
from tests._models import embedded, make_engine

# A fresh process: settle, then the first step's RoPE of a 38-token prompt (SmolLM2's rotary
# frequencies), computed twice. Prints 1 where the first computation gave the second's bits.
SCRIPT = """
import torch
from kvcellar.engine.torch_math import settle
settle()
inv = 1.0 / (100000 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
pos = torch.arange(38).view(1, 38)
emb = torch.cat((pos[..., None].float() * inv,) * 2, dim=-1)
first, again = emb.cos(), emb.cos()
print(int(torch.equal(first, again)))
"""
PROCESSES = 16


def test_a_process_first_rope_gives_what_every_later_call_gives():
    # Without settle() one fresh process in six computes half of its first cos otherwise (the half
    # MKL's second thread takes; later calls agree) on a quiet machine, fewer on a busy one: 16
    # processes catch a regression ~19 times in 20 there (docs/performance.md, stop 80).
    def run(_: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(PROCESSES)))
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results if r.returncode]
    assert [r.stdout.strip() for r in results] == ["1"] * PROCESSES


def test_an_engine_settles_torch_math_before_its_first_step(monkeypatch):
    loaded = embedded("auto", "auto")
    monkeypatch.setattr(torch_math, "_settled", False)
    engine = make_engine(loaded)
    try:
        assert torch_math._settled
    finally:
        engine.shutdown()
