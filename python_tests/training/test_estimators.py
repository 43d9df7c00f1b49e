"""The REINFORCE surrogates: unbiasedness of the router gradient against exact enumeration on a
tiny problem (Monte Carlo, within 4 sigma per component), bias of the biased ones, the baseline."""

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import moe_kernels
from moe_kernels import estimators


def exact_gradient(theta, f):
    """grad_theta E_{z ~ p}[(1/n) sum_i f(i, z_i)] = grad (1/n) sum_ij p_ij f_ij."""
    t = theta.clone().requires_grad_()
    (torch.softmax(t, -1) * f).sum().div(f.shape[0]).backward()
    return t.grad


def mc_gradients(name, theta, f, trials, seed, **kw):
    """Per-trial gradients of the surrogate: one leaf copy of theta per trial, one backward."""
    g = torch.Generator().manual_seed(seed)
    th = theta.expand(trials, *theta.shape).clone().requires_grad_()
    log_p = torch.log_softmax(th, -1)
    total = 0.0
    for t in range(trials):
        s = estimators.sample_routing(name, log_p[t], generator=g, **kw)
        fz = f[torch.arange(f.shape[0]), s.experts]
        total = total + estimators.surrogate(log_p[t], s, fz, baseline=0.5)
    total.backward()
    return th.grad


THETA = torch.tensor([[1.0, -0.5], [0.3, 0.2], [-1.0, 0.8], [0.9, 0.1]], dtype=torch.float64)
F = torch.tensor([[1.0, -2.0], [3.0, 0.5], [-1.0, 2.0], [0.0, 4.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("sample", {"tau": 1.0}),
        ("sample", {"tau": 2.0}),
        ("sample_skip_iw", {"tau": 1.0, "capacity": 2}),
        ("sample_skip_iw", {"tau": 1.0, "capacity": 2, "use_sinkhorn": True}),
        ("gumbel_matching_iw", {"tau": 1.0, "capacity": 2}),
        ("gumbel_matching_iw", {"tau": 2.0, "capacity": 3}),
    ],
)
def test_unbiased(name, kw):
    trials = 1000
    grads = mc_gradients(name, THETA, F, trials, seed=1, **kw)
    exact = exact_gradient(THETA, F)
    mean, se = grads.mean(0), grads.std(0) / trials**0.5
    assert ((mean - exact).abs() <= 4 * se + 1e-9).all(), (mean, exact, se)


def test_biased_estimators_are_biased():
    """Without importance weights, Gumbel-Matching is biased here (the balance constraint pulls
    tokens away from their preferred expert)."""
    trials = 1000
    exact = exact_gradient(THETA, F)
    grads = mc_gradients("gumbel_matching", THETA, F, trials, seed=2, capacity=2)
    mean, se = grads.mean(0), grads.std(0) / trials**0.5
    assert ((mean - exact).abs() > 4 * se).any()


def test_sample_skip_iw_weights_and_normalizers():
    log_p = torch.log_softmax(torch.randn(10, 3), -1)
    s = estimators.sample_routing("sample_skip", log_p, capacity=2, generator=torch.Generator().manual_seed(0))
    assert s.normalizer == float((s.weights > 0).sum())
    s = estimators.sample_routing("sample_skip_iw", log_p, capacity=2, importance_weights=False)
    counts = torch.bincount(s.experts, minlength=3).double()
    assert torch.allclose(torch.zeros(3, dtype=torch.float64).index_add_(0, s.experts, s.weights), counts)


def test_ema_baseline_and_load_loss():
    b = estimators.EMABaseline(0.99)
    assert b() == 0.0
    b.update(torch.tensor([2.0, 4.0]))
    b.update(torch.tensor([0.0]))
    assert abs(b() - 0.99 * 3.0) < 1e-12
    probs = torch.full((8, 4), 0.25)
    assert torch.isclose(estimators.load_balancing_loss(probs, torch.arange(8) % 4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="unknown estimator"):
        estimators.sample_routing("nope", probs.log())


def test_gumbel_matching_with_sinkhorn_is_gumbel_matching_sh():
    """Sinkhorn does not change the Gumbel-Matching samples, and with Sinkhorn proposals the plain
    estimator's weights p / p~ are those of Gumbel-Matching SH (module docstring)."""
    log_p = torch.log_softmax(torch.randn(12, 3, dtype=torch.float64), -1)
    a = estimators.sample_routing(
        "gumbel_matching", log_p, tau=2.0, use_sinkhorn=True, generator=torch.Generator().manual_seed(3)
    )
    b = estimators.sample_routing("gumbel_matching_sh", log_p, tau=2.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.experts, b.experts) and torch.allclose(a.weights, b.weights)


def test_gating_loss():
    """The weighted mean of the gated losses plus 0.01 x the load loss; the router gets the load
    loss's gradient even where f does not depend on it, and skipped tokens (weight 0) none."""
    theta = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    log_p = torch.log_softmax(theta, -1)
    s = estimators.sample_routing("sample_skip", log_p, capacity=2, tau=2.0, generator=torch.Generator().manual_seed(0))
    f = torch.rand(6, dtype=torch.float64)
    expected = (s.weights * f).sum() / s.normalizer + 0.01 * estimators.load_balancing_loss(log_p.exp(), s.experts)
    loss = estimators.gating_loss(log_p, s, f, 0.01)
    assert torch.isclose(loss, expected)
    loss.backward()
    assert theta.grad.abs().sum() > 0
    f_param = torch.rand(6, dtype=torch.float64, requires_grad=True)
    estimators.gating_loss(log_p.detach(), s, f_param, 0.0).backward()
    assert torch.equal(f_param.grad == 0, s.weights == 0)


class OneDevice(TorchFunctionMode):
    """Records every torch call whose tensor arguments sit on more than one device."""

    def __init__(self):
        super().__init__()
        self.mixed = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {a.device for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        if len(devices) > 1:
            self.mixed.append((getattr(func, "__name__", str(func)), sorted(map(str, devices))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("solver", ["default", "torch"])
@pytest.mark.parametrize("name", estimators.ESTIMATORS)
def test_sample_routing_stays_on_the_input_device(name, solver):
    """Every tensor sample_routing makes is on log_p's device. Checked on the CPU: with 'meta' as
    the default device, a tensor made without device= lands on meta, and any torch call mixing it
    with the CPU inputs is recorded (on a GPU the same tensor would be a CPU tensor next to CUDA
    ones: an error, or a silent copy). The outputs must be on log_p's device."""
    log_p = torch.log_softmax(torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4)), -1)

    def backend():  # "torch": the reference solvers (sinkhorn, balanced_assignment) too
        return moe_kernels.use_backend("torch") if solver == "torch" else contextlib.nullcontext()

    for importance_weights in (True, False):
        for use_sinkhorn in (False, True):
            mode = OneDevice()
            with backend(), torch.device("meta"), mode:
                s = estimators.sample_routing(
                    name,
                    log_p,
                    capacity=4,
                    use_sinkhorn=use_sinkhorn,
                    importance_weights=importance_weights,
                    generator=torch.Generator(device="cpu").manual_seed(0),
                )
            assert not mode.mixed, (importance_weights, use_sinkhorn, mode.mixed)
            assert s.experts.device == s.weights.device == log_p.device
