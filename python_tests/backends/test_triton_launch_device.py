"""Triton launches run on the tensor's device, not the current one (a tensor on cuda:1 while cuda:0
is current would otherwise be launched on cuda:0, with cuda:0's stream): every launcher of
moe_kernels/triton/*.py goes through common.on_tensor_device. Checked here without a GPU: the
sources (every `<kernel>[grid](...)` inside a decorated function) and the decorator on fake CUDA
tensors."""

import ast
import contextlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from moe_kernels.triton import common  # noqa: E402

TRITON_DIR = Path(common.__file__).resolve().parent


def launches(tree: ast.Module):
    """(enclosing top-level function, line) of every kernel launch `name[grid](...)`."""
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name.endswith("_kernel"):
                    yield fn, node.lineno


def decorated(fn: ast.FunctionDef) -> bool:
    names = {d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "") for d in fn.decorator_list}
    return "on_tensor_device" in names


def test_every_launch_runs_under_the_tensor_device():
    found, bare = [], []
    for path in sorted(TRITON_DIR.glob("*.py")):
        for fn, line in launches(ast.parse(path.read_text())):
            found.append(f"{path.name}:{line}")
            if not decorated(fn):
                bare.append(f"{path.name}:{line} in {fn.name}")
    assert len(found) >= 10, found  # the scan sees the launches (one or two per kernel module)
    assert not bare, f"Triton launches outside @common.on_tensor_device: {bare}"


@pytest.fixture
def entered(monkeypatch):
    """torch.cuda.device replaced by a recorder (a CPU torch cannot enter the real one)."""
    devices = []

    @contextlib.contextmanager
    def device(d):
        devices.append(torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    return devices


def fake_cuda(*shape, index=1):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device=f"cuda:{index}")


def test_launcher_enters_the_device_of_its_first_tensor(entered):
    seen = []

    @common.on_tensor_device
    def launcher(n: int, x: torch.Tensor, y: torch.Tensor | None = None) -> int:
        seen.append(n)
        return n + 1

    assert launcher(3, fake_cuda(2, index=1), y=fake_cuda(2, index=1)) == 4
    assert entered == [torch.device("cuda:1")]
    assert launcher(4, x=fake_cuda(2, index=0)) == 5  # keyword tensors count too
    assert entered[-1] == torch.device("cuda:0")
    assert seen == [3, 4]


def test_cpu_tensors_set_no_device(entered):
    """Under TRITON_INTERPRET=1 the tensors are on the CPU: nothing is entered."""

    @common.on_tensor_device
    def launcher(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert torch.equal(launcher(torch.ones(3)), torch.full((3,), 2.0))
    assert entered == []


def test_custom_op_schema_survives_the_decorator():
    """The decorator sits under @torch.library.custom_op, which infers the schema through it."""
    from moe_kernels.triton import load_probabilities

    assert str(torch.ops.moe_kernels_triton.load_probabilities.default._schema).startswith(
        "moe_kernels_triton::load_probabilities(Tensor clean_logits"
    )
    assert load_probabilities.load_probabilities is not None
