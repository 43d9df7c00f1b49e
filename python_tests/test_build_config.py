"""setup.py's build configuration, without building: the GPU arch list (its spellings, the
variables it comes from, the nvcc flags), the nvcc / torch CUDA major check, and the runtime
torch requirement."""

from pathlib import Path

import pytest
import setup_py as build_setup

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    return build_setup.load()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80;90", [80, 90]),  # nvcc's spelling, ';'-separated (the default)
        ("8.0 9.0", [80, 90]),  # torch's spelling, as in TORCH_CUDA_ARCH_LIST
        ("sm_80,sm_90", [80, 90]),
        ("compute_86", [86]),
        ("9.0;8.0;9.0", [80, 90]),  # sorted, duplicates dropped
        ("  8.6  ", [86]),
        ("10.0;12.0", [100, 120]),  # Blackwell: accepted
        ("sm_100 sm_120", [100, 120]),
        ("7.5", [75]),  # the oldest nvcc 13 targets
    ],
)
def test_parse_archs_spellings(setup_py, text, expected):
    assert [cc for cc, _, _ in setup_py.parse_archs(text)] == expected


def test_parse_archs_suffixes_and_ptx(setup_py):
    assert setup_py.parse_archs("9.0a;8.0+PTX") == [(80, "", True), (90, "a", False)]
    assert setup_py.parse_archs("sm_100f") == [(100, "f", False)]


@pytest.mark.parametrize(
    "text, match",
    [
        ("Ampere", "cannot read 'Ampere'"),  # torch's arch names are not accepted
        ("8", "cannot read '8'"),
        ("sm80x", "cannot read 'sm80x'"),
        ("80;9.0.1", "cannot read '9.0.1'"),
        ("1000", "cannot read '1000'"),
        ("52", "older than sm_75"),
        ("7.0", "older than sm_75"),
        ("25.0", "no GPU architecture"),
        ("", "is empty"),
        (" ; ", "is empty"),
    ],
)
def test_parse_archs_errors_name_the_variable_and_the_spellings(setup_py, text, match):
    with pytest.raises(setup_py.ArchError, match=match) as info:
        setup_py.parse_archs(text, "TORCH_CUDA_ARCH_LIST")
    assert "TORCH_CUDA_ARCH_LIST" in str(info.value)
    if "empty" not in match:
        assert '"8.0 9.0"' in str(info.value)


def test_gencode_sass_for_each_arch_ptx_for_the_newest(setup_py):
    flags = setup_py.gencode_flags(setup_py.parse_archs("80;90"))
    assert flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",  # newer GPUs (sm_100, sm_120) JIT from this
    ]
    flags = setup_py.gencode_flags(setup_py.parse_archs("8.0+PTX;9.0a;10.0"))
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    ptx = [f for f in flags if "code=compute" in f]
    # arch-specific PTX (90a) runs only on its own family: PTX for the newest plain arch instead
    assert ptx == ["-gencode=arch=compute_80,code=compute_80", "-gencode=arch=compute_100,code=compute_100"]
    only_specific = setup_py.gencode_flags(setup_py.parse_archs("9.0a"))
    assert only_specific[-1] == "-gencode=arch=compute_90,code=compute_90"


def test_arch_variables_precedence(setup_py):
    env = {"TORCH_CUDA_ARCH_LIST": "8.6", "MOE_KERNELS_CUDA_ARCHS": "90"}
    assert setup_py.chosen_archs(env) == ([(90, "", False)], "MOE_KERNELS_CUDA_ARCHS")
    del env["MOE_KERNELS_CUDA_ARCHS"]
    assert setup_py.chosen_archs(env) == ([(86, "", False)], "TORCH_CUDA_ARCH_LIST")  # honoured
    archs, source = setup_py.chosen_archs({"TORCH_CUDA_ARCH_LIST": " "})
    assert [cc for cc, _, _ in archs] == [80, 90] and "default" in source
    with pytest.raises(setup_py.ArchError, match="MOE_KERNELS_CUDA_ARCHS"):
        setup_py.chosen_archs({"MOE_KERNELS_CUDA_ARCHS": "hopper"})


def test_nvcc_major_must_match_torch(setup_py):
    setup_py.check_cuda_versions("13.0", "13.0")
    setup_py.check_cuda_versions("13.1", "13.0")  # minor versions may differ
    with pytest.raises(SystemExit, match=r"nvcc is CUDA 12.8 but torch was built with CUDA 13.0"):
        setup_py.check_cuda_versions("12.8", "13.0")


def test_nvcc_version_read_from_the_toolkit(setup_py):
    import shutil

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    assert setup_py.nvcc_version(str(Path(nvcc).resolve().parents[1])).split(".")[0].isdigit()


def test_torch_requirement_pins_the_build_abi(setup_py):
    assert setup_py.torch_requirement("2.13.0+cu130") == "torch>=2.13,<2.14"
    assert setup_py.torch_requirement("2.13.1+cpu") == "torch>=2.13,<2.14"
    assert setup_py.torch_requirement("3.0.0") == "torch>=3.0,<3.1"


def test_one_version_string():
    """The version is written once, in moe_kernels/__init__.py; pyproject.toml reads it from there."""
    import tomllib

    import moe_kernels

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "moe_kernels.__version__"}
    assert moe_kernels.__version__.count(".") == 2
    assert "version=" not in (ROOT / "setup.py").read_text()


def test_installed_metadata_matches():
    """The installed distribution (make build: pip install -e .) carries our name, the version of
    the package, and the torch requirement of the torch it was built against."""
    import importlib.metadata as md

    import torch

    import moe_kernels

    try:
        dist = md.distribution("moe-routing-kernels")
    except md.PackageNotFoundError:
        pytest.skip("moe-routing-kernels is not installed in this environment (make build installs it)")
    assert dist.version == moe_kernels.__version__
    major, minor = torch.__version__.split(".")[:2]
    assert f"torch<{major}.{int(minor) + 1},>={major}.{minor}" in [r.replace(" ", "") for r in dist.requires]


def test_cuda_home_follows_the_nvcc_symlink(setup_py, tmp_path):
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    links = tmp_path / "bin"
    links.mkdir()
    (links / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    assert setup_py.find_cuda_home({"PATH": str(links)}) == str(toolkit)
    assert setup_py.find_cuda_home({"PATH": str(links), "CUDA_HOME": "/opt/cuda"}) == "/opt/cuda"
    assert setup_py.find_cuda_home({"PATH": str(tmp_path / "none")}) is None
    # a wrapper script (exec .../nvcc "$@"), not a symlink: the TOP of nvcc's dry run
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    (wrappers / "nvcc").write_text(f'#!/bin/sh\necho "#$ TOP={toolkit}/bin/.." >&2\n')
    (wrappers / "nvcc").chmod(0o755)
    assert setup_py.find_cuda_home({"PATH": str(wrappers)}) == str(toolkit)
