"""Uninitialised allocations filled with junk, for the interpreter pass (python_tests/conftest.py).

On a GPU, torch.empty hands back memory the caching allocator recycled: a kernel that leaves an
output entry unwritten returns stale values there, by chance. On the CPU a fresh allocation is
often zeros, which a test expecting zeros (a dropped slot, an empty row) passes by luck. Under
TRITON_INTERPRET=1 every torch.empty / empty_like / empty_strided / Tensor.new_empty /
new_empty_strided result is filled with junk first (NaN for floats, -7 for signed integers, 201
for uint8, True for bool), so an entry a kernel should write and does not shows in the tests.
Left as they are: fake and meta tensors (torch.compile's tracing, opcheck's fake pass), and every
call while dynamo traces (the fill would go into the graph).

The allocators are replaced by wrappers, so torch's caches keyed by those functions are filled
here first, from the real ones: torch.utils._device's constructors (which `with torch.device(...)`
and set_default_device apply to) and torch.overrides' overridable functions (dynamo's)."""

import torch
import torch.overrides
import torch.utils._device
from torch._subclasses.fake_tensor import is_fake

JUNK_INT = -7
JUNK_UINT8 = 201

torch.utils._device._device_constructors()
torch.overrides.get_overridable_functions()


def junk(t: torch.Tensor) -> torch.Tensor:
    """t, filled with junk where it is a real, non-empty CPU tensor."""
    if is_fake(t) or t.device.type != "cpu" or t.numel() == 0:
        return t
    with torch.no_grad():  # a leaf that requires grad may be filled, as nn.init does
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        elif t.dtype == torch.uint8:
            t.fill_(JUNK_UINT8)
        else:
            t.fill_(JUNK_INT)
    return t


def _filled(allocate):
    def allocate_junk(*args, **kwargs):
        out = allocate(*args, **kwargs)
        return out if torch.compiler.is_compiling() else junk(out)

    return allocate_junk


def poison(monkeypatch) -> None:
    """Patch the allocators for the rest of the test (monkeypatch undoes it)."""
    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, _filled(getattr(torch, name)))
    for name in ("new_empty", "new_empty_strided"):
        monkeypatch.setattr(torch.Tensor, name, _filled(getattr(torch.Tensor, name)))
