"""Static instruction counts of the CUDA kernels for sm_90, without a GPU: a .cu file compiled by
nvcc (the build's flags: -O3, C++20), each kernel's registers and spills from ptxas, and the SASS
of its loops (a backward branch and the instructions from its target to it) from cuobjdump (the
one triton ships). A loop's count is the warp instructions of one trip; over the work a trip
does it compares kernel versions here (bench/triton_sass.py does the same for Triton kernels);
the GPU benchmarks (bench/gpu_bench.py) time them.

    python bench/cuda_sass.py [csrc/cuda/capacity_positions.cu ...] [--min-loop 50]

csrc/cuda/capacity_positions.cu: a trip of segment_counts_kernel's and segment_positions_kernel's
chunk loop ranks 8 chunks of 32 choices (kLoadsAhead), so its count over 256 is the warp
instructions a choice; a trip of tile_counts_kernel<L>'s loop adds L entries a thread (32 L
choices a warp), and tile_positions_kernel's loops are a tile's phases (labels, ranks, stores).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from triton.tools.disasm import path_to_cuobjdump

ROOT = Path(__file__).resolve().parents[1]
_FUNCTION = re.compile(r"\s*Function : (\S+)")
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s*([^;]*);")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
# ptxas -v: a kernel's entry, then its spill stores and registers.
_PTXAS = re.compile(
    r"Compiling entry function '(\S+)' for 'sm_90'\n(?:.*\n)*?.*?(\d+) bytes spill stores.*\n.*Used (\d+) registers"
)


def kernel_name(mangled: str) -> str:
    """The kernel's name and template arguments (c++filt's, without namespaces and parameters),
    else the tail of its mangled name."""
    if shutil.which("c++filt"):
        plain = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
        plain = re.sub(r"^void |\(anonymous namespace\)::", "", plain).split("(", 1)[0]
        name, _, arguments = plain.partition("<")
        return name.rsplit("::", 1)[-1] + (f"<{arguments}" if arguments else "")
    found = re.findall(r"\d+(\w+?_kernel)", mangled)
    return found[-1] if found else mangled


def compile_cubin(cu: Path, out: Path, nvcc: str = "nvcc") -> str:
    """Compiles `cu` for sm_90 into the cubin `out`; returns ptxas's -v report."""
    cmd = [nvcc, "-cubin", "-std=c++20", "-O3", f"-I{ROOT / 'csrc' / 'include'}", "-Xptxas", "-v"]
    cmd += ["-gencode", "arch=compute_90,code=sm_90", str(cu), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return done.stderr + done.stdout


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """{mangled name: [(address, instruction)]} of a cuobjdump -sass listing."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if m := _FUNCTION.match(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(body: list[tuple[int, str]]) -> list[tuple[int, int, int]]:
    """(start address, end address, instructions) of each backward branch's loop."""
    index = {address: i for i, (address, _) in enumerate(body)}
    found = []
    for i, (address, text) in enumerate(body):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < address and int(m.group(1), 16) in index:
            start = index[int(m.group(1), 16)]
            found.append((body[start][0], address, i - start + 1))
    return found


def report(cu: Path, min_loop: int, nvcc: str = "nvcc") -> list[dict]:
    """A row a kernel of `cu`: name, registers, spill stores, instructions, its loops of at least
    min_loop instructions."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        ptxas = compile_cubin(cu, cubin, nvcc)
        sass = subprocess.run([path_to_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    usage = {m.group(1): (int(m.group(3)), int(m.group(2))) for m in _PTXAS.finditer(ptxas)}
    rows = []
    for mangled, body in functions(sass.stdout).items():
        registers, spills = usage.get(mangled, (None, None))
        big = [n for _, _, n in loops(body) if n >= min_loop]
        rows.append(dict(kernel=kernel_name(mangled), registers=registers, spills=spills, total=len(body), loops=big))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=[str(ROOT / "csrc" / "cuda" / "capacity_positions.cu")])
    parser.add_argument("--min-loop", type=int, default=50, help="loops shorter than this are not listed")
    parser.add_argument("--nvcc", default="nvcc", help="the nvcc to compile with (default: the one on PATH)")
    args = parser.parse_args(argv)
    for cu in args.files:
        print(f"{Path(cu).name} (sm_90)")
        print(f"  {'kernel':36} {'regs':>5} {'spills':>6} {'instr':>6}  loops (instructions a trip)")
        for row in report(Path(cu), args.min_loop, args.nvcc):
            print(
                f"  {row['kernel']:36} {row['registers']!s:>5} {row['spills']!s:>6} {row['total']:>6}  "
                + (", ".join(map(str, row["loops"])) or "-")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
