"""`python -m moe_kernels.bench`, the benchmarks' command line in the package: --list, a --quick run
of one cheap benchmark into a folder of the test's (its CSV and markdown there, nothing written into
the package), clear errors for bad arguments; and bench/'s scripts run the package's code rather
than copies of it."""

import ast
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moe_kernels
from moe_kernels.bench import BENCHES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(moe_kernels.__file__).resolve().parent
COLUMNS = ["op", "provider", "mode", "config", "median_ms", "p20_ms", "p80_ms", "gb_per_s", "peak_mb"]
COLUMNS += ["machine", "commit", "torch", "date"]


# The children import the moe_kernels under test (this process's), not another one the
# interpreter would find from their folder (an installed copy beside a checkout: make test-installed).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))}


def cli(*args, cwd, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "moe_kernels.bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def package_files() -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_list(tmp_path):
    run = cli("--list", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    names = [line.split()[0] for line in run.stdout.splitlines()]
    assert names == [b.name for b in BENCHES]
    assert not list(tmp_path.iterdir()), "--list writes nothing"


def test_quick_run_of_one_bench_writes_into_out_only(tmp_path):
    before = package_files()
    out = tmp_path / "results"
    run = cli("--quick", "--op", "dselect", "--no-compile", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    with (out / "dselect_k_quick.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS
    assert {r["provider"] for r in rows} >= {"moe_kernels", "torch (reference)", "write pass"}
    assert not any("compile" in r["provider"] for r in rows), "--no-compile: no torch.compile row"
    md = (out / "dselect_k_quick.md").read_text()
    assert "Command: `python -m moe_kernels.bench --op dselect --quick --no-compile`" in md
    assert "| mode | config |" in run.stdout, "the table goes to stdout"
    assert "dselect" in run.stdout.splitlines()[-1] and " ok" in run.stdout.splitlines()[-1]
    assert package_files() == before, "nothing written inside the package"
    assert [p.name for p in tmp_path.iterdir()] == ["results"]


def test_default_out_is_under_the_current_folder(tmp_path):
    run = cli("--quick", "--op", "dselect", "--no-compile", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "moe_kernels_bench" / "dselect_k_quick.csv").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--op", "nope"], "argument --op: invalid choice: 'nope'"),
        (["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--backend", "cuda"], "--backend cuda does not run cpu tensors; for --device cpu: cpu, torch"),
        (["--out", str(PACKAGE / "results")], "inside the moe_kernels package"),
    ],
)
def test_bad_arguments(tmp_path, monkeypatch, capsys, args, message):
    # In this process: argparse's exit is the command line's (test_list runs `python -m` itself).
    from moe_kernels.bench.__main__ import main

    monkeypatch.chdir(tmp_path)
    # Accepted arguments would run every benchmark in this process: fail at the first step instead.
    monkeypatch.setattr("moe_kernels.bench.timing.set_device", lambda device: pytest.fail(f"{args} accepted"))
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_missing_dependency_skips_with_the_reason(tmp_path):
    # A module named transformers that cannot be found: both transformers benches are skipped.
    script = (
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'transformers' else real(name, *a)\n"
        "from moe_kernels.bench.__main__ import main\n"
        "sys.exit(main(['--op', 'transformers', 'decode', '--out', 'o']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=ENV
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "transformers: skipped, needs transformers (pip install transformers)" in run.stdout
    assert "decode: skipped, needs transformers" in run.stdout


def test_bench_scripts_call_the_package():
    """bench/bench_<name>.py per benchmark, each a caller of moe_kernels.bench.<name> with no code of
    its own; bench/common.py and bench/plot.py hold no copies of the package's functions."""
    names = {b.name for b in BENCHES}
    assert {p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py")} == names
    for name in names:
        tree = ast.parse((ROOT / "bench" / f"bench_{name}.py").read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)], name
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "moe_kernels.bench"]
        assert [a.name for n in imports for a in n.names] == [name]
    package_defs = {
        n.name
        for f in (PACKAGE / "bench").glob("*.py")
        for n in ast.walk(ast.parse(f.read_text()))
        if isinstance(n, ast.FunctionDef)
    }
    for script in ("common.py", "plot.py", "run_all.py"):
        defs = {
            n.name for n in ast.walk(ast.parse((ROOT / "bench" / script).read_text())) if isinstance(n, ast.FunctionDef)
        }
        assert not defs & package_defs - {"main"}, f"bench/{script} copies {defs & package_defs}"


def test_cuda_benchmarks_draw_on_the_device():
    """`--device cuda` sets torch's default device to the GPU, where torch.randn(generator=a CPU
    generator) raises: on the H200, routers, transformers and decode failed so. Each benchmark that
    runs on cuda draws through timing.generator (a generator on the benchmarks' device)."""
    for bench in BENCHES:
        if "cuda" not in bench.devices:
            continue
        tree = ast.parse((PACKAGE / "bench" / f"{bench.name}.py").read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.Generator"]
        assert not calls, f"{bench.name}: {[ast.unparse(c) for c in calls]}: use timing.generator(seed)"
