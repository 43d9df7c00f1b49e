"""Registered ops called raw (torch.ops.moe_kernels.*) with malicious indices: a clear IndexError,
never a crash or an out-of-bounds access. The cases run in one subprocess, each announced before
it runs, so a segfault fails the test and names the case instead of killing the suite."""

import subprocess
import sys
import textwrap

import pytest

from moe_kernels import _extension

SETUP = """
import torch, moe_kernels
from moe_kernels import reference
ops = torch.ops.moe_kernels
T, E, k = 4, 8, 2
x = torch.randn(T, E)
w_x, experts = reference.topk_softmax(x, k)
clean, noise, raw = torch.randn(T, E), torch.randn(T, E), torch.randn(T, E)
noisy, stddev, g_w, g_p, g_load = clean + noise, torch.ones(T, E), torch.randn(T, k), torch.randn(T, E), torch.randn(E)
_, top = ops.load_probabilities(clean, noisy, stddev, k)
_, top_gate, _ = ops.noisy_topk_gate(clean, raw, noise, k, 1e-2, None)
"""

# (index tensor, position, call with the edited index as `i`): one line per op and position.
CASES = [
    ("experts", "1, 1", "ops.topk_router_backward(g_w, x, i, 'softmax', True, 1.0, True)"),
    ("experts", "0, 0", "ops.topk_router_backward(g_w, x, i, 'softmax', False, 1.0, True)"),
    ("experts", "3, 1", "ops.topk_router_backward_from_weights(g_w, w_x, i, E, 1.0, torch.float32)"),
    ("experts", "1, 0", "ops.topk_router_backward_from_weights(g_w, w_x, i, E, 1.0, torch.bfloat16)"),
    ("experts", "2, 1", "ops.topk_router_backward(g_w, x, i, 'softmax', True, 1.0, False)"),
    ("experts", "2, 0", "ops.topk_router_backward(g_w, x, i, 'sigmoid', False, 1.0, False)"),
    ("experts", "3, 0", "ops.topk_router_backward(g_w, x, i, 'softmax', False, 1.0, False)"),
    ("top", "1, 1", "ops.load_probabilities_backward(g_p, clean, noisy, stddev, i, k)"),
    ("top", "3, k", "ops.load_probabilities_backward(g_p, clean, noisy, stddev, i, k)"),
    ("top_gate", "0, 0", "ops.noisy_topk_gate_backward(g_w, g_load, clean, raw, noise, None, i, k, 1e-2)"),
    ("top_gate", "2, k", "ops.noisy_topk_gate_backward(g_w, g_load, clean, raw, noise, None, i, k, 1e-2)"),
]
BAD_VALUES = ["8", "10**6", "-1", "-5", "-(2**62)"]


def script():
    lines = [SETUP]
    for tensor, position, call in CASES:
        for bad in BAD_VALUES:
            name = f"{call.split('(')[0]} {tensor}[{position}] = {bad}"
            lines.append(
                textwrap.dedent(f"""
                print("case:", {name!r}, flush=True)
                i = {tensor}.clone(); i[{position}] = {bad}
                try:
                    {call}
                except IndexError as error:
                    assert "out of range" in str(error), error
                else:
                    raise SystemExit("accepted: " + {name!r})
                """)
            )
    lines.append(
        textwrap.dedent("""
        print("case: topk_router_backward with k = 0", flush=True)
        try:
            ops.topk_router_backward(torch.randn(T, 0), x, experts[:, :0].contiguous(), "softmax", True, 1.0, False)
        except RuntimeError as error:
            assert "k >= 1" in str(error), error
        else:
            raise SystemExit("accepted k = 0")
        """)
    )
    lines.append('print("all rejected")')
    return "\n".join(lines)


@pytest.mark.skipif(not _extension.LOADED, reason="no C++ extension")
def test_malicious_indices_raise_index_error():
    result = subprocess.run([sys.executable, "-c", script()], capture_output=True, text=True, timeout=600)
    last = result.stdout.strip().splitlines()[-1:] or ["(nothing ran)"]
    assert result.returncode == 0, f"exit {result.returncode} at {last[0]}: {result.stderr[-2000:]}"
    assert last == ["all rejected"]
    assert result.stdout.count("case:") == len(CASES) * len(BAD_VALUES) + 1
