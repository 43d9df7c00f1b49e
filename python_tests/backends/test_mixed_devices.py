"""Every op with several tensor arguments: one argument on another device (here 'meta') is a
ValueError naming both arguments, never a kernel reading memory it does not own. One line per
(op, argument)."""

import pytest
import torch

from moe_kernels import ops

T, E, k, d, C = 6, 4, 2, 3, 4


def inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g)
    _, experts = ops.topk_softmax(logits, k)
    positions, _ = ops.capacity_positions(experts, E, C)
    x = torch.randn(T, d, generator=g)
    x_sorted, _, order = ops.permute(x, experts, E)
    return dict(
        logits=logits,
        experts=experts,
        positions=positions,
        x=x,
        buffer=torch.randn(E, C, d, generator=g),
        weights=torch.rand(T, k, generator=g),
        y_sorted=x_sorted,
        order=order,
        ones=torch.ones(T, E),
        mask=torch.ones(T, dtype=torch.bool),
        priority=torch.rand(T, k, generator=g),
        thresholds=torch.zeros(E),
        alpha=torch.randn(5, 2, generator=g),
        z=torch.randn(5, 2, 2, generator=g),
        bias=torch.zeros(E),
        gumbels=torch.randn(T, E, generator=g),
    )


# (op name, call taking the inputs dict, the argument moved to 'meta', the argument it is compared with)
CASES = [
    ("load_probabilities", lambda a: ops.load_probabilities(a["logits"], a["logits"], a["ones"], k), 2, "noise_stddev"),
    ("noisy_topk_gate", lambda a: ops.noisy_topk_gate(a["logits"], a["ones"], a["logits"], k), 2, "raw_noise_stddev"),
    (
        "noisy_topk_gate",
        lambda a: ops.noisy_topk_gate(a["logits"], a["ones"], a["logits"], k, mask=a["mask"]),
        "mask",
        "mask",
    ),
    (
        "capacity_positions",
        lambda a: ops.capacity_positions(a["experts"], E, C, priority=a["priority"]),
        "priority",
        "priority",
    ),
    ("dispatch", lambda a: ops.dispatch(a["x"], a["experts"], a["positions"], E, C), "positions", "positions"),
    ("combine", lambda a: ops.combine(a["buffer"], a["experts"], a["positions"], a["weights"]), "weights", "weights"),
    ("permute", lambda a: ops.permute(a["x"], a["experts"], E), "experts", "experts"),
    ("unpermute", lambda a: ops.unpermute(a["y_sorted"], a["order"], a["weights"], T), "order", "order"),
    ("threshold_mask", lambda a: ops.threshold_mask(a["logits"], a["thresholds"]), "thresholds", "thresholds"),
    ("dselect_k", lambda a: ops.dselect_k(a["alpha"], a["z"], 4), "z", "z"),
    ("topk_router", lambda a: ops.topk_router(a["logits"], k, bias=a["bias"]), "bias", "bias"),
    ("gumbel_matching", lambda a: ops.gumbel_matching(a["logits"], gumbels=a["gumbels"]), "gumbels", "gumbels"),
]


@pytest.mark.parametrize("op, call, moved, name", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_one_argument_on_another_device(op, call, moved, name):
    a = inputs()
    call(a)  # runs on one device
    key = moved if isinstance(moved, str) else "ones"
    a[key] = a[key].to("meta")
    with pytest.raises(ValueError, match=f"{name} is on meta but .* is on cpu|.* is on meta but {name} is on cpu"):
        call(a)
