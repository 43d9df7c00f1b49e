"""moe_kernels.losses: values by hand, gradients, and masks (a masked batch equals the batch of
its real tokens only)."""

import pytest
import torch
from tolerances import assert_close

from moe_kernels import losses
from moe_kernels.routing import Routing


def routing_tensors(T=12, E=5, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    weights, experts = torch.softmax(logits, -1).topk(k, dim=-1)
    return logits, experts, weights


def test_cv_squared_values():
    assert losses.cv_squared(torch.tensor([2.0, 2.0, 2.0])).item() == 0.0
    assert_close(losses.cv_squared(torch.tensor([0.0, 2.0])), torch.tensor(1.0))  # var 1, mean 1
    assert_close(losses.cv_squared(torch.tensor([1.0, 2.0, 3.0, 6.0])), torch.tensor(3.5 / 9.0))
    assert losses.cv_squared(torch.tensor([7.0])).item() == 0.0
    assert torch.isfinite(losses.cv_squared(torch.zeros(4)))


def test_importance_is_the_column_sum_of_g():
    _, experts, weights = routing_tensors()
    experts[0, 1] = -1  # an empty choice counts nothing
    dense = Routing(experts, weights, 5, torch.zeros(())).dense()
    assert_close(losses.importance(experts, weights, 5), dense.sum(0))


def test_importance_loss_gradient():
    _, experts, weights = routing_tensors()
    w = weights.clone().requires_grad_()
    losses.importance_loss(experts, w, 5, 0.1).backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_load_and_load_loss():
    P = torch.rand(10, 4)
    assert_close(losses.load(P), P.sum(0))
    assert_close(losses.load_loss(P, 0.5), 0.5 * losses.cv_squared(P.sum(0)))


def test_switch_aux_loss_is_one_at_balance():
    T, E = 8, 4
    probs = torch.full((T, E), 1.0 / E)
    experts = torch.arange(T).remainder(E).unsqueeze(1)
    assert_close(losses.switch_aux_loss(probs, experts), torch.tensor(1.0))
    experts2 = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)
    assert_close(losses.switch_aux_loss(probs, experts2), torch.tensor(1.0))


def test_switch_aux_loss_by_hand():
    logits, experts, _ = routing_tensors(T=6, E=3, k=1, seed=1)
    probs = torch.softmax(logits, -1)
    f = torch.bincount(experts[:, 0], minlength=3).float() / 6
    assert_close(losses.switch_aux_loss(probs, experts), 3 * (f * probs.mean(0)).sum())


def test_switch_aux_loss_collapsed_is_large():
    probs = torch.zeros(8, 4)
    probs[:, 0] = 1.0
    experts = torch.zeros(8, 1, dtype=torch.int64)
    assert_close(losses.switch_aux_loss(probs, experts), torch.tensor(4.0))


def test_z_loss_by_hand():
    logits, _, _ = routing_tensors()
    assert_close(losses.z_loss(logits), (torch.logsumexp(logits, -1) ** 2).mean())


@pytest.mark.parametrize("name", ["importance", "load", "switch", "z"])
def test_masks_drop_padding(name):
    logits, experts, weights = routing_tensors(T=16, E=5, k=2, seed=2)
    P = torch.rand(16, 5, generator=torch.Generator().manual_seed(3))
    mask = torch.rand(16, generator=torch.Generator().manual_seed(4)) < 0.6
    fns = {
        "importance": lambda s, m: losses.importance_loss(experts[s], weights[s], 5, 0.3, mask=m),
        "load": lambda s, m: losses.load_loss(P[s], 0.3, mask=m),
        "switch": lambda s, m: losses.switch_aux_loss(torch.softmax(logits[s], -1), experts[s], mask=m),
        "z": lambda s, m: losses.z_loss(logits[s], mask=m),
    }
    fn = fns[name]
    everything = slice(None)
    masked = fn(everything, mask)
    assert_close(masked, fn(mask, None))
    assert not torch.allclose(masked, fn(everything, None))  # the mask did change something
    assert_close(fn(everything, torch.ones(16, dtype=torch.bool)), fn(everything, None))


def test_bad_mask_shape():
    logits, _, _ = routing_tensors()
    with pytest.raises(ValueError, match="mask"):
        losses.z_loss(logits, mask=torch.ones(3))
