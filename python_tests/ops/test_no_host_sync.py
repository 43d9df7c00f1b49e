"""No host sync on the Triton path of any op (issue 30, item 2).

A value read back to the host (`.item()`, `int(t)`, `bool(t)`, `if t:`, `.tolist()`) or an op whose
output shape depends on the data (boolean-mask indexing and `nonzero`, `masked_select`, `unique`)
stops the CPU until the GPU has caught up: once per op per layer, and CUDA-graph capture /
torch.compile(mode="reduce-overhead") fail on it. Each op's Triton path runs here, forward and
backward where it is differentiable, on CPU tensors under the Triton interpreter (the path the GPU
runs, launched by the same Python), inside a CPU profile of only the region from the op's entry to
its outputs (inputs are built before). Any host read in that profile (python_tests/support/
host_sync.py) fails the test, naming the op, the pass and the events. Run in the interpreter
pass:

    TRITON_INTERPRET=1 python -m pytest python_tests/ops/test_no_host_sync.py -m triton
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from host_sync import sync_events, syncs

import moe_kernels
from moe_kernels import backends, ops, reference

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not (backends.triton_importable() and backends.triton_interpreting()),
        reason="the Triton path runs on CPU tensors only under TRITON_INTERPRET=1 (the interpreter pass)",
    ),
]


T, E, K, D = 6, 4, 2, 5  # tokens, experts, choices per token, row width
C = 2  # capacity: T * K / E = 3 choices per expert on average, so some are dropped


@dataclass
class Case:
    """One call of a public op on prepared inputs.

    call: runs the op, returns its output(s).
    kernels: profiler events (the moe_kernels_triton launchers) that must appear in the forward
      profile: proof that the Triton path, not a fallback, was profiled.
    wrt: the inputs to differentiate with respect to (empty: the op is not differentiable).
    """

    call: Callable[[], object]
    kernels: tuple[str, ...]
    wrt: tuple[torch.Tensor, ...] = field(default_factory=tuple)


def _leaf(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


def _routing() -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, K] int64 with one empty (-1) choice, and their capacity positions [T, K] (some
    dropped: -1), computed by the reference outside any profile."""
    g = torch.Generator().manual_seed(1)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    experts[2, 1] = -1
    positions, _ = reference.capacity_positions(experts, E, C)
    return experts, positions


def _topk_softmax(renormalize):
    logits = _leaf(T, E)
    return Case(lambda: ops.topk_softmax(logits, K, renormalize), ("moe_kernels_triton::topk_router",), (logits,))


def _topk_router(grouped, dtype=torch.float32):
    logits = _leaf(T, 8, dtype=dtype)  # float64: the launcher runs the reference on the device
    kwargs = {}
    if grouped:  # DeepSeek-V3's router: sigmoid scores, a correction bias, 2 of 4 groups
        bias = torch.linspace(-0.1, 0.1, 8)
        kwargs = dict(scoring="sigmoid", bias=bias, num_groups=4, topk_groups=2, renormalize=True, scaling_factor=2.5)
    return Case(lambda: ops.topk_router(logits, K, **kwargs), ("moe_kernels_triton::topk_router",), (logits,))


def _load_probabilities():
    clean, noisy = _leaf(T, E, seed=2), _leaf(T, E, seed=3)
    stddev = (torch.rand(T, E, generator=torch.Generator().manual_seed(4)) + 0.5).requires_grad_()
    return Case(
        lambda: ops.load_probabilities(clean, noisy, stddev, K, return_topk=True),
        ("moe_kernels_triton::load_probabilities",),
        (clean, noisy, stddev),
    )


def _noisy_topk_gate(mask_kind):
    clean, raw, noise = _leaf(T, E, seed=5), _leaf(T, E, seed=6), _leaf(T, E, seed=7)
    # A float 0/1 mask is the one whose values the op checks (on the host backends only).
    mask = {"none": None, "bool": torch.tensor([1, 1, 0, 1, 1, 0], dtype=torch.bool)}.get(mask_kind)
    if mask_kind == "float":
        mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    return Case(
        lambda: ops.noisy_topk_gate(clean, raw, noise, K, mask=mask),
        ("moe_kernels_triton::load_probabilities",),
        (clean, raw, noise),
    )


def _capacity_positions(with_priority):
    experts, _ = _routing()
    priority = torch.rand(T, K, generator=torch.Generator().manual_seed(8)) if with_priority else None
    return Case(
        lambda: ops.capacity_positions(experts, E, C, priority=priority), ("moe_kernels_triton::capacity_positions",)
    )


def _dispatch():
    experts, positions = _routing()
    x = _leaf(T, D)
    return Case(lambda: ops.dispatch(x, experts, positions, E, C), ("moe_kernels_triton::dispatch",), (x,))


def _combine():
    experts, positions = _routing()
    buffer, weights = _leaf(E, C, D, seed=9), _leaf(T, K, seed=10)
    return Case(
        lambda: ops.combine(buffer, experts, positions, weights), ("moe_kernels_triton::combine",), (buffer, weights)
    )


def _permute():
    experts, _ = _routing()
    x = _leaf(T, D)
    return Case(lambda: ops.permute(x, experts, E), ("moe_kernels_triton::permute",), (x,))


def _unpermute():
    experts, _ = _routing()
    _, _, order = reference.permute(torch.zeros(T, D), experts, E)
    y_sorted, weights = _leaf(T * K, D, seed=11), _leaf(T, K, seed=12)
    return Case(
        lambda: ops.unpermute(y_sorted, order, weights, T), ("moe_kernels_triton::unpermute",), (y_sorted, weights)
    )


def _batchwise_mask():
    scores = torch.randn(T, E, generator=torch.Generator().manual_seed(13))
    return Case(lambda: ops.batchwise_mask(scores, 3, return_indices=True), ("moe_kernels_triton::batchwise_mask",))


def _batchwise_mask_sampled():
    """Past SAMPLED_FROM tokens with m small: the sampled select (torch.topk, sort, index_fill) and
    the radix path behind it, flagged on the device for the constant column's group."""
    scores = torch.randn(4096, 20, generator=torch.Generator().manual_seed(13))
    scores[:, 17] = 1.0
    return Case(lambda: ops.batchwise_mask(scores, 16, return_indices=True), ("moe_kernels_triton::batchwise_mask",))


def _smooth_step():
    t = _leaf(3, 7)
    return Case(lambda: ops.smooth_step(t, 0.5), ("moe_kernels_triton::smooth_step",), (t,))


def _dselect_k(static):
    n, k, m = 6, 3, 3  # 6 experts: m = ceil(log2 6) = 3 bits, 2 selector entries past n
    alpha, z = (_leaf(k, seed=14), _leaf(k, m, seed=15)) if static else (_leaf(2, k, seed=14), _leaf(2, k, m, seed=15))
    return Case(
        lambda: ops.dselect_k(alpha, z, n, 0.7, return_selectors=True), ("moe_kernels_triton::dselect_k",), (alpha, z)
    )


# Every op with a Triton path, each with the variants whose launcher or backward differs.
CASES: dict[str, dict[str, Callable[[], Case]]] = {
    "topk_softmax": {"renormalize": lambda: _topk_softmax(True), "full": lambda: _topk_softmax(False)},
    "topk_router": {
        "plain": lambda: _topk_router(False),
        "grouped": lambda: _topk_router(True),
        "grouped-float64": lambda: _topk_router(True, torch.float64),
    },
    "load_probabilities": {"": _load_probabilities},
    "capacity_positions": {
        "default": lambda: _capacity_positions(False),
        "priority": lambda: _capacity_positions(True),
    },
    "dispatch": {"": _dispatch},
    "combine": {"": _combine},
    "permute": {"": _permute},
    "unpermute": {"": _unpermute},
    "batchwise_mask": {"radix": _batchwise_mask, "sampled": _batchwise_mask_sampled},
    "smooth_step": {"": _smooth_step},
    "dselect_k": {"static": lambda: _dselect_k(True), "batched": lambda: _dselect_k(False)},
    # Not registered (it has no kernel of its own): on the Triton backend it composes the reference
    # gate with the Triton load_probabilities, its mask check included.
    "noisy_topk_gate": {m: (lambda m=m: _noisy_topk_gate(m)) for m in ("none", "bool", "float")},
}

# Registered ops with no Triton kernel: the reason each is skipped rather than silently left out.
NO_TRITON = {
    "balanced_assignment": "no Triton kernel (C++ CPU solver; the CUDA solver syncs by design)",
    "sinkhorn": "no Triton kernel (reference and C++ CPU only)",
    "skip_sample": "no Triton kernel (a few reference tensor ops on every device)",
}

PARAMS = [
    pytest.param(op, variant, id=f"{op}-{variant}" if variant else op)
    for op in sorted(set(moe_kernels.backends()) | set(CASES))
    for variant in (CASES[op] if op in CASES else [""])
]


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple | list) else [result]


def test_the_profile_sees_host_reads():
    """The check is not vacuous: each kind of read this test forbids shows in the profile."""
    t = torch.tensor([0.0, 1.0, 2.0])
    for read in (lambda: int(t.max()), lambda: bool(t.any()), lambda: t[t > 0], lambda: t.tolist(), lambda: t.unique()):
        assert syncs(sync_events(read)[1]), read


def test_every_registered_op_is_covered():
    """A new op must get a case here (or a reason in NO_TRITON): none is left out silently."""
    registry = backends._REGISTRY
    for op in moe_kernels.backends():
        has_triton = registry[op].triton is not None
        assert (op in CASES) == has_triton, f"{op}: add a case to CASES" if has_triton else f"{op}: stale case"
        assert (op in NO_TRITON) != has_triton, f"{op}: say in NO_TRITON why it has no Triton case"


@pytest.mark.parametrize("op, variant", PARAMS)
def test_no_host_sync(op, variant):
    if op in NO_TRITON:
        pytest.skip(f"{op}: {NO_TRITON[op]}")
    name = f"{op} ({variant})" if variant else op
    found = {}
    with moe_kernels.use_backend("triton"):
        case = CASES[op][variant]()
        outputs, events = sync_events(case.call)
        missing = [kernel for kernel in case.kernels if kernel not in events]
        assert not missing, f"{name}: the Triton launcher(s) {missing} did not run; events: {sorted(events)}"
        found["forward"] = syncs(events)
        if case.wrt:
            # The backward alone: gradients of every differentiable output, built before the profile.
            diff = [o for o in _outputs(outputs) if o.requires_grad]
            grads = [torch.randn_like(o) for o in diff]
            grad_inputs, events = sync_events(lambda: torch.autograd.grad(diff, case.wrt, grads, allow_unused=True))
            assert any(g is not None for g in grad_inputs), f"{name}: the backward produced no gradient"
            found["backward"] = syncs(events)
    found = {phase: syncs for phase, syncs in found.items() if syncs}
    if found:
        pytest.fail(f"{name} reads values on the host (event: count): {found}", pytrace=False)
