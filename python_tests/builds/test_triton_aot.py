"""Every Triton kernel compiled ahead of time for sm_80 and sm_90, with no GPU present.

The interpreter forgives what the compiler does not (layouts, dtypes of loop-carried values,
unsupported ops), so each kernel listed in a module's AOT_KERNELS is lowered all the way to a
cubin, and ptxas must report no register spills. Runs only outside TRITON_INTERPRET (which turns
triton.language helpers into interpreted functions).
"""

import importlib
import os
import pkgutil
import re
import subprocess
from pathlib import Path

import pytest

from moe_kernels import backends

pytestmark = pytest.mark.skipif(
    backends.triton_interpreting() or not backends.triton_importable(),
    reason="AOT compile needs triton without TRITON_INTERPRET",
)


def aot_kernels():
    import moe_kernels.triton as package

    cases = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"moe_kernels.triton.{info.name}")
        for i, (kernel, signature, constexprs, options) in enumerate(getattr(module, "AOT_KERNELS", [])):
            cases.append(pytest.param(kernel, signature, constexprs, options, id=f"{info.name}-{kernel.__name__}-{i}"))
    return cases


def ptxas_report(ptx: str, arch: int, tmp_path: Path) -> str:
    """ptxas -v on the PTX Triton produced, with the ptxas Triton itself uses for `arch`, for the
    target the PTX names (sm_90a for sm_90)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    out = subprocess.run(
        [str(ptxas), "-v", f"--gpu-name={target}", str(src), "-o", str(tmp_path / "k.cubin")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr + out.stdout


def test_compiles_with_the_expected_triton():
    """`make test-aot-gpu-triton` puts the GPU machines' triton ahead of the venv's: where it says
    which (MOE_KERNELS_EXPECT_TRITON), the compiles below must be that triton's, or the pass would
    check the venv's triton twice."""
    import triton

    expected = os.environ.get("MOE_KERNELS_EXPECT_TRITON")
    if not expected:
        pytest.skip("MOE_KERNELS_EXPECT_TRITON is unset: the venv's triton compiles")
    assert triton.__version__ == expected, f"triton {triton.__version__} from {triton.__file__}, expected {expected}"


def test_every_module_lists_its_kernels():
    """A Triton module without AOT_KERNELS would silently skip the compile check."""
    import moe_kernels.triton as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"moe_kernels.triton.{info.name}")
        jitted = [
            v for v in vars(module).values() if type(v).__name__ == "JITFunction" and v.__module__ == module.__name__
        ]
        launched = [v for v in jitted if v.fn.__name__.endswith("_kernel")]  # helpers are inlined into these
        listed = {entry[0].fn.__name__ for entry in getattr(module, "AOT_KERNELS", [])}
        missing = {k.fn.__name__ for k in launched} - listed
        assert not missing, f"moe_kernels.triton.{info.name}: kernels missing from AOT_KERNELS: {missing}"


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernel, signature, constexprs, options", aot_kernels())
def test_compiles_for_gpu(kernel, signature, constexprs, options, arch, tmp_path):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options=options,
    )
    assert compiled.asm["cubin"], "no cubin produced"
    report = ptxas_report(compiled.asm["ptx"], arch, tmp_path)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, f"register spills:\n{report}"
