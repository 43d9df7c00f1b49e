"""Builds moe_kernels._C: the C++ CPU kernels always, the CUDA kernels when asked or possible.

The build compiles against the torch already installed in the environment, never one of its own:
install torch first (any release from TORCH_OLDEST to TORCH_NEWEST below, CPU or CUDA build), then
`pip install --no-build-isolation .` (pip's default build isolation hides that torch from the
build, and setup.py then stops with that line: pyproject.toml does not list torch as a build
requirement, so pip never downloads one).

Environment:
  MOE_KERNELS_CUDA=1        build the CUDA kernels; a failure is an error, never a silent skip.
  MOE_KERNELS_CUDA=0        never build them.
  (unset)                   build them when torch is a CUDA build and a CUDA toolkit is found.
  MOE_KERNELS_CUDA_ARCHS    GPU architectures (compute capabilities), e.g. "80;90", "8.0 9.0",
                            "sm_80,sm_90", "9.0a", "8.0;9.0+PTX"; see parse_archs. When unset,
                            TORCH_CUDA_ARCH_LIST (torch's variable, same spellings) is honoured;
                            when both are unset: "80;90". The .so holds SASS for every listed
                            arch plus PTX for the newest, so newer GPUs JIT-compile the kernels.
  DEBUG=1                   -O0 -g instead of -O3 (release builds have no debug info: -g0, and the
                            link strips any an object brings).
  MAX_JOBS                  parallel compile jobs (honoured by torch's ninja build).

The distribution's metadata (name, version, dependencies) is in pyproject.toml, except the torch
requirement, computed here: the extension is linked against the C++ ABI of the torch that builds
it, which changes between torch minor releases, so the installed package requires the same
major.minor (e.g. "torch>=2.13,<2.14"). The package as a whole supports torch TORCH_OLDEST to
TORCH_NEWEST (README, "Install"); a torch older than that stops the build, a newer one is built
with a note that it is untested.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

DEFAULT_ARCHS = "80;90"
# nvcc 13 dropped every target below Turing (sm_75); the kernels need nothing newer.
MIN_ARCH = 75
MAX_ARCH = 200  # above every compute capability there is (sm_121 in CUDA 13.0): a typo, not a GPU
# The Python C API version the extension is compiled against (Py_LIMITED_API): the module init in
# csrc/ops.cpp uses only the stable ABI, so one wheel serves every CPython >= 3.10.
LIMITED_API = (3, 10)
# The torch releases this package supports (README, "Install"; torch-pins.txt has a row for each,
# with the triton and numpy the Makefile installs beside it). Older ones stop the build; newer
# ones build with a note.
TORCH_OLDEST = (2, 11)
TORCH_NEWEST = (2, 15)
INSTALL_LINE = "pip install --no-build-isolation ."

_ARCH = re.compile(r"^(?:sm_|compute_)?(\d+)(?:\.(\d))?([af]?)(\+ptx)?$", re.IGNORECASE)


class ArchError(ValueError):
    """A GPU architecture list that cannot be understood."""


def parse_archs(text: str, source: str = "MOE_KERNELS_CUDA_ARCHS") -> list[tuple[int, str, bool]]:
    """Parse a list of GPU architectures into (compute capability, suffix, explicit PTX) triples.

    Separators: ";", "," or whitespace. Each entry is a compute capability written as nvcc does
    ("80", "sm_80", "compute_80") or as torch does ("8.0"), optionally with an arch-specific
    suffix ("90a", "9.0a", "sm_100f") and torch's "+PTX" (also embed PTX for that arch).
    e.g. "80;90" -> [(80, "", False), (90, "", False)]; "8.0 9.0+PTX" -> [(80, "", False), (90, "", True)].
    Anything else (names such as "Ampere", "8", "sm80x", an empty list, an arch below sm_75) raises
    ArchError naming `source` and the accepted spellings. Duplicates are dropped, order is ascending.
    """
    accepted = 'e.g. "80;90", "8.0 9.0", "sm_80,sm_90", "9.0a", "10.0+PTX" (sm_75 or newer)'
    entries = [e for e in re.split(r"[;,\s]+", text.strip()) if e]
    if not entries:
        raise ArchError(f"{source} is empty; give GPU architectures, {accepted}")
    out: dict[tuple[int, str], bool] = {}
    for entry in entries:
        m = _ARCH.match(entry)
        # "8" or "86.1" are not compute capabilities: nvcc's spelling has two or three digits.
        dotted = m is not None and m.group(2) is not None
        if m is None or len(m.group(1)) > (2 if dotted else 3) or len(m.group(1)) < (1 if dotted else 2):
            raise ArchError(f"{source}: cannot read {entry!r} as a GPU architecture; accepted: {accepted}")
        cc = int(m.group(1) + (m.group(2) or ""))
        if cc >= MAX_ARCH:
            raise ArchError(f"{source}: {entry!r} is no GPU architecture nvcc knows; accepted: {accepted}")
        if cc < MIN_ARCH:
            oldest = f"sm_{MIN_ARCH}, the oldest target of nvcc 13"
            raise ArchError(f"{source}: {entry!r} is older than {oldest}; {accepted}")
        key = (cc, m.group(3).lower())
        out[key] = out.get(key, False) or m.group(4) is not None
    return [(cc, suffix, ptx) for (cc, suffix), ptx in sorted(out.items())]


def gencode_flags(archs: list[tuple[int, str, bool]]) -> list[str]:
    """nvcc -gencode flags: SASS for every arch, PTX for the newest plain arch (the one newer
    GPUs can JIT from; "a"/"f" PTX runs only on its own arch family) and for each "+PTX" entry."""
    flags = [f"-gencode=arch=compute_{cc}{s},code=sm_{cc}{s}" for cc, s, _ in archs]
    plain = [cc for cc, s, _ in archs if not s]
    newest = max(plain) if plain else max(cc for cc, _, _ in archs)
    ptx = {cc for cc, s, explicit in archs if explicit and not s} | {newest}
    flags += [f"-gencode=arch=compute_{cc},code=compute_{cc}" for cc in sorted(ptx)]
    return flags


def chosen_archs(environ=os.environ) -> tuple[list[tuple[int, str, bool]], str]:
    """The arch list and where it came from: MOE_KERNELS_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST,
    else the default."""
    for var in ("MOE_KERNELS_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST"):
        if environ.get(var, "").strip():
            return parse_archs(environ[var], var), var
    return parse_archs(DEFAULT_ARCHS, "the default"), f"the default {DEFAULT_ARCHS!r}"


def nvcc_version(cuda_home: str) -> str:
    """nvcc's release, e.g. "13.0", from `nvcc --version`."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    if m is None:
        raise RuntimeError(f"cannot read the CUDA release from `{nvcc} --version`:\n{out}")
    return m.group(1)


def check_cuda_versions(nvcc: str, torch_cuda: str) -> None:
    """nvcc must have the major version torch was built with: kernels built by another major link
    against a CUDA runtime the torch wheel does not ship (and torch's own check fails later, deep
    in the build)."""
    if nvcc.split(".")[0] != torch_cuda.split(".")[0]:
        raise SystemExit(
            f"moe_kernels: nvcc is CUDA {nvcc} but torch was built with CUDA {torch_cuda}: the major "
            f"versions must match. Install the CUDA {torch_cuda.split('.')[0]}.x toolkit (or point CUDA_HOME "
            f"at it), or a torch built for CUDA {nvcc.split('.')[0]}."
        )


def supported_torch() -> str:
    """The supported torch releases in words, e.g. "torch 2.11 to 2.15"."""
    return f"torch {TORCH_OLDEST[0]}.{TORCH_OLDEST[1]} to {TORCH_NEWEST[0]}.{TORCH_NEWEST[1]}"


def require_torch():
    """The torch of the Python running this build, or SystemExit saying how to install: pip's build
    isolation (a plain `pip install .`) runs the build in a fresh environment without the user's
    torch, and this package never asks pip for one there (a downloaded torch may be a CUDA build the
    user's torch cannot load, or another release)."""
    try:
        import torch
    except ImportError as exc:
        raise SystemExit(
            f"moe_kernels: torch is not importable by this build ({exc}; Python {sys.executable}).\n"
            "The kernels are compiled against the torch you already have, so the build must run in its "
            "environment:\n"
            f"    {INSTALL_LINE}\n"
            "(pip's default build isolation, a plain `pip install .`, hides your torch from the build; "
            f"without a torch, install one first: {supported_torch()}, CPU or CUDA build)"
        ) from None
    return torch


def torch_release(torch_version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string, e.g. "2.13.0+cu130" -> (2, 13)."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch_version).groups()
    return int(major), int(minor)


def check_torch_version(torch_version: str) -> str | None:
    """SystemExit for a torch older than TORCH_OLDEST; a note (returned) for one newer than
    TORCH_NEWEST, which is built but untested; None inside the supported range."""
    release, supported = torch_release(torch_version), supported_torch()
    if release < TORCH_OLDEST:
        raise SystemExit(f"moe_kernels: torch {torch_version} is too old; supported: {supported}")
    if release > TORCH_NEWEST:
        return f"moe_kernels: note: torch {torch_version} is newer than the releases tested ({supported})"
    return None


def cuda_choice(flag: str, torch_version: str, torch_cuda: str | None, cuda_home: str | None) -> tuple[bool, str]:
    """Whether to build the CUDA kernels and why: `flag` is MOE_KERNELS_CUDA ("0", "1" or ""),
    `torch_cuda` torch.version.cuda of the building torch (None for a CPU build), `cuda_home` the
    toolkit found. Unset, the kernels are built only for a CUDA torch with a toolkit beside it, so
    the extension always loads in the torch that built it. "1" without either is a SystemExit."""
    if flag == "0":
        return False, "disabled by MOE_KERNELS_CUDA=0"
    if torch_cuda is None:
        missing = f"torch {torch_version} is a CPU build"
    elif cuda_home is None:
        missing = f"torch {torch_version} is a CUDA {torch_cuda} build but no CUDA toolkit was found (set CUDA_HOME)"
    else:
        missing = None
    if flag == "1":
        if missing:
            raise SystemExit(f"moe_kernels: MOE_KERNELS_CUDA=1 but the CUDA kernels cannot be built: {missing}")
        return True, f"forced by MOE_KERNELS_CUDA=1; torch {torch_version} is a CUDA {torch_cuda} build"
    if missing:
        return False, missing
    return True, f"torch {torch_version} is a CUDA {torch_cuda} build and CUDA_HOME={cuda_home}"


def torch_requirement(torch_version: str) -> str:
    """The runtime torch requirement for an extension built against `torch_version` ("2.13.0+cu130"):
    the same major.minor, whose C++ ABI it links against (stable across patch releases)."""
    major, minor = torch_release(torch_version)
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


def find_cuda_home(environ=os.environ) -> str | None:
    """The CUDA toolkit's root for torch's build: CUDA_HOME or CUDA_PATH if set, else the toolkit of
    the nvcc on PATH. torch takes the parent of `which nvcc`, which is wrong when that is a symlink
    or a wrapper script in /usr/local/bin (/usr/local/include has no cuda_runtime.h): the real
    path is tried, then the TOP nvcc reports in a dry run."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(var):
            return environ[var]
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc is None:
        return None
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    try:
        dry = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
        top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.M)
        if top:
            candidates.append(os.path.normpath(top.group(1).strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def compile_flags(debug: bool) -> tuple[list[str], list[str]]:
    """(C++ and nvcc optimisation flags, extra link flags). A release build carries no debug info:
    -g0 overrides the -g of Python's CFLAGS, which torch's build passes to every C++ compile (36 MB
    of DWARF in a 2 MB .so), and the link strips whatever debug sections an object still brings,
    keeping the symbol table (profilers name the kernels)."""
    if debug:
        return ["-O0", "-g"], ["-fopenmp"]
    return ["-O3", "-g0"], ["-fopenmp", "-Wl,--strip-debug"]


def extensions():
    import glob

    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    opt, link = compile_flags(os.environ.get("DEBUG", "0") == "1")
    nvcc_opt = [f for f in opt if f != "-g0"]  # nvcc has no -g0 (it emits no host debug info unless -g)
    limited = f"-DPy_LIMITED_API=0x{LIMITED_API[0]:02x}{LIMITED_API[1]:02x}0000"
    cxx = opt + ["-std=c++20", "-fopenmp", limited]
    # csrc/cpu's own headers are included by their path under csrc/cpu ("select/select.h").
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc", "cpu")]
    cpu_sources = glob.glob(os.path.join(ROOT, "csrc", "cpu", "**", "*.cpp"), recursive=True)
    sources = _rel([os.path.join(ROOT, "csrc", "ops.cpp")] + cpu_sources)

    cuda, why = cuda_choice(os.environ.get("MOE_KERNELS_CUDA", ""), torch.__version__, torch.version.cuda, CUDA_HOME)
    if not cuda:
        print(f"moe_kernels: building the C++ CPU kernels only ({why})")
        return [
            CppExtension(
                "moe_kernels._C",
                sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx},
                extra_link_args=link,
                py_limited_api=True,
            )
        ]
    check_cuda_versions(nvcc_version(CUDA_HOME), torch.version.cuda)
    try:
        archs, source = chosen_archs()
    except ArchError as exc:
        sys.exit(f"moe_kernels: {exc}")
    gencode = gencode_flags(archs)
    sources += _rel(
        [os.path.join(ROOT, "csrc", "cuda_ops.cpp")] + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
    )
    print(f"moe_kernels: building the C++ CPU kernels and the CUDA kernels ({why}); archs from {source}: {gencode}")
    return [
        CUDAExtension(
            "moe_kernels._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx + ["-DMOE_KERNELS_CUDA"], "nvcc": nvcc_opt + ["-std=c++20"] + gencode},
            extra_link_args=link,
            py_limited_api=True,
        )
    ]


def main():
    # First, before anything slow: a build that cannot see the user's torch stops at once.
    torch = require_torch()
    note = check_torch_version(torch.__version__)
    if note:
        print(note)
    # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import.
    cuda_home = find_cuda_home()
    if cuda_home is not None:
        os.environ.setdefault("CUDA_HOME", cuda_home)
    from torch.utils.cpp_extension import BuildExtension

    setup(
        packages=find_packages(include=["moe_kernels", "moe_kernels.*"]),
        ext_modules=extensions(),
        install_requires=[torch_requirement(torch.__version__), "numpy"],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": f"cp{LIMITED_API[0]}{LIMITED_API[1]}"}},
    )


if __name__ == "__main__":
    main()
