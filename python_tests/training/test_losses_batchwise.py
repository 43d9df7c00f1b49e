"""L_batchwise (eq 20) and the sparse gate of eq 16: values against the formulas written as loops,
the gradients the formula gives, empty rows, and bad arguments."""

import pytest
import torch
from tolerances import assert_close

from moe_kernels import reference
from moe_kernels.gates import sparse_gates
from moe_kernels.losses import batchwise_threshold_loss
from moe_kernels.ops import batchwise_mask, threshold_mask, topk_softmax


def loss_by_loops(scores, thresholds, batch_mask):
    total = 0.0
    T, E = scores.shape
    for j in range(T):
        for i in range(E):
            m_thr = 1.0 if scores[j, i] > thresholds[i] else 0.0
            total += (m_thr - float(batch_mask[j, i])) * (float(scores[j, i]) - float(thresholds[i]))
    return total


def test_loss_value_matches_eq20():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(13, 5, generator=g, dtype=torch.float64)
    thresholds = torch.rand(5, generator=g, dtype=torch.float64)
    mask = batchwise_mask(scores.float(), 4)
    loss = batchwise_threshold_loss(scores, thresholds, mask)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(loss_by_loops(scores, thresholds, mask), rel=1e-12)
    assert loss.item() > 0


def test_loss_gradients_are_the_formula():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(20, 4, generator=g).requires_grad_()
    thresholds = torch.rand(4, generator=g).requires_grad_()
    mask = batchwise_mask(scores.detach(), 6)
    batchwise_threshold_loss(scores, thresholds, mask).backward()
    diff = threshold_mask(scores.detach(), thresholds.detach()).float() - mask.float()
    assert diff.abs().sum() > 0, "the test needs disagreeing masks"
    assert torch.equal(scores.grad, diff)
    assert torch.equal(thresholds.grad, -diff.sum(0))


def test_loss_is_zero_when_masks_agree_and_nonnegative_otherwise():
    scores = torch.randn(40, 6, generator=torch.Generator().manual_seed(2))
    m = 9
    mask = batchwise_mask(scores, m)
    top = scores.sort(0, descending=True).values
    agree = (top[m - 1] + top[m]) / 2
    assert batchwise_threshold_loss(scores, agree, mask).item() == 0.0
    for shift in (-1.0, -0.1, 0.1, 1.0):
        assert batchwise_threshold_loss(scores, agree + shift, mask).item() > 0


def test_threshold_descent_learns_the_batchwise_mask():
    """Gradient descent on T alone (the loss's own gradient) reaches full agreement on a batch."""
    scores = torch.rand(64, 4, generator=torch.Generator().manual_seed(3))
    mask = batchwise_mask(scores, 16)
    thresholds = torch.zeros(4, requires_grad=True)
    opt = torch.optim.Adam([thresholds], lr=0.02)
    for _ in range(300):
        opt.zero_grad()
        batchwise_threshold_loss(scores, thresholds, mask).backward()
        opt.step()
    agreement = (threshold_mask(scores, thresholds.detach()) == mask).float().mean().item()
    assert agreement > 0.98, agreement


def test_loss_neg_inf_scores_no_nan():
    scores = torch.tensor([[0.5, float("-inf")], [float("-inf"), 0.2], [0.1, float("-inf")]])
    thresholds = torch.tensor([0.3, 0.1])
    mask = batchwise_mask(scores, 1)  # agrees with the thresholds everywhere
    loss = batchwise_threshold_loss(scores, thresholds, mask)
    assert torch.isfinite(loss) and loss.item() == 0.0
    # a -inf kept by the batchwise mask only because the column is short of finite scores: +inf
    mask2 = batchwise_mask(scores, 2)
    assert batchwise_threshold_loss(scores, thresholds, mask2).item() == float("inf")


def test_loss_low_precision_scores():
    scores = torch.rand(10, 3, generator=torch.Generator().manual_seed(4))
    thresholds = torch.full((3,), 0.5)
    mask = batchwise_mask(scores, 3)
    expected = batchwise_threshold_loss(scores.half().float(), thresholds, mask)
    assert_close(batchwise_threshold_loss(scores.half(), thresholds, mask), expected)


@pytest.mark.parametrize(
    "scores, thresholds, mask, match",
    [
        (torch.rand(4, 3), torch.rand(4), torch.zeros(4, 3, dtype=torch.bool), "thresholds"),
        (torch.rand(4, 3), torch.rand(3, 1), torch.zeros(4, 3, dtype=torch.bool), "thresholds"),
        (torch.rand(4, 3), torch.rand(3), torch.zeros(3, 4, dtype=torch.bool), "batch_mask"),
        (torch.rand(4), torch.rand(4), torch.zeros(4, dtype=torch.bool), "scores"),
    ],
)
def test_loss_bad_shapes(scores, thresholds, mask, match):
    with pytest.raises(ValueError, match=match):
        batchwise_threshold_loss(scores, thresholds, mask)


def test_loss_bad_mask_dtype():
    with pytest.raises(TypeError, match="batch_mask"):
        batchwise_threshold_loss(torch.rand(4, 3), torch.rand(3), torch.zeros(4, 3))


# eq 16: the sparse gate.


def test_sparse_gates_matches_eq16():
    probs = torch.softmax(torch.randn(9, 5, generator=torch.Generator().manual_seed(5)), -1)
    mask = torch.rand(9, 5, generator=torch.Generator().manual_seed(6)) < 0.5
    mask[0] = True
    mask[1] = False
    gates = sparse_gates(probs, mask)
    for j in range(9):
        denom = sum(float(probs[j, i]) for i in range(5) if mask[j, i])
        for i in range(5):
            expected = float(probs[j, i]) / denom if mask[j, i] else 0.0
            assert gates[j, i].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert torch.equal(gates[1], torch.zeros(5))


def test_sparse_gates_with_topk_mask_is_topk_softmax():
    """eq 16 with M = TopK (eq 17) over G_sigma = Softmax(H) is Softmax over the top-k logits."""
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(7))
    weights, experts = topk_softmax(logits, 3)
    mask = torch.zeros(30, 8, dtype=torch.bool).scatter_(1, experts, True)
    gates = sparse_gates(torch.softmax(logits, -1), mask)
    assert_close(gates.gather(1, experts), weights)


def test_sparse_gates_empty_rows_zero_and_no_nan_gradient():
    probs = torch.softmax(torch.randn(6, 4, dtype=torch.float64), -1).requires_grad_()
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[::2, 1] = True
    mask[2, 3] = True
    gates = sparse_gates(probs, mask)
    assert torch.equal(gates[1::2], torch.zeros(3, 4, dtype=torch.float64))
    assert_close(gates[::2].sum(-1), torch.ones(3, dtype=torch.float64))
    gates.pow(2).sum().backward()
    assert not torch.isnan(probs.grad).any()
    assert torch.equal(probs.grad[1::2], torch.zeros(3, 4, dtype=torch.float64))
    # zero probabilities under a non-empty mask: still zeros, not NaN
    zero = sparse_gates(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(zero, torch.zeros(2, 3))


def test_sparse_gates_gradcheck():
    probs = torch.rand(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8)).requires_grad_()
    mask = torch.rand(5, 4, generator=torch.Generator().manual_seed(9)) < 0.6
    mask[0] = False
    assert torch.autograd.gradcheck(lambda p: sparse_gates(p, mask), (probs,))


def test_sparse_gates_with_batchwise_and_threshold_masks():
    probs = torch.softmax(torch.randn(16, 4, generator=torch.Generator().manual_seed(10)), -1)
    for mask in (reference.batchwise_mask(probs, 2)[0], threshold_mask(probs, torch.full((4,), 0.4))):
        gates = sparse_gates(probs, mask)
        nonempty = mask.any(1)
        assert_close(gates[nonempty].sum(-1), torch.ones(int(nonempty.sum())))
        assert torch.equal(gates[~nonempty], torch.zeros(int((~nonempty).sum()), 4))
        assert torch.equal(gates > 0, mask)


def test_sparse_gates_bad_arguments():
    with pytest.raises(ValueError, match="mask"):
        sparse_gates(torch.rand(4, 3), torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        sparse_gates(torch.rand(4, 3), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="gate_probs"):
        sparse_gates(torch.rand(4), torch.zeros(4, dtype=torch.bool))
