"""Every CUDA kernel (csrc/cuda/*.cu) compiled by nvcc for sm_80 and sm_90, and the torch glue
(csrc/cuda_ops.cpp) syntax-checked against torch's headers, with no GPU and no CUDA torch.

The compiles need nvcc (the CUDA toolkit): without it they skip, saying so (`pytest -rs`);
MOE_KERNELS_REQUIRE_NVCC=1 (set by .ci/run: this project's machines have nvcc) makes a missing
nvcc a failure. The source checks below need no toolkit and always run.
"""

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import setup_py
from cuda_toolkit import nvcc

ROOT = Path(__file__).resolve().parents[2]
CU_FILES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))


def test_there_are_cuda_kernels():
    assert CU_FILES, "no .cu files found"


def test_missing_nvcc_skips_unless_required(tmp_path):
    """Without nvcc the compile checks skip, naming what is missing and the variable; with
    MOE_KERNELS_REQUIRE_NVCC=1 they fail instead."""
    nowhere = dict(path=str(tmp_path), default=tmp_path / "nvcc")
    with pytest.raises(pytest.skip.Exception, match=r"nvcc not found .*REQUIRE_NVCC=1 makes this a failure"):
        nvcc(environ={}, **nowhere)
    with pytest.raises(pytest.fail.Exception, match="MOE_KERNELS_REQUIRE_NVCC=1 requires it"):
        nvcc(environ={"MOE_KERNELS_REQUIRE_NVCC": "1"}, **nowhere)
    (tmp_path / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "nvcc").chmod(0o755)
    assert nvcc(environ={}, **nowhere) == str(tmp_path / "nvcc")


def default_gencode() -> list[str]:
    """The -gencode flags setup.py builds with by default (SASS sm_80, sm_90; PTX compute_90)."""
    build = setup_py.load()
    return build.gencode_flags(build.parse_archs(build.DEFAULT_ARCHS))


@pytest.mark.torch_free
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_nvcc_compiles_without_spills(cu, tmp_path):
    cmd = [nvcc(), "-c", "-std=c++20", "-O3", f"-I{ROOT / 'csrc' / 'include'}", "-Xptxas", "-v", "--no-compress"]
    cmd += default_gencode() + [str(cu), "-o", str(tmp_path / "k.o")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = out.stderr + out.stdout
    assert "sm_80" in report and "sm_90" in report
    # PTX of the newest arch in the object (uncompressed here), for GPUs newer than sm_90 to JIT
    assert b".target sm_90" in (tmp_path / "k.o").read_bytes()
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report
    assert "#include <torch" not in cu.read_text() and "ATen" not in cu.read_text(), (
        "keep torch headers out of .cu files"
    )


def test_cuda_glue_syntax(tmp_path):
    """csrc/cuda_ops.cpp is only built by a CUDA torch; check its C++ against the CPU wheel's
    headers (which carry c10/cuda) and the toolkit's cuda_runtime. The one generated header the CPU
    wheel lacks is stubbed."""
    import torch.utils.cpp_extension as ext

    toolkit = Path(nvcc()).resolve().parents[1]

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cuda_include = next(
        (p for p in (toolkit / "include", Path("/usr/local/cuda/include")) if (p / "cuda_runtime.h").exists()),
        None,
    )
    assert cuda_include is not None, "the CUDA toolkit's include directory (cuda_runtime.h) was not found"
    cmd = [
        shutil.which("c++") or "g++",
        "-std=c++20",
        "-fsyntax-only",
        "-DMOE_KERNELS_CUDA",
        f"-I{ROOT / 'csrc' / 'include'}",
        f"-I{tmp_path}",
        f"-I{cuda_include}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    cmd += [f"-I{p}" for p in ext.include_paths()]
    cmd += [str(ROOT / "csrc" / "cuda_ops.cpp")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]


def glue_functions(text: str) -> dict[str, str]:
    """The functions of csrc/cuda_ops.cpp, name -> body: the outermost braces that are neither a
    namespace nor a TORCH_LIBRARY_IMPL block (comments stripped first)."""
    text = re.sub(r"//[^\n]*", "", text)
    bodies, stack = {}, []
    for m in re.finditer(r"[{}]", text):
        if m.group() == "{":
            head = text[: m.start()].rstrip()
            block = re.search(r"(namespace\s*\w*|TORCH_LIBRARY_IMPL\([^)]*\))$", head)
            in_function = any(kind == "function" for kind, _ in stack)
            stack.append(("other" if block or in_function else "function", m.start()))
        else:
            kind, start = stack.pop()
            if kind == "function":
                name = re.search(r"(\w+)\s*\([^;{}]*\)\s*(const\s*)?$", text[:start].rstrip(), re.S)
                bodies[name.group(1) if name else f"?{start}"] = text[start : m.end()]
    return bodies


def test_cuda_glue_guards_the_device_and_uses_its_stream():
    """Every function of csrc/cuda_ops.cpp that launches a kernel (check_launch(<op>_cuda(...)))
    first sets the inputs' device (c10::cuda::CUDAGuard) and launches on that device's current
    stream (getCurrentCUDAStream() after the guard), so tensors on cuda:1 run there while cuda:0 is
    current. A source check: cuda_ops.cpp is only built by a CUDA torch."""
    bodies = glue_functions((ROOT / "csrc" / "cuda_ops.cpp").read_text())
    launching = {name: body for name, body in bodies.items() if "check_launch(" in body and "_cuda(" in body}
    assert len(launching) >= 9, sorted(bodies)  # the scan sees the launching functions
    bad = {}
    for name, body in launching.items():
        guard = body.find("CUDAGuard guard(")
        stream = body.find("getCurrentCUDAStream()")
        if guard < 0 or stream < 0 or stream < guard:
            bad[name] = "no CUDAGuard before the launch's getCurrentCUDAStream()"
    assert not bad, bad


def cuda_ops_in_source() -> dict[str, str]:
    """Every op the CUDA sources say has a CUDA kernel, with where it was found: each
    csrc/cuda/<op>.cu (one stem per op), each m.impl("<op>", ...) of csrc/cuda_ops.cpp, and each
    launcher <op>_cuda(...) of a .cu file whose name is an op. Discovered, not listed, so a new
    op's .cu file is covered the day it lands."""
    import torch

    import moe_kernels  # noqa: F401  (loads the extension: the schemas)

    found = {cu.stem: f"csrc/cuda/{cu.name}" for cu in CU_FILES}
    glue = (ROOT / "csrc" / "cuda_ops.cpp").read_text()
    for op in re.findall(r'\bm\.impl\(\s*"(\w+)"', glue):
        found.setdefault(op, "an m.impl of csrc/cuda_ops.cpp")
    for cu in CU_FILES:
        for name in re.findall(r"\bcudaError_t\s+(\w+)_cuda\s*\(", cu.read_text()):
            if hasattr(torch.ops.moe_kernels, name):
                found.setdefault(name, f"the launcher {name}_cuda of csrc/cuda/{cu.name}")
    return found


def test_cuda_ops_are_ops():
    """Every op the CUDA sources name has a schema (registered with its CPU kernel, so checkable
    here): a .cu file named after no op would escape the registration check below."""
    from moe_kernels import _extension

    if not _extension.LOADED:
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    found = cuda_ops_in_source()
    assert {cu.stem for cu in CU_FILES} <= set(found)
    missing = {op: where for op, where in found.items() if not _extension.defines(op)}
    assert not missing, f"CUDA sources name ops without a schema (name .cu files after their op): {missing}"


def test_every_cuda_kernel_is_registered():
    """In a CUDA build (make check-cuda-build, or a GPU machine's make CUDA=1 test, both with
    MOE_KERNELS_CUDA=1): every op with a CUDA kernel in the sources has a CUDA registration in the
    loaded extension. Needs no GPU."""
    import torch

    from moe_kernels import _extension

    if torch.version.cuda is None:
        pytest.skip("CPU torch: the extension has no CUDA kernels (make check-cuda-build runs this with a CUDA torch)")
    assert _extension.LOADED, _extension.LOAD_ERROR
    found = cuda_ops_in_source()
    if os.environ.get("MOE_KERNELS_CUDA") != "1" and not any(_extension.has_kernel(op, "CUDA") for op in found):
        pytest.skip("the extension was built without CUDA kernels (MOE_KERNELS_CUDA=1 makes that an error)")
    unregistered = unregistered_cuda_ops(_extension.has_kernel)
    assert not unregistered, f"ops with CUDA kernels in the sources but no CUDA registration: {unregistered}"


def test_every_cuda_kernel_is_reachable():
    """Every op with a CUDA kernel in the sources is reachable from the public ops: a public op
    registers a `cuda=` implementation with moe_kernels.backends (so use_backend("cuda") and the
    default order can choose it), and a helper op (`<op>_backward`, called by <op>'s autograd
    formula, which the extension op carries on every device) belongs to a public op that does.
    Needs no GPU: a compiled, registered kernel that no op passes to backends.register is dead."""
    from moe_kernels import _extension, backends

    if not _extension.LOADED:
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    unreachable = {}
    for op, where in cuda_ops_in_source().items():
        public = op if op in backends._REGISTRY else op.removesuffix("_backward")
        if public not in backends._REGISTRY or backends._REGISTRY[public].cuda is None:
            unreachable[op] = where
    assert not unreachable, f"CUDA kernels no op can reach (no cuda= in backends.register): {unreachable}"


def unregistered_cuda_ops(has_kernel) -> dict[str, str]:
    """The ops of cuda_ops_in_source() without a CUDA kernel by `has_kernel(op, dispatch_key)`."""
    return {op: where for op, where in cuda_ops_in_source().items() if not has_kernel(op, "CUDA")}


def test_registration_check_names_a_missing_op():
    """The check above on a build that lost one registration (a fake has_kernel): it is named,
    with the source that says it should exist."""
    from moe_kernels import _extension

    if not _extension.LOADED:
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    missing = unregistered_cuda_ops(lambda op, key: op != "combine")
    assert missing == {"combine": "an m.impl of csrc/cuda_ops.cpp"}
    assert unregistered_cuda_ops(lambda op, key: True) == {}
