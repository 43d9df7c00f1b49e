"""Bad arguments found by the hardening audit (issue 15): each a ValueError / TypeError naming
the argument, or (balanced_assignment's huge capacity) the same answer as a sane value."""

import pytest
import torch

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import balanced_assignment, capacity_for, noisy_topk_gate


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((16, 4, 2, float("nan")), ValueError, "capacity_factor must be a finite number > 0"),
        ((16, 4, 2, float("inf")), ValueError, "capacity_factor must be a finite number > 0"),
        ((16, 4, 2, -1.0), ValueError, "capacity_factor must be a finite number > 0"),
        ((16, 4, 2, 0.0), ValueError, "capacity_factor must be a finite number > 0"),
        ((16, 0, 2, 1.0), ValueError, "num_experts must be in"),
        ((16, 4, 0, 1.0), ValueError, "k must be in"),
        ((-1, 4, 2, 1.0), ValueError, "num_tokens must be in"),
        ((16, 4, 2, "1"), TypeError, "capacity_factor must be a float"),
        ((16.0, 4, 2, 1.0), TypeError, "num_tokens must be an int"),
    ],
)
def test_capacity_for(args, error, match):
    with pytest.raises(error, match=match):
        capacity_for(*args)


def test_capacity_for_values_unchanged():
    for T, E, k, f, m in [(0, 4, 2, 1.0, 0), (16, 4, 2, 1.25, 0), (7, 3, 1, 0.5, 4), (4096, 64, 2, 1.25, 1)]:
        assert capacity_for(T, E, k, f, m) == reference.capacity_for(T, E, k, f, m)


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), -1.0, 0.0])
def test_moe_capacity_factor(factor):
    with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
        moe_kernels.MoE(8, 4, 16, capacity_factor=factor)
    with pytest.raises(ValueError, match="eval_capacity_factor must be a finite number > 0"):
        moe_kernels.MoE(8, 4, 16, eval_capacity_factor=factor)


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1e-2])
def test_noise_epsilon(eps):
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="noise_epsilon must be a finite number >= 0"):
        noisy_topk_gate(x, x, x, 2, noise_epsilon=eps)


def test_balanced_assignment_huge_capacity_is_no_capacity():
    scores = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    expected = balanced_assignment(scores, 12)
    assert torch.equal(balanced_assignment(scores, 2**62), expected)
    assert torch.equal(balanced_assignment(scores, 2**40), expected)


def test_smooth_step_tiny_gamma():
    from moe_kernels.ops import smooth_step

    with pytest.raises(ValueError, match="gamma must be >= 1e-12"):
        smooth_step(torch.tensor([0.0, 1e-15]), 1e-14)
    out = smooth_step(torch.tensor([-1e-12, 0.0, 1e-12]), 1e-12)
    assert torch.isfinite(out).all()


def test_gumbel_matching_names_the_gumbels():
    from moe_kernels.ops import gumbel_matching

    gumbels = torch.randn(6, 3)
    gumbels[0, 0] = float("nan")
    with pytest.raises(ValueError, match="gumbels must be finite"):
        gumbel_matching(torch.randn(6, 3), gumbels=gumbels)


@pytest.mark.parametrize("edit, match", [("repeat", "more than once"), ("range", "order values must be in")])
def test_unpermute_order(edit, match):
    from moe_kernels.ops import permute, unpermute

    x = torch.randn(5, 3)
    experts = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [2, 1]])
    y_sorted, _, order = permute(x, experts, 3)
    bad = order.clone()
    if edit == "repeat":
        bad[1] = bad[0]
    else:
        bad[2] = 10
    with pytest.raises(ValueError, match=match):
        unpermute(y_sorted, bad, torch.ones(5, 2), 5)
    unpermute(y_sorted, order, torch.ones(5, 2), 5)  # the real order still works


@pytest.mark.parametrize("value", [float("nan"), 5.0, -1.0, 0.5])
def test_noisy_gate_mask_values(value):
    x = torch.randn(4, 6)
    mask = torch.ones(4)
    mask[2] = value
    with pytest.raises(ValueError, match="mask must be bool or hold only 0 and 1"):
        noisy_topk_gate(x, x, x, 2, mask=mask)
    noisy_topk_gate(x, x, x, 2, mask=torch.tensor([1.0, 0.0, 1.0, 1.0]))


def test_dispatch_refuses_two_choices_on_one_slot():
    # Two kept choices on one (expert, slot) would leave one silently unrouted. The C++ kernel
    # refuses them while building its slot map; the GPU kernels cannot without a sync (docs/dispatch.md).
    if not moe_kernels._extension.has_kernel("dispatch", "CPU"):
        pytest.skip("no C++ kernel in this build")
    x = torch.randn(3, 4)
    experts = torch.tensor([[0, 1], [0, 1], [1, 0]])
    positions, _ = moe_kernels.ops.capacity_positions(experts, 2, 3)
    with moe_kernels.use_backend("cpu"):
        moe_kernels.ops.dispatch(x, experts, positions, 2, 3)  # capacity_positions' slots: fine
        clash = positions.clone()
        clash[1, 0] = clash[0, 0]  # tokens 0 and 1 both on expert 0's first slot
        with pytest.raises(ValueError, match=r"dispatch: positions put 1 kept choice\(s\) on a slot"):
            moe_kernels.ops.dispatch(x, experts, clash, 2, 3)
        dropped = clash.clone()
        dropped[1, 0] = -1  # a dropped choice holds no slot: fine
        moe_kernels.ops.dispatch(x, experts, dropped, 2, 3)


# ---------------------------------------------------------------- issue 34, defect 6
@pytest.mark.parametrize(
    "call, name",
    [
        (lambda L, t: moe_kernels.ops.load_probabilities(L, t, t.abs(), 1), "clean_logits"),
        (lambda L, t: moe_kernels.ops.load_probabilities(t, L, t.abs(), 1), "noisy_logits"),
        (lambda L, t: moe_kernels.ops.load_probabilities(t, t, L, 1), "noise_stddev"),
        (lambda L, t: balanced_assignment(L, 1), "scores"),
        (lambda L, t: moe_kernels.ops.threshold_mask(L, t[0]), "scores"),
        (lambda L, t: moe_kernels.ops.threshold_mask(t, L[0]), "thresholds"),
    ],
)
def test_python_list_is_a_type_error_naming_the_argument(call, name):
    L = [[0.1, 0.2], [0.3, 0.4]]
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
        call(L, torch.tensor(L))


def _gates_with_d16():
    from moe_kernels.compat.torchtitan import Linear, TokenChoiceTopKRouter
    from moe_kernels.gates import BalancedAssignmentGate, BatchwiseGate, SinkhornGate

    titan = TokenChoiceTopKRouter.Config(num_experts=4, gate=Linear.Config(in_features=16, out_features=4), top_k=2)
    return {
        "batchwise": BatchwiseGate(16, 4, 2),
        "balanced_assignment": BalancedAssignmentGate(16, 4),
        "sinkhorn": SinkhornGate(16, 4),
        "torchtitan": titan.build(),
    }


@pytest.mark.parametrize("gate", ["batchwise", "balanced_assignment", "sinkhorn", "torchtitan"])
@pytest.mark.parametrize("masked", [False, True])
def test_gate_with_the_wrong_d_names_x(gate, masked):
    """A wrong feature size is a ValueError naming x and the expected shape, not the router
    matmul's RuntimeError."""
    module = _gates_with_d16()[gate]
    x = torch.randn(6, 8)
    if masked and gate == "torchtitan":
        pytest.skip("torchtitan's router takes no mask")
    kwargs = {"mask": torch.ones(6, dtype=torch.bool)} if masked else {}
    with pytest.raises(ValueError, match=r"^x(_TD)? must be \[.*\] with (d_model|D) = 16.*got \(6, 8\)"):
        module(x, **kwargs)
    module(torch.randn(6, 16), **kwargs)  # the right size still works


def _construct(name):
    from moe_kernels.gates import (
        AuxLossFreeGate,
        BalancedAssignmentGate,
        BatchwiseGate,
        NoisyTopKGate,
        SinkhornGate,
        TopKGate,
    )

    return {
        "balanced_float_experts": lambda: BalancedAssignmentGate(16, 2.5),
        "balanced_float_d": lambda: BalancedAssignmentGate(16.0, 4),
        "batchwise_float_experts": lambda: BatchwiseGate(16, 2.5, 1),
        "sinkhorn_float_experts": lambda: SinkhornGate(16, 2.5),
        "topk_negative_jitter": lambda: TopKGate(16, 4, 2, jitter=-1),
        "topk_nan_jitter": lambda: TopKGate(16, 4, 2, jitter=float("nan")),
        "moe_negative_min_capacity": lambda: moe_kernels.MoE(8, 4, 16, min_capacity=-1),
        "moe_float_min_capacity": lambda: moe_kernels.MoE(8, 4, 16, min_capacity=1.5),
        "moe_zero_d_hidden": lambda: moe_kernels.MoE(8, 4, 0),
        "noisy_negative_epsilon": lambda: NoisyTopKGate(16, 4, 2, noise_epsilon=-1),
        "noisy_nan_epsilon": lambda: NoisyTopKGate(16, 4, 2, noise_epsilon=float("nan")),
        "aux_loss_free_groups_not_dividing": lambda: AuxLossFreeGate(16, 16, 2, num_groups=3),
        "aux_loss_free_topk_groups": lambda: AuxLossFreeGate(16, 16, 2, num_groups=4, topk_groups=5),
        "aux_loss_free_scoring": lambda: AuxLossFreeGate(16, 16, 2, scoring="tanh"),
    }[name]


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("balanced_float_experts", TypeError, "num_experts must be an int"),
        ("balanced_float_d", TypeError, "d_model must be an int"),
        ("batchwise_float_experts", TypeError, "num_experts must be an int"),
        ("sinkhorn_float_experts", TypeError, "num_experts must be an int"),
        ("topk_negative_jitter", ValueError, r"jitter must be a finite number in \[0, 1\]"),
        ("topk_nan_jitter", ValueError, r"jitter must be a finite number in \[0, 1\]"),
        ("moe_negative_min_capacity", ValueError, r"min_capacity must be in \[0, inf\]"),
        ("moe_float_min_capacity", TypeError, "min_capacity must be an int"),
        ("moe_zero_d_hidden", ValueError, r"d_hidden must be in \[1, inf\]"),
        ("noisy_negative_epsilon", ValueError, "noise_epsilon must be a finite number >= 0"),
        ("noisy_nan_epsilon", ValueError, "noise_epsilon must be a finite number >= 0"),
        ("aux_loss_free_groups_not_dividing", ValueError, "num_groups must divide"),
        ("aux_loss_free_topk_groups", ValueError, r"topk_groups must be in \[1, 4\]"),
        ("aux_loss_free_scoring", ValueError, "scoring must be one of"),
    ],
)
def test_bad_construction_raises_at_construction(name, error, match):
    """Arguments that used to be accepted silently, or fail only at the first forward (or with an
    error that does not name them): refused when the module is built, naming the argument."""
    with pytest.raises(error, match=match):
        _construct(name)()


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan")])
def test_moe_mask_values(value):
    """MoE(x, mask=...) with a non-bool mask: only 0 and 1 (a 0.5 used to become True, while
    noisy_topk_gate refuses it), checked where the mask is a CPU tensor (no device read)."""
    moe = moe_kernels.MoE(8, 4, 16)
    x = torch.randn(4, 8)
    mask = torch.ones(4)
    mask[1] = value
    with pytest.raises(ValueError, match="mask must be bool or hold only 0 and 1"):
        moe(x, mask=mask)
    moe(x, mask=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    moe(x, mask=torch.tensor([1, 0, 1, 1]))
    moe(x, mask=torch.tensor([True, False, True, True]))
