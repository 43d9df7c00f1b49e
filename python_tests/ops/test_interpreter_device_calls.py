"""The interpreter pass's wrapper of triton's repatching (python_tests/support/interpreter_device_calls.py,
installed by conftest): installed under the pinned triton, helpers called in a kernel's loop (ours
and triton's standard library, which sees tl.core) still compute what they should, the repeated
patches are skipped, and triton.language is as it was once the kernel ends."""

import interpreter_device_calls
import pytest
import torch

from moe_kernels import backends

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not backends.triton_interpreting(), reason="the interpreter pass's patching"),
]


def test_installed_under_this_triton():
    # Fails under a triton the wrapper was not checked against (interpreter_device_calls.CHECKED):
    # the pass is still right there, only slower. Read that triton's interpreter (_patch_lang,
    # GridExecutor, InterpretedFunction.__call__) and add its release once the wrapper fits it.
    from triton.runtime import interpreter

    assert interpreter_device_calls.install()
    assert interpreter._patch_lang.__qualname__ == "install.<locals>.patch_lang"


triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def twice_plus(x, c):
    return x * 2 + c


@triton.jit
def helpers_in_a_loop(x_ptr, out_ptr, total_ptr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols)
    for r in tl.static_range(ROUNDS):
        x = twice_plus(x, r)
    tl.store(out_ptr + cols, x)
    tl.store(total_ptr + tl.program_id(0), tl.sum(x, axis=0))  # tl.sum: triton's standard library


def test_helpers_in_a_loop_compute_as_before():
    arange = tl.arange
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out, total = torch.empty_like(x), torch.empty(3)
    before = dict(interpreter_device_calls.STATS)
    helpers_in_a_loop[(3,)](x, out, total, ROUNDS=5, BLOCK=4)
    expected = x.clone()
    for r in range(5):
        expected = expected * 2 + r
    assert torch.equal(out, expected)
    assert torch.equal(total, expected.sum(1))
    # 5 calls of twice_plus and tl.sum's calls a program, all but tl.sum's first (tl.core) skipped
    assert interpreter_device_calls.STATS["skipped"] - before["skipped"] >= 3 * 5
    assert tl.arange is arange and tl.core.is_builtin(tl.arange), "the launch's patch was restored"
