"""The gated delta rule on kvcellar's kernel (``native/recurrent.c``) against the torch
recurrence (``engine/deltanet.gated_delta``): the same outputs and states within float32
rounding, rows of one slot in order, captures, a row's bits independent of the rows beside it,
and arguments it refuses. End to end (a hybrid model's tokens, cached against uncached) in
``tests/integration/test_qwen35.py``."""

from __future__ import annotations

import pytest
import torch

from kvcellar.engine import native
from kvcellar.engine.deltanet import gated_delta as torch_rule
from kvcellar.engine.deltanet import l2_normalized

pytestmark = pytest.mark.skipif(not native.available(), reason="kvcellar's CPU kernels do not run here")
HEADS, KEY, VALUE = 4, 32, 48  # a value width that is not a multiple of the kernel's 32 columns


def rows(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalized(torch.randn(n, HEADS, KEY, generator=gen)) * KEY ** -0.5
    k = l2_normalized(torch.randn(n, HEADS, KEY, generator=gen))
    v = torch.randn(n, HEADS, VALUE, generator=gen)
    decay = torch.rand(n, HEADS, generator=gen) * 0.5 + 0.5
    beta = torch.rand(n, HEADS, generator=gen)
    return q, k, v, decay, beta


def states(slots: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(slots, HEADS, KEY, VALUE, generator=torch.Generator().manual_seed(seed)) * 0.1


def test_a_span_and_a_decode_batch_match_the_torch_recurrence():
    q, k, v, decay, beta = rows(9, 0)
    pool = states(5)
    expected_pool = pool.clone()
    # rows 0-2: a decode batch over slots 3, 1, 4; rows 3-8: one sequence's span over slot 0,
    # its state after row 5 captured into slot 2
    slot_of = [3, 1, 4, 0, 0, 0, 0, 0, 0]
    capture = [-1, -1, -1, -1, -1, 2, -1, -1, -1]
    got = native.gated_delta(q, k, v, decay, beta, pool, torch.tensor(slot_of), torch.tensor(capture))
    want = torch.empty_like(got)
    for r, slot in enumerate(slot_of):
        want[r] = torch_rule(q[r], k[r], v[r], decay[r], beta[r], expected_pool[slot])
        if capture[r] >= 0:
            expected_pool[capture[r]] = expected_pool[slot]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(pool[2], pool[0])  # the state after row 5, not after row 8


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    q, k, v, decay, beta = rows(6, 1)
    together = states(6)
    out = native.gated_delta(q, k, v, decay, beta, together, torch.arange(6), torch.full((6,), -1))
    for r in range(6):
        alone = states(6)
        one = native.gated_delta(q[r : r + 1], k[r : r + 1], v[r : r + 1], decay[r : r + 1], beta[r : r + 1], alone,
                                 torch.tensor([r]), torch.tensor([-1]))
        assert torch.equal(one[0], out[r]) and torch.equal(alone[r], together[r])


def test_a_slot_outside_the_pool_or_a_wrong_shape_is_refused():
    q, k, v, decay, beta = rows(2, 2)
    pool = states(2)
    before = pool.clone()
    with pytest.raises(ValueError, match="slot"):
        native.gated_delta(q, k, v, decay, beta, pool, torch.tensor([0, 2]), torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="slot"):
        native.gated_delta(q, k, v, decay, beta, pool, torch.tensor([0, 1]), torch.tensor([-1, 5]))
    with pytest.raises(ValueError, match="states"):
        native.gated_delta(q, k, v, decay, beta, states(2)[:, :2].contiguous(), torch.tensor([0, 1]),
                           torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="contiguous"):
        native.gated_delta(q, k, v, decay, beta, torch.zeros(2, HEADS, KEY, 2 * VALUE)[..., ::2], torch.tensor([0, 1]),
                           torch.tensor([-1, -1]))
    assert torch.equal(pool, before)  # refused before anything ran
    assert not native.runs_gated_delta(torch.device("cpu"), 12)
