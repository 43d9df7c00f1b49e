"""The interpreter pass's junk in uninitialised allocations (python_tests/support/poisoned_empty.py,
conftest's `_junk_in_empty`): what it fills, what it leaves, and that it catches a kernel that
leaves an output entry unwritten."""

import pytest
import torch

from moe_kernels import backends

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not backends.triton_interpreting(), reason="the interpreter pass's allocations"),
]


def test_allocations_hold_junk():
    assert torch.isnan(torch.empty(3, 2)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(4, dtype=torch.bfloat16))).all()
    assert (torch.empty_strided((2, 2), (1, 2), dtype=torch.int64) == -7).all()
    assert (torch.zeros(1).new_empty((5,), dtype=torch.int32) == -7).all()
    assert (torch.zeros(1).new_empty((5,), dtype=torch.uint8) == 201).all()
    assert torch.zeros(1).new_empty((3,), dtype=torch.bool).all()
    leaf = torch.empty(3, requires_grad=True)
    assert leaf.requires_grad and leaf.is_leaf and torch.isnan(leaf).all()


def test_traced_allocations_stay_as_torch_makes_them():
    """Under torch.compile the fill stays out of the graph; `with torch.device(...)` still applies
    to the allocators (torch's caches of them were filled from the real ones)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: x + torch.empty(3).zero_(), fullgraph=True, backend=record)
    assert torch.equal(compiled(torch.ones(3)), torch.ones(3))
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert targets and not any("fill" in t for t in targets), targets
    with torch.device("meta"):
        assert torch.empty(2).device.type == "meta"
        assert torch.empty_strided((2,), (1,)).device.type == "meta"


def test_an_unwritten_output_entry_shows():
    """A launcher allocating its output with torch.empty and a kernel writing all but one entry:
    the entry holds NaN, where a fresh CPU allocation would often hold the 0.0 a test expects."""
    import triton
    import triton.language as tl

    @triton.jit
    def all_but_last(out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=offs < n - 1)

    out = torch.empty(8)
    all_but_last[(1,)](out, 8, BLOCK=8)
    assert torch.equal(out[:7], torch.zeros(7)) and torch.isnan(out[7])
