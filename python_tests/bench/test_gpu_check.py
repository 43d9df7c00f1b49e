"""`make gpu-check` (bench/gpu_check.py, bench/gpu_bench.py) in its smoke form: here, without a GPU, its
test step runs and skips the GPU cases with their reason, its benchmarks are skipped, and its report
says so; the benchmark cases' inputs and signatures hold together on tiny CPU tensors. The build
step is left out (it rebuilds the extension: minutes on this machine's cores); gpu-check's own run
on a GPU machine is what builds."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--out",
            str(out),
            "--skip-build",
            "--groups",
            "2",
            "--files",
            "python_tests/backends/test_device_axis.py",
            "python_tests/ops/test_smooth_step.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = (out / "report.md").read_text()
    assert "| check |" in report and "| tests |" in report and "| benchmarks |" in report, report
    assert "0 failed" in (out / "check.log").read_text()
    logs = "".join(p.read_text() for p in out.glob("tests-*.log"))
    import torch

    if torch.cuda.is_available():
        assert run.returncode == 0, run.stdout + run.stderr
        return
    # No GPU: every GPU case skipped with its reason, none failed, the benchmarks skipped.
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in report and "skipped" in report
    assert "no CUDA device" in logs
    assert "| benchmarks | skipped | 0 | no GPU |" in report


def test_groups_split_heavy_files_by_function():
    gpu_check = load("gpu_check")
    files = gpu_check.test_files()
    groups = gpu_check.split(files, 4)
    units = [u for g in groups for u in g]
    assert len(units) == len(set(units)) == len(gpu_check.units(files))
    fuzz = [u for u in units if u.startswith("python_tests/ops/test_fuzz.py::")]
    assert len(fuzz) >= 8, "the fuzz file goes to the groups test by test"
    whole = {u for u in units if "::" not in u}
    assert {str(p.relative_to(ROOT)) for p in files if gpu_check.under_tests(p) not in gpu_check.SPLIT} <= whole
    assert all((gpu_check.TESTS / name).is_file() for name in gpu_check.HEAVY + gpu_check.SPLIT)


def test_groups_are_filled_longest_first(monkeypatch):
    """The measured seconds balance the groups: each ends within the longest unit of the mean (a
    round-robin put one H100 group at 170 s while the others ended at 40 to 150 s)."""
    gpu_check = load("gpu_check")
    files = gpu_check.test_files()
    seconds = {u: float(i % 7) ** 2 for i, u in enumerate(gpu_check.units(files))}
    groups = gpu_check.split(files, 5, seconds)
    loads = [sum(seconds[u] for u in g) for g in groups]
    assert max(loads) <= sum(loads) / len(loads) + max(seconds.values())
    # Longest first: a round-robin of the same units ends its longest group later. On 41 units of
    # their own (the suite's count of units changes with its tests; at a multiple of 35 this
    # pattern deals the round-robin's groups evenly too).
    names = [f"unit{i}" for i in range(41)]
    monkeypatch.setattr(gpu_check, "units", lambda files: names)
    seconds = {u: float(i % 7) ** 2 for i, u in enumerate(names)}
    units = sorted(seconds, key=lambda u: -seconds[u])
    groups = gpu_check.split(files, 5, seconds)
    loads = [sum(seconds[u] for u in g) for g in groups]
    dealt = [units[i :: len(groups)] for i in range(len(groups))]
    assert max(loads) < max(sum(seconds[u] for u in g) for g in dealt)
    monkeypatch.undo()
    # The committed table names units that exist: a renamed test must not keep a stale figure.
    table = gpu_check.measured_seconds()
    assert table and set(table) <= set(gpu_check.units(files)), set(table) - set(gpu_check.units(files))
    # A unit the table lacks counts as UNKNOWN_SECONDS.
    one = gpu_check.split(files, 1, {})
    assert sorted(one[0]) == sorted(gpu_check.units(files))


def test_record_seconds(tmp_path, monkeypatch):
    gpu_check = load("gpu_check")
    monkeypatch.setattr(gpu_check, "SECONDS", tmp_path / "seconds.json")
    (tmp_path / "seconds.json").write_text('{"python_tests/gates/test_masks.py": 9.0, "old": 1.0}')
    (tmp_path / "tests-0.xml").write_text(
        "<testsuites><testsuite>"
        '<testcase classname="python_tests.ops.test_fuzz" name="test_topk_router[cuda:triton]" time="1.5"/>'
        '<testcase classname="python_tests.ops.test_fuzz" name="test_topk_router[cuda:cuda]" time="2.0"/>'
        '<testcase classname="python_tests.gates.test_masks" name="test_x[cuda:cuda]" time="0.25"/>'
        '<testcase classname="python_tests.nowhere" name="test_y" time="7"/>'
        "</testsuite></testsuites>"
    )
    later = tmp_path / "later"
    later.mkdir()
    (later / "tests-3.xml").write_text(
        '<testsuites><testsuite><testcase classname="python_tests.gates.test_masks" name="t" time="2"/>'
        "</testsuite></testsuites>"
    )
    found = gpu_check.record_seconds([tmp_path, later])  # the later run's figure replaces, not adds
    assert found == {"python_tests/ops/test_fuzz.py::test_topk_router": 3.5, "python_tests/gates/test_masks.py": 2.0}
    assert gpu_check.measured_seconds() == {**found, "old": 1.0}


def test_junit_counts(tmp_path):
    gpu_check = load("gpu_check")
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="boom&#10;more">tb</failure></testcase>'
        '<testcase classname="a" name="skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    counts, failures = gpu_check.junit_counts(xml)
    assert counts == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1}
    assert failures == [("a::bad", "boom")]
    empty = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    assert gpu_check.junit_counts(tmp_path / "missing.xml") == (empty, [])


def test_bench_smoke():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--smoke"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cases and 1 assignment row ran on CPU tensors" in run.stdout
    assert "balanced_assignment n=256 k=8 randn cuda" in run.stdout and "objective equal" in run.stdout


def test_device_slug():
    gpu_check = load("gpu_check")
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_check.device_slug("") == "gpu"


@pytest.mark.parametrize("origin", ["default", "given"])
def test_make_gpu_check_uses_the_given_python(origin):
    cmd = ["make", "-n", "--no-print-directory", "gpu-check"] + (["PY=/opt/x/python3"] if origin == "given" else [])
    # Not the make this suite may run under (make test-installed): its variables are not the user's.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PY", "MAX_JOBS")}
    dry = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env).stdout
    python = "/opt/x/python3" if origin == "given" else "python3"
    assert f"{python} bench/gpu_check.py" in dry
    assert ".venv" not in dry and "pip" not in dry, "gpu-check creates no venv and installs nothing"


def test_slow_calls_take_fewer_calls_and_rounds():
    """A torch baseline of 200 ms per call timed as 20 calls x 17 rounds took 70 s of the H100's
    benchmark step; fit_to_call bounds a timing to about a second and leaves fast calls alone."""
    from moe_kernels.bench.timing import fit_to_call

    assert fit_to_call(20e-6, 20, 15, 0.05) == (20, 15)  # a kernel of microseconds: as asked
    assert fit_to_call(0.2, 20, 15, 0.05) == (1, 5)  # one call per round, about 1 s in all
    assert fit_to_call(0.0085, 20, 15, 0.05) == (5, 15)
    assert fit_to_call(3.0, 20, 15, 0.05) == (1, 3)  # at least 3 rounds: a median


def test_a_call_of_seconds_is_timed_once(monkeypatch):
    """capacity_positions' torch sequence takes ~3 s a call at T = 1M on the H200: its median of
    three rounds took seven calls; a call of 0.25 s or more is timed by the one after its first."""
    from moe_kernels.bench import timing

    calls = []
    monkeypatch.setattr(timing, "_one_call", lambda fn: 3.0)
    assert timing.timeit_cuda(lambda: calls.append(1)) == ([3.0], "one call")
    assert not calls, "no call beyond _one_call's"
    monkeypatch.setattr(timing, "_one_call", lambda fn: 0.1)
    monkeypatch.setattr(timing, "_capture", lambda fn, n: (_ for _ in ()).throw(RuntimeError("timed")))
    with pytest.raises(RuntimeError, match="timed"):
        timing.timeit_cuda(lambda: None)  # a faster call goes on to the rounds


def test_warm_compile_compiles_each_case_once(monkeypatch, capsys, tmp_path):
    """gpu_bench --warm-compile (run beside gpu-check's tests): each case's torch sequence compiled
    and called once; a case torch.compile cannot take is reported and the others go on."""
    gpu_bench = load("gpu_bench")
    import torch

    calls = []

    def seq(x):
        calls.append(x.shape)
        return x * 2

    def broken(x):
        raise RuntimeError("cannot")

    cases = [
        gpu_bench.Case("smooth_step", "a", 8, lambda: (torch.ones(4),), seq, seq),
        gpu_bench.Case("smooth_step", "b", 8, lambda: (torch.ones(4),), broken, broken),
        gpu_bench.Case("dselect_k", "c", 8, lambda: (torch.ones(3),), seq, seq),
    ]
    monkeypatch.setattr(gpu_bench, "grid", lambda kind: cases)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: fn)
    assert gpu_bench.warm_compile("quick", ["smooth_step"]) == 0
    out = capsys.readouterr().out
    assert calls == [torch.Size([4])]
    assert "compiled smooth_step a" in out and "smooth_step b: RuntimeError: cannot" in out and " c " not in out
    warmed = tmp_path / "warmed.txt"
    assert gpu_bench.warm_compile("quick", None, str(warmed)) == 0
    assert gpu_bench.warmed_cases(str(warmed)) == {"smooth_step a", "dselect_k c"}, "the compiled ones only"
    assert gpu_bench.warmed_cases(str(tmp_path / "none.txt")) == set() and gpu_bench.warmed_cases(None) is None


def test_compile_pass_takes_the_warmed_cases_until_its_deadline(monkeypatch):
    """Beside a warm-up the compile pass compiles only what the warm-up compiled (a cold compile of
    minutes would leave the profile pass no time); without one, every case until the deadline."""
    import time

    gpu_bench = load("gpu_bench")
    cases = [gpu_bench.Case("smooth_step", name, 8, None, None, None) for name in "abcd"]
    by_case = [(c, [{"ms": "1"}]) for c in cases[:3]] + [(cases[3], [])]  # d: no rows to add to
    compiled = []
    monkeypatch.setattr(gpu_bench, "add_compiled", lambda case, rows: compiled.append(case.config))
    monkeypatch.setattr(gpu_bench.torch.cuda, "empty_cache", lambda: None)
    later = time.monotonic() + 1e6
    gpu_bench.compile_pass(by_case, later, {"smooth_step b", "smooth_step d"}, lambda: None)
    assert compiled == ["b"]
    compiled.clear()
    gpu_bench.compile_pass(by_case, later, None, lambda: None)
    assert compiled == ["a", "b", "c"]
    compiled.clear()
    gpu_bench.compile_pass(by_case, time.monotonic() - 1, None, lambda: None)
    assert compiled == []


def test_grids_name_their_cases():
    """Each grid builds its cases (no tensors until a case's make); the goals grid holds one case
    of every op issue 33 sets a goal for, at the goals' sizes."""
    gpu_bench = load("gpu_bench")
    for kind in gpu_bench.GRIDS:
        assert gpu_bench.grid(kind)
    goals = gpu_bench.grid("goals")
    ops = {c.op for c in goals}
    assert {"topk_router", "capacity_positions", "dispatch", "combine", "permute", "unpermute", "batchwise_mask"} <= ops
    assert any("T=262144" in c.config and c.op == "topk_router" for c in goals)
    assert any("T=1048576" in c.config and c.op == "batchwise_mask" for c in goals)
    with pytest.raises(ValueError, match="kind must be one of"):
        gpu_bench.grid("fast")


def test_default_limits_fit_one_device_command():
    """gpu-check's default step limits add up to under one device command's 10 minutes, with a
    minute to spare for the start-up and the report (docs/reliability.md, The GPU run)."""
    seen = vars(load("gpu_check").parse_args([]))
    total = seen["build_timeout"] + seen["check_timeout"] + seen["test_timeout"] + seen["bench_timeout"]
    assert total <= 540, total
    assert seen["grid"] == "goals"


def test_backward_timings_reuse_their_output_gradient():
    """gpu_bench's fwd+bwd calls take the same tensor of ones as the output's gradient in every call
    (made at the first): a fresh [E, C, d] fill in each timed call was timed as the op's."""
    gpu_bench = load("gpu_bench")
    seen = []

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad)
            return grad * 2

    run = gpu_bench._grad_of(lambda x, other: (Record.apply(x), other), wrt=(0,), out=0)
    x = torch.randn(3, 4, requires_grad=True)
    (first,) = run(x, None)
    (second,) = run(x, None)
    assert torch.equal(first, torch.full((3, 4), 2.0)) and torch.equal(second, first)
    assert len(seen) == 2 and seen[0] is seen[1] and torch.equal(seen[0], torch.ones(3, 4))
    (wider,) = run(torch.randn(2, 5, requires_grad=True), None)  # another output shape: its own ones
    assert wider.shape == (2, 5) and seen[2].shape == (2, 5)


def test_instafail_keeps_the_assertion_of_a_long_traceback():
    """gpu-check's tracebacks as they happen (MOE_KERNELS_INSTAFAIL): a tensor repr of 50,000
    characters on the assertion's line must not push the assertion and its location out."""
    from instafail import instafail_text

    text = "\n".join(
        [
            "    def test_x():",
            ">       assert torch.equal(a, b)",
            "E       AssertionError: assert False",
            "E        +  where False = equal(" + "1.0, " * 10000 + ")",
            "python_tests/ops/test_x.py:607: AssertionError",
        ]
    )
    kept = instafail_text(text)
    assert len(kept) <= 4010
    assert "E       AssertionError: assert False" in kept and "test_x.py:607: AssertionError" in kept
    assert instafail_text("short") == "short"


def test_a_cut_group_is_read_from_its_log():
    """A group killed at its limit writes no junit file: its -v log gives its counts, its failures
    and the units from the one that was running on (a unit before it without a line had no GPU
    case); on the H200 the report had said "0 failed" while three cut groups had failures."""
    gpu_check = load("gpu_check")
    units = ["python_tests/a.py", "python_tests/b.py::test_x", "python_tests/b.py::test_y", "python_tests/c.py"]
    log = "\n".join(
        [
            "$ python3 -m pytest ...",
            "python_tests/a.py::test_one[cuda:triton] PASSED [  1%]",
            "python_tests/a.py::test_two SKIPPED (no) [  2%]",
            "python_tests/b.py::test_y[cuda:triton-1] FAILED [  3%]",
            "[instafail] python_tests/b.py::test_y[cuda:triton-1] (call)",
            "python_tests/b.py::test_y[cuda:triton-2] PASSED [  4%]",
            "python_tests/b.py::test_y[cuda:triton-3] ",
            "[gpu-check] group 0 killed after its 215 s limit",
        ]
    )
    counts, failed, left = gpu_check.cut_group(log, units)
    assert counts == {"passed": 2, "failed": 1, "skipped": 1}
    assert failed == ["python_tests/b.py::test_y[cuda:triton-1]"]
    assert left == ["python_tests/b.py::test_y", "python_tests/c.py"]  # test_x: no GPU case
    assert gpu_check.cut_group("$ pytest\n", units)[2] == units  # killed before any result


def test_profile_pass_takes_the_missed_goals_first():
    """The profile pass ("Where the time goes") takes the cases with a row that misses its issue-33
    goal first, in grid order, then the others: a run cut at its limit has the bounds it needs."""
    gpu_bench = load("gpu_bench")

    def row(op, config, share):
        return {"op": op, "config": config, "backend": "triton", "gbps": str(share * 1000), "copy_gbps": "1000"}

    by_case = [
        ("met dispatch", [row("dispatch", "fwd", 0.9)]),
        ("missed permute", [row("permute", "fwd", 0.7)]),
        ("no goal", [row("smooth_step", "a", 0.1)]),
        ("one backend misses", [row("combine", "fwd", 0.95), row("combine", "fwd", 0.5)]),
        ("no rows", []),
    ]
    order = [name for name, _ in gpu_bench.profile_order(by_case)]
    assert order == ["missed permute", "one backend misses", "met dispatch", "no goal", "no rows"]
