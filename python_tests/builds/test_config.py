"""setup.py's build configuration, without building: the GPU arch list (its spellings, the
variables it comes from, the nvcc flags), the nvcc / torch CUDA major check, the runtime
torch requirement, the build against the user's torch (never one pip downloads), the supported
torch releases, when the CUDA kernels are built, and the release build's flags (no debug info)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import setup_py as build_setup
from cuda_toolkit import nvcc

ROOT = Path(__file__).resolve().parents[2]


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
    assert setup_py.nvcc_version(str(Path(nvcc()).resolve().parents[1])).split(".")[0].isdigit()


def test_torch_requirement_pins_the_build_abi(setup_py):
    assert setup_py.torch_requirement("2.13.0+cu130") == "torch>=2.13,<2.14"
    assert setup_py.torch_requirement("2.13.1+cpu") == "torch>=2.13,<2.14"
    assert setup_py.torch_requirement("3.0.0") == "torch>=3.0,<3.1"


def test_build_requires_no_torch():
    """pyproject.toml's build requirements hold no torch: with one, a plain `pip install .` would
    download a torch into its isolated build environment (the registry's multi-GB CUDA build) and
    compile against it, whatever the user's torch is."""
    import tomllib

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in requires if r.lower().startswith("torch")], requires


def test_build_without_torch_stops_at_once_with_the_install_line(tmp_path):
    """setup.py run where torch is not importable (what pip's build isolation gives it) exits
    before anything else with the line to use instead. Run as pip runs it (setup.py as __main__),
    with torch hidden, from an empty directory (nothing may be written into the tree)."""
    code = (
        "import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', 'egg_info']; "
        f"runpy.run_path({str(ROOT / 'setup.py')!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "torch is not importable" in out.stderr and "pip install --no-build-isolation ." in out.stderr, out.stderr
    assert "torch 2.11 to 2.15" in out.stderr
    assert not list(tmp_path.iterdir())


def test_supported_torch_releases(setup_py):
    """2.11 to 2.15: older stops the build, newer builds with a note (untested, not refused)."""
    assert (setup_py.TORCH_OLDEST, setup_py.TORCH_NEWEST) == ((2, 11), (2, 15))
    for version in ("2.11.0", "2.13.0+cpu", "2.13.0+cu130", "2.15.0", "2.15.1+cu130"):
        assert setup_py.check_torch_version(version) is None, version
    for version in ("2.10.1", "2.9.0+cu128", "1.13.1"):
        with pytest.raises(SystemExit, match=rf"torch {re.escape(version)} is too old; supported: torch 2.11 to 2.15"):
            setup_py.check_torch_version(version)
    assert "newer than the releases tested (torch 2.11 to 2.15)" in setup_py.check_torch_version("2.16.0")
    assert "newer than the releases tested" in setup_py.check_torch_version("3.0.0")


def torch_pins() -> dict[str, tuple[str, str]]:
    """torch-pins.txt: torch (major.minor or full version) -> (triton, numpy)."""
    rows = {}
    for line in (ROOT / "torch-pins.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            torch, triton, numpy = line.split()
            rows[torch] = (triton, numpy)
    return rows


def test_torch_pins_cover_the_supported_releases(setup_py):
    """One row per supported major.minor (2.11 to 2.15, as setup.py and the README say), a
    release of each pin, and numpy < 2.4 beside the triton whose interpreter needs it."""
    pins = torch_pins()
    minors = [t for t in pins if t.count(".") == 1]
    (oldest_major, oldest), (newest_major, newest) = setup_py.TORCH_OLDEST, setup_py.TORCH_NEWEST
    assert oldest_major == newest_major
    assert minors == [f"{oldest_major}.{m}" for m in range(oldest, newest + 1)]
    for torch, (triton, numpy) in pins.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", triton) and re.fullmatch(r"\d+\.\d+\.\d+", numpy), torch
        assert setup_py.torch_release(torch) in [setup_py.torch_release(t) for t in minors], torch
        if tuple(map(int, triton.split("."))) < (3, 7, 1):
            assert tuple(map(int, numpy.split("."))) < (2, 4), (
                f"{torch}: triton {triton}'s interpreter needs numpy < 2.4"
            )
    assert setup_py.supported_torch() in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    "torch, triton, numpy",
    [
        ("2.13.0", "3.7.1", "2.4.6"),
        ("2.11.0", "3.6.0", "2.3.5"),
        ("2.12.0", "3.7.0", "2.3.5"),
        ("2.12.1", "3.7.1", "2.4.6"),
        ("2.15.0", "3.9.0", "2.4.6"),
    ],
)
def test_makefile_installs_the_pins_of_its_torch(torch, triton, numpy):
    """`make -n -B test TORCH=...` (a dry run: nothing is executed; -B: as on a fresh clone) installs
    that torch, its row's triton and numpy (a full-version row over its major.minor one), under a
    stamp named for it, after removing the stamp of any other torch."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH")}
    out = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), "test", f"TORCH={torch}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"torch=={torch}\n" in out.stdout
    assert f"-r requirements-dev.txt triton=={triton} numpy=={numpy}\n" in out.stdout
    assert "rm -f .venv/.deps-*\n" in out.stdout and f"touch .venv/.deps-torch-{torch}\n" in out.stdout


def test_makefile_default_torch_has_pins():
    """The Makefile's default TORCH has a row; requirements-dev.txt leaves torch, triton and numpy
    to torch-pins.txt (a pin there would fight the row of another TORCH)."""
    default = re.search(r"^TORCH\s*\?=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert default in torch_pins() or default.rsplit(".", 1)[0] in torch_pins()
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    names = {re.split(r"[=<>~!\[ ;]", line, maxsplit=1)[0].lower() for line in lines if line and line[0] != "#"}
    assert not names & {"torch", "triton", "numpy"}, names


@pytest.mark.parametrize(
    "flag, torch_cuda, cuda_home, built, why",
    [
        ("", None, "/usr/local/cuda", False, "torch 2.13.0+cpu is a CPU build"),  # nvcc present, CPU torch
        ("", None, None, False, "is a CPU build"),
        ("", "13.0", None, False, "CUDA 13.0 build but no CUDA toolkit was found"),
        ("", "13.0", "/usr/local/cuda", True, "is a CUDA 13.0 build and CUDA_HOME=/usr/local/cuda"),
        ("0", "13.0", "/usr/local/cuda", False, "disabled by MOE_KERNELS_CUDA=0"),
        ("1", "13.0", "/usr/local/cuda", True, "forced by MOE_KERNELS_CUDA=1"),
    ],
)
def test_cuda_kernels_only_for_a_cuda_torch(setup_py, flag, torch_cuda, cuda_home, built, why):
    """The CUDA kernels are built for a CUDA torch with a toolkit (or when forced), never for a CPU
    torch, so the extension always loads in the torch that built it; the reason is printed."""
    version = "2.13.0+cpu" if torch_cuda is None else "2.13.0+cu130"
    assert setup_py.cuda_choice(flag, version, torch_cuda, cuda_home)[0] is built
    assert why in setup_py.cuda_choice(flag, version, torch_cuda, cuda_home)[1]


def test_forced_cuda_build_without_a_cuda_torch_is_an_error(setup_py):
    with pytest.raises(
        SystemExit, match="MOE_KERNELS_CUDA=1 but the CUDA kernels cannot be built: torch 2.13.0 is a CPU"
    ):
        setup_py.cuda_choice("1", "2.13.0", None, "/usr/local/cuda")
    with pytest.raises(SystemExit, match="no CUDA toolkit was found"):
        setup_py.cuda_choice("1", "2.13.0+cu130", "13.0", None)


def test_release_build_has_no_debug_info(setup_py, monkeypatch):
    """The extension as setup.py declares it: -g0 (over the -g of Python's CFLAGS) and a link that
    strips debug sections unless DEBUG=1."""
    assert setup_py.compile_flags(debug=False) == (["-O3", "-g0"], ["-fopenmp", "-Wl,--strip-debug"])
    assert setup_py.compile_flags(debug=True) == (["-O0", "-g"], ["-fopenmp"])
    monkeypatch.setenv("MOE_KERNELS_CUDA", "0")
    monkeypatch.delenv("DEBUG", raising=False)
    (ext,) = setup_py.extensions()
    assert "-g0" in ext.extra_compile_args["cxx"] and "-Wl,--strip-debug" in ext.extra_link_args
    monkeypatch.setenv("DEBUG", "1")
    (ext,) = setup_py.extensions()
    assert "-g" in ext.extra_compile_args["cxx"] and "-Wl,--strip-debug" not in ext.extra_link_args


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


def test_newest_pins_are_the_newest_supported(setup_py):
    """requirements-newest.txt (what CI's `make test-newest` installs) names a full torch release of
    setup.py's TORCH_NEWEST, which has a row in torch-pins.txt, and a transformers release no older
    than the one the suite pins."""
    lines = [line for line in (ROOT / "requirements-newest.txt").read_text().splitlines() if line[:1].isalpha()]
    pins = dict(line.split("==") for line in lines)
    assert sorted(pins) == ["torch", "transformers"], lines
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins["torch"]), pins
    assert setup_py.torch_release(pins["torch"]) == setup_py.TORCH_NEWEST
    assert pins["torch"].rsplit(".", 1)[0] in torch_pins()
    dev = re.search(r"^transformers==(\S+)$", (ROOT / "requirements-dev.txt").read_text(), re.M).group(1)
    assert tuple(map(int, pins["transformers"].split("."))) >= tuple(map(int, dev.split(".")))


def test_make_wheel_builds_against_the_venv_torch_and_tags_manylinux():
    """`make -n wheel` (a dry run): the wheel is built with --no-build-isolation (never a torch pip
    downloads), then repaired by auditwheel with torch's libraries and OpenMP runtime excluded."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH")}
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), "wheel"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    # from a clean copy (no object of an earlier build), with the CUDA kernels as CUDA= says
    assert "rm -rf dist/raw dist/src" in out.stdout
    assert "MOE_KERNELS_CUDA=0 .venv/bin/pip wheel --no-build-isolation --no-deps -w dist/raw ./dist/src" in out.stdout
    repair = next(line for line in out.stdout.splitlines() if "auditwheel repair" in line)
    for excluded in ("libc10*.so", "libtorch*.so", "libgomp*", "libcudart*"):
        assert f"--exclude '{excluded}'" in repair
