"""The gated delta rule on kvcellar's kernel (``native/recurrent.c``) against the torch
recurrence (``engine/deltanet.gated_delta``): the same outputs and states within float32
rounding, rows of one slot in order, captures, a row's bits independent of the rows beside it,
and arguments it refuses; the same for the elementwise work around the rule (the rule's inputs,
the gated norm, the convolution) against the torch code the layer runs without the kernels. End
to end (a hybrid model's tokens, cached against uncached) in ``tests/integration/test_qwen35.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcellar.engine import native
from kvcellar.engine.deltanet import L2_EPS, causal_conv, l2_normalized
from kvcellar.engine.deltanet import gated_delta as torch_rule

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


KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 20, 24  # widths with a scalar tail past 8-wide vectors


def layer_inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(n, 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM, generator=gen) * 3
    conv[0, :8] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 30.0, -30.0, 1e-30, -88.0])  # SiLU's far ends
    a, b = torch.randn(n, VALUE_HEADS, generator=gen) * 8, torch.randn(n, VALUE_HEADS, generator=gen) * 8
    neg_a, dt_bias = -torch.rand(VALUE_HEADS, generator=gen) * 4, torch.randn(VALUE_HEADS, generator=gen)
    return conv, a, b, neg_a, dt_bias


def torch_inputs(conv, a, b, neg_a, dt_bias) -> tuple[torch.Tensor, ...]:
    """What ``GatedDeltaNet`` computes without the kernels."""
    n, ks = conv.shape[0], KEY_HEADS * KEY_DIM
    x = F.silu(conv)
    q = l2_normalized(x[:, :ks].reshape(n, KEY_HEADS, KEY_DIM)) * KEY_DIM ** -0.5
    k = l2_normalized(x[:, ks : 2 * ks].reshape(n, KEY_HEADS, KEY_DIM))
    repeat = VALUE_HEADS // KEY_HEADS
    q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    v = x[:, 2 * ks :].reshape(n, VALUE_HEADS, VALUE_DIM)
    return q, k, v, torch.exp(neg_a * F.softplus(a + dt_bias)), torch.sigmoid(b)


def test_the_rules_inputs_and_the_gated_norm_match_the_torch_layer_and_do_not_depend_on_other_rows():
    args = layer_inputs(7, 3)
    got = native.delta_inputs(*args, KEY_HEADS, KEY_DIM, KEY_DIM ** -0.5, L2_EPS)
    for g, w in zip(got, torch_inputs(*args), strict=True):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-6)
    for r in range(7):
        alone = native.delta_inputs(*(t[r : r + 1] for t in args[:3]), *args[3:], KEY_HEADS, KEY_DIM,
                                    KEY_DIM ** -0.5, L2_EPS)
        assert all(torch.equal(one[0], many[r]) for one, many in zip(alone, got, strict=True))

    gen = torch.Generator().manual_seed(4)
    core = torch.randn(7, VALUE_HEADS, VALUE_DIM, generator=gen)
    z = torch.randn(7, VALUE_HEADS * VALUE_DIM, generator=gen) * 6
    weight, eps = torch.rand(VALUE_DIM, generator=gen) + 0.5, 1e-6
    normed = native.gated_norm(core, z, weight, eps)
    want = weight * (core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z.view(core.shape))
    torch.testing.assert_close(normed, want.reshape(7, -1), rtol=2e-6, atol=1e-6)
    for r in range(7):
        assert torch.equal(native.gated_norm(core[r : r + 1], z[r : r + 1], weight, eps)[0], normed[r])
    with pytest.raises(ValueError, match="delta_inputs"):
        native.delta_inputs(args[0][:, 1:], *args[1:], KEY_HEADS, KEY_DIM, 1.0, L2_EPS)
    with pytest.raises(ValueError, match="gated_norm"):
        native.gated_norm(core, z[:, 1:], weight, eps)


def test_the_convolution_matches_the_torch_layers_with_its_states_and_captures():
    channels, taps = 8 * 3 + 5, 4  # a scalar tail past the 8-wide vectors
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    start = torch.randn(5, channels, taps - 1, generator=gen)
    # rows 0-2: decode rows of slots 3, 1, 4; rows 3-8: a span of slot 0, its state after row 5
    # (the span's third) captured into slot 2
    slot_of, capture = [3, 1, 4, 0, 0, 0, 0, 0, 0], [-1, -1, -1, -1, -1, 2, -1, -1, -1]
    pool = start.clone()
    got = native.delta_conv(x, pool, torch.tensor(slot_of), torch.tensor(capture), weight.t())
    expected, want = start.clone(), torch.empty_like(got)
    for r, slot in enumerate(slot_of[:3]):
        out, _ = causal_conv(x[r : r + 1, :, None], expected[slot : slot + 1], weight)
        want[r] = out[0, :, 0]
    out, joined = causal_conv(x[3:].t(), expected[0], weight)
    want[3:] = out.t()
    expected[2] = joined[:, 3 : 3 + taps - 1]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(pool, expected)  # the kept inputs are copies: exact

    # the span a row at a time (as decode steps would run it): the same bits, the same state
    alone = start.clone()
    for r in range(3, 9):
        one = native.delta_conv(x[r : r + 1], alone, torch.tensor([0]), torch.tensor([-1]), weight.t())
        assert torch.equal(one[0], got[r])
    assert torch.equal(alone[0], pool[0])
    with pytest.raises(ValueError, match="slot"):
        native.delta_conv(x[:1], alone, torch.tensor([5]), torch.tensor([-1]), weight.t())
    with pytest.raises(ValueError, match="delta_conv"):
        native.delta_conv(x[:1], alone, torch.tensor([0]), torch.tensor([-1]), weight[:, :3].t())
