"""`make gpu-check`: on a GPU machine, one offline command that builds, tests and benchmarks there.

It uses the Python it is run with (`make gpu-check PY=python3`), creates no venv and installs
nothing:
  1. builds the extension in place (`setup.py build_ext --inplace`) against the installed torch,
     with the CUDA kernels for the GPU it finds (its compute capability, or
     MOE_KERNELS_CUDA_ARCHS) and MAX_JOBS = the core count;
  2. `python -m moe_kernels.check` on the GPU (every op of every backend against the reference, seconds);
  3. runs the GPU cases of the suite (`pytest -m gpu`: every `cuda:cuda` / `cuda:triton` case and
     the GPU-only tests) in a few parallel groups of test files, each under its own time limit,
     and meanwhile compiles the benchmarks' torch baselines into torch's caches;
  4. runs the GPU benchmarks (bench/gpu_bench.py), by default their "goals" grid: one shape per
     row of issue 33's goals, at the sizes the goals name (`--grid quick|goals|full`).
Each step writes its log into the output folder (GPU_OUT, `--out`) as it goes, and the report
(report.md there) is rewritten after every step, so a run cut off at any point leaves everything
up to there. Without a GPU it still builds and runs the test step, whose GPU cases are skipped
with their reason, and skips the benchmarks (the suite's smoke form:
python_tests/bench/test_gpu_check.py).

    make gpu-check GPU_OUT=/tmp/gpu          (or: python3 bench/gpu_check.py --out /tmp/gpu)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "python_tests"


def probe() -> dict:
    """What this machine has, read in a child process (importing torch here would pin the build's
    torch before the build; the child also keeps a CUDA context out of this process)."""
    code = (
        "import json, os, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpu': torch.cuda.is_available()}\n"
        "if d['gpu']:\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d.update(name=p.name, cc=f'{p.major}{p.minor}', sms=p.multi_processor_count,\n"
        "             memory_gib=round(p.total_memory / 2**30, 1), count=torch.cuda.device_count())\n"
        "try:\n"
        "    import triton; d['triton'] = triton.__version__\n"
        "except ImportError:\n"
        "    d['triton'] = None\n"
        "try:\n"
        "    import transformers; d['transformers'] = transformers.__version__\n"
        "except ImportError:\n"
        "    d['transformers'] = None\n"
        "print(json.dumps(d))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def device_slug(name: str) -> str:
    """A file-name-safe form of the device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


class Run:
    """The output folder and the report, rewritten after each step."""

    def __init__(self, out: Path, info: dict):
        self.out = out
        self.info = info
        self.steps: list[tuple[str, str, float, str]] = []  # (step, status, seconds, detail)
        out.mkdir(parents=True, exist_ok=True)
        (out / "machine.json").write_text(json.dumps(info, indent=1))

    def step(self, name: str, status: str, seconds: float, detail: str = "") -> None:
        self.steps.append((name, status, seconds, detail))
        print(f"== {name}: {status} in {seconds:.0f} s {detail}", flush=True)
        self.write_report()

    def write_report(self) -> None:
        info = self.info
        lines = ["# gpu-check report\n"]
        if info.get("gpu"):
            lines.append(
                f"Device: {info['name']} (compute capability {info['cc'][:-1]}.{info['cc'][-1]}, "
                f"{info['sms']} SMs, {info['memory_gib']} GiB, {info['count']} visible)  "
            )
        else:
            lines.append("Device: none (torch.cuda.is_available() is False): GPU cases skipped  ")
        lines.append(
            f"torch {info.get('torch')} (CUDA {info.get('cuda')}), triton {info.get('triton')}, "
            f"transformers {info.get('transformers')}, {os.cpu_count()} cores, Python {sys.version.split()[0]}  "
        )
        lines.append(f"Commit: {git_commit()}\n")
        lines.append("| step | status | seconds | detail |\n|---|---|---|---|")
        lines += [f"| {n} | {s} | {t:.0f} | {d} |" for n, s, t, d in self.steps]
        for extra in ("failures.md", "bench.md"):
            path = self.out / extra
            if path.exists():
                lines.append("\n" + path.read_text())
        (self.out / "report.md").write_text("\n".join(lines) + "\n")


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True)
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def run_logged(cmd: list[str], log: Path, *, env: dict, timeout: float) -> tuple[int | None, float]:
    """Run `cmd`, its output into `log` as it comes; (returncode or None on timeout, seconds)."""
    start = time.monotonic()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            f.write(f"\n[gpu-check] killed after its {timeout:.0f} s limit\n")
            rc = None
    return rc, time.monotonic() - start


def build(run: Run, *, timeout: float) -> bool:
    """The extension in place, against the installed torch; the CUDA kernels when torch and nvcc can."""
    info = run.info
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1))
    cuda = bool(info.get("cuda")) and shutil.which("nvcc") is not None
    env["MOE_KERNELS_CUDA"] = "1" if cuda else "0"
    if cuda and info.get("gpu") and not env.get("MOE_KERNELS_CUDA_ARCHS"):
        env["MOE_KERNELS_CUDA_ARCHS"] = info["cc"]
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    rc, seconds = run_logged(cmd, run.out / "build.log", env=env, timeout=timeout)
    archs = env.get("MOE_KERNELS_CUDA_ARCHS", "setup.py's default")
    kernels = f"archs {archs}" if cuda else "no (no CUDA torch or no nvcc)"
    detail = f"CUDA kernels: {kernels}, MAX_JOBS={env['MAX_JOBS']}"
    if rc == 0:
        check = subprocess.run(
            [sys.executable, "-c", "import moe_kernels._extension as e; assert e.LOADED, e.LOAD_ERROR"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            rc = check.returncode
            with (run.out / "build.log").open("a") as f:
                f.write("\n[gpu-check] the built extension does not load:\n" + check.stderr)
    status = "ok" if rc == 0 else ("timeout" if rc is None else f"failed (rc {rc})")
    run.step("build", status, seconds, detail)
    return rc == 0


def quick_check(run: Run, *, timeout: float) -> bool:
    """`python -m moe_kernels.check` on the device: every op of every backend against the reference
    on a few small inputs, seconds; its table goes into the report."""
    device = "cuda" if run.info.get("gpu") else "cpu"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "moe_kernels.check", "--device", device]
    rc, seconds = run_logged(cmd, run.out / "check.log", env=env, timeout=timeout)
    lines = (run.out / "check.log").read_text().splitlines()
    summary = lines[-1] if lines and "passed" in lines[-1] else "no summary (see check.log)"
    status = "ok" if rc == 0 else ("timeout" if rc is None else "failed")
    run.step("check", status, seconds, f"python -m moe_kernels.check --device {device}: {summary}")
    return rc == 0


def test_files() -> list[Path]:
    """Every test file of the suite, in python_tests/ and its folders (ops/, gates/, ...)."""
    return sorted(TESTS.rglob("test_*.py"))


def under_tests(path: Path) -> str:
    """A test file's path under python_tests/ ("ops/test_dispatch.py"), as HEAVY and SPLIT name it."""
    return path.relative_to(TESTS).as_posix()


# Files whose GPU cases take longest (many parametrisations, Triton compiles, hypothesis): they go
# to the groups test function by test function (SPLIT), so no group holds a whole one. Both name
# paths under python_tests/.
HEAVY = (
    "ops/test_fuzz.py",
    "backends/test_gpu.py",
    "ops/test_topk_router.py",
    "ops/test_topk_softmax.py",
    "ops/test_dispatch.py",
    "ops/test_load_probabilities.py",
    "ops/test_batchwise_mask.py",
    "ops/test_noisy_topk_gate.py",
    "ops/test_balanced_assignment.py",
    "ops/test_nonfinite.py",
)
SPLIT = HEAVY

# Seconds each unit's GPU cases took on an H100/H200 (gpu-check runs' junit files, merged in by
# `gpu_check.py --record-seconds OUT`): the groups are filled longest unit first. A unit it does
# not name has no GPU case or is new: it counts as UNKNOWN_SECONDS (most units take under one).
SECONDS = HERE / "gpu_test_seconds.json"
UNKNOWN_SECONDS = 1.0


def units(files: list[Path]) -> list[str]:
    """pytest arguments: a SPLIT file's test functions one by one, other files whole."""
    out = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        if under_tests(path) in SPLIT:
            names = re.findall(r"^def (test_\w+)\(", path.read_text(), re.M)
            out += [f"{rel}::{name}" for name in names] or [rel]
        else:
            out.append(rel)
    return out


def measured_seconds() -> dict[str, float]:
    return json.loads(SECONDS.read_text()) if SECONDS.exists() else {}


def split(files: list[Path], groups: int, seconds: dict[str, float] | None = None) -> list[list[str]]:
    """The units over `groups` groups, longest first onto the group with the least so far (by
    `seconds`, the measured table by default), so the groups end together."""
    seconds = measured_seconds() if seconds is None else seconds
    ranked = sorted(units(files), key=lambda u: -seconds.get(u, UNKNOWN_SECONDS))
    out: list[list[str]] = [[] for _ in range(groups)]
    load = [0.0] * groups
    for unit in ranked:
        i = load.index(min(load))
        out[i].append(unit)
        load[i] += seconds.get(unit, UNKNOWN_SECONDS)
    return [g for g in out if g]


def unit_of(classname: str, name: str) -> str | None:
    """The unit (as units() names it) of a junit testcase: classname "python_tests.ops.test_x"
    (or ".TestClass" after it), name "test_f[params]"."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:end]).with_suffix(".py")
        if path.is_file():
            rel = str(path.relative_to(ROOT))
            return f"{rel}::{name.split('[')[0]}" if under_tests(path) in SPLIT else rel
    return None


def record_seconds(outs: list[Path]) -> dict[str, float]:
    """Each unit's seconds in the junit files of these gpu-check outputs (the sum over its cases;
    a later output's figure replaces an earlier one's), merged into SECONDS (a unit they hold
    replaces its old figure; one they lack keeps it)."""
    found: dict[str, float] = {}
    for out in outs:  # a unit in a later output replaces its figure from an earlier one
        run: dict[str, float] = {}
        for xml in sorted(out.glob("tests-*.xml")):
            for case in ET.parse(xml).getroot().iter("testcase"):
                unit = unit_of(case.get("classname", ""), case.get("name", ""))
                if unit is not None:
                    run[unit] = run.get(unit, 0.0) + float(case.get("time") or 0)
        found.update(run)
    table = {**measured_seconds(), **{u: round(s, 2) for u, s in found.items()}}
    SECONDS.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    return found


def junit_counts(path: Path) -> tuple[dict, list[tuple[str, str]]]:
    """(counts of tests, failures, errors, skipped; [(test id, message)] of each failure/error)."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failures: list[tuple[str, str]] = []
    if not path.exists():
        return counts, failures
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return counts, failures
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            for node in case.findall(tag):
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (node.get("message") or tag).splitlines() or [tag]
                failures.append((name, message[0][:300]))
    return counts, failures


# A case's line in a `pytest -v` log: its node id, then its outcome.
_LOG_RESULT = re.compile(r"^(python_tests/\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def cut_group(text: str, units: list[str]) -> tuple[dict, list[str], list[str]]:
    """What the `-v` log `text` of a group killed at its limit says (its junit file is never
    written): ({"passed", "failed", "skipped"} counts, the failed node ids, the units not run to
    their end). pytest runs the units in the order given, so those from the one that was running
    on are the ones a follow-up must run; a unit before it without a line had no GPU case."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, nodes = [], []
    for node, outcome in _LOG_RESULT.findall(text):
        nodes.append(node)
        key = {"PASSED": "passed", "XFAIL": "passed", "SKIPPED": "skipped"}.get(outcome, "failed")
        counts[key] += 1
        if key == "failed":
            failed.append(node)

    def ran(unit: str) -> bool:
        return any(n == unit or n.startswith((unit + "::", unit + "[")) for n in nodes)

    last = max((i for i, unit in enumerate(units) if ran(unit)), default=0)
    return counts, failed, units[last:]


def tests(
    run: Run, *, groups: int, timeout: float, marker: str, fuzz_examples: int, files: list[Path] | None = None
) -> bool:
    """The GPU cases (`-m marker`) in parallel groups of files, each under `timeout` seconds.
    The fuzz tests run `fuzz_examples` generated cases per op and backend (CI's CPU run: 500)."""
    env = dict(os.environ, MOE_KERNELS_REQUIRE_EXTENSION="1", PYTHONUNBUFFERED="1", MOE_KERNELS_INSTAFAIL="1")
    env.setdefault("MOE_KERNELS_FUZZ_EXAMPLES", str(fuzz_examples))
    # Inductor compiles in the test's own process: by default each group's first compile starts a
    # pool of a worker a core (16 processes importing torch, times 12 groups), and on the H200 a
    # group whose one unit compiled a tiny graph (test_balanced_assignment.py::test_compile) took
    # 107 s beside the others.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    env.pop("TRITON_INTERPRET", None)
    procs = []
    units_of: dict[int, list[str]] = {}
    start = time.monotonic()
    for i, group in enumerate(split(files or test_files(), groups)):
        xml = run.out / f"tests-{i}.xml"
        # -v: each case's result is in the log as it ends, so a group killed at its limit still says
        # what ran; pytest-timeout (when installed) stops a hanging case instead of the whole group.
        cmd = [sys.executable, "-m", "pytest", "-m", marker, "-v", "-rs", "--tb=short", "-p", "no:cacheprovider"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append(f"--timeout={int(min(120, timeout))}")
        cmd += [f"--junitxml={xml}", *group]
        log = (run.out / f"tests-{i}.log").open("w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((i, proc, log, xml))
        units_of[i] = group
    timed_out = []
    for i, proc, log, _ in procs:
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            log.write(f"\n[gpu-check] group {i} killed after its {timeout:.0f} s limit\n")
            timed_out.append(i)
        log.close()
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[tuple[str, str]] = []
    rcs = []
    for _, proc, _, xml in procs:
        counts, fails = junit_counts(xml)
        for key in total:
            total[key] += counts[key]
        failed += fails
        rcs.append(proc.returncode)
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    detail = f"{passed} passed, {total['failures'] + total['errors']} failed, {total['skipped']} skipped"
    if timed_out:
        cut = {"passed": 0, "failed": 0, "skipped": 0}
        left: list[str] = []
        for i in timed_out:
            counts, fails, rest = cut_group((run.out / f"tests-{i}.log").read_text(errors="replace"), units_of[i])
            for key in cut:
                cut[key] += counts[key]
            failed += [(node, f"in group {i}, cut at its limit: tests-{i}.log has its traceback") for node in fails]
            left += rest
        # The units to run again, one pytest argument a line: a follow-up call's list.
        (run.out / "not-reached.txt").write_text("".join(f"{unit}\n" for unit in left))
        detail += (
            f"; groups {timed_out} hit the {timeout:.0f} s limit: their logs say {cut['passed']} passed, "
            f"{cut['failed']} failed, {cut['skipped']} skipped, and {len(left)} units not run to their end "
            "(not-reached.txt)"
        )
    lines = ["## Test failures\n"] if failed else []
    lines += [f"- `{name}`: {msg}" for name, msg in failed[:200]]
    (run.out / "failures.md").write_text("\n".join(lines) + ("\n" if lines else ""))
    ok = not failed and not timed_out and all(rc in (0, 5) for rc in rcs)
    run.step("tests", "ok" if ok else "failed", time.monotonic() - start, detail)
    return ok


def bench_env() -> dict:
    # The in-place build is imported from the source tree: nothing is installed.
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)
    return env


def warmed(run: Run) -> Path:
    """The warm-up's list of the cases it compiled, which the benchmark step's compile pass takes."""
    return run.out / "compile-warmed.txt"


def start_compile_warmup(run: Run, *, grid: str) -> subprocess.Popen:
    """torch.compile of every benchmark case's torch sequence, in the background while the tests
    run: it fills torch's on-disk compile caches (FX graph, AOT autograd, Triton), so that the
    benchmark step's compile pass, which compiles the same graphs, finds them there (~20 s a case
    compiled cold on the H200). Nothing of it is timed."""
    cmd = [sys.executable, str(HERE / "gpu_bench.py"), "--warm-compile", "--grid", grid, "--warmed", str(warmed(run))]
    log = (run.out / "compile-warmup.log").open("w")
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    # A few compile workers: the test groups need the cores more.
    env = dict(bench_env(), TORCHINDUCTOR_COMPILE_THREADS="4")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def stop_compile_warmup(proc: subprocess.Popen) -> None:
    """Ended with the tests, done or not: what it compiled so far is cached; the benchmarks must not
    share the GPU with it."""
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait()


def benchmarks(run: Run, *, timeout: float, grid: str, warmed: Path | None = None) -> bool:
    env = bench_env()
    cmd = [sys.executable, str(HERE / "gpu_bench.py"), "--out", str(run.out), "--grid", grid]
    if warmed is not None:
        cmd += ["--warmed", str(warmed)]
    # The compile pass gets what the eager pass leaves; compiles start until 60 s before the limit
    # (the budget counts from gpu_bench's start, after its imports; each compile takes seconds),
    # which leaves the last compile and the profile pass after it (a few eager calls a row) time.
    # On the H200 the quick grid's eager pass took 127 s: two thirds of a 190 s limit left none.
    cmd += ["--compile-budget", str(int(max(timeout - 60, timeout / 2)))]
    rc, seconds = run_logged(cmd, run.out / "bench.log", env=env, timeout=timeout)
    status = "ok" if rc == 0 else ("timeout" if rc is None else f"failed (rc {rc})")
    run.step("benchmarks", status, seconds, f"{grid} grid")
    return rc == 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("GPU_OUT") or str(ROOT / "gpu-check-out"))
    # 12 groups: each group is one process that compiles its own Triton specialisations, so the
    # tests are bound by the host; with 8 on the H200's 16 cores six groups hit their limit
    # (bench/results/gpu-nvidia-h200.md, 2026-11-29).
    parser.add_argument("--groups", type=int, default=int(os.environ.get("GPU_CHECK_GROUPS", 12)))
    # 40 fuzz cases: each new shape compiles new specialisations; at 100 the batchwise fuzz test
    # alone passed 120 s on the H200 (60 took 66 s for both device backends).
    parser.add_argument("--fuzz-examples", type=int, default=40, help="generated cases per fuzz test (CI: 500)")
    # Defaults sized on the H200 with 16 cores (bench/results/gpu-nvidia-h200.md): build 40 s,
    # check 35 s, then the tests (the longest unit alone, balanced_assignment's compile test, takes
    # 107 s), the goals grid's eager pass ~140 s, then torch.compile baselines until 60 s before its
    # limit and the profile pass. The limits add up to 530 s: one device command (at most 10
    # minutes) of a session's 15 minutes of device time, the machine's start included.
    parser.add_argument("--build-timeout", type=float, default=70)
    parser.add_argument("--check-timeout", type=float, default=45)
    parser.add_argument("--test-timeout", type=float, default=215, help="seconds for each test group")
    parser.add_argument("--bench-timeout", type=float, default=200)
    parser.add_argument("--skip-build", action="store_true", help="use the extension already built")
    parser.add_argument("--skip-check", action="store_true", help="leave out python -m moe_kernels.check")
    parser.add_argument(
        "--record-seconds", nargs="+", metavar="OUT", help="merge these runs' test seconds into gpu_test_seconds.json"
    )
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--grid", default="goals", choices=("quick", "goals", "full"), help="the benchmarks' grid")
    parser.add_argument("--full-bench", action="store_true", help="--grid full")
    parser.add_argument("--marker", default="gpu", help="pytest -m expression for the test step")
    parser.add_argument("--files", nargs="*", help="test files (default: every python_tests/**/test_*.py)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.record_seconds:
        found = record_seconds([Path(p) for p in args.record_seconds])
        print(f"{len(found)} units' seconds -> {SECONDS}")
        return 0

    run = Run(Path(args.out).resolve(), probe())
    if "error" in run.info:
        run.step("probe", "failed", 0, "python cannot import torch: see machine.json")
        return 1
    ok = True
    if not args.skip_build:
        ok = build(run, timeout=args.build_timeout)
        if not ok:
            return 1
    files = [ROOT / f for f in args.files] if args.files else None
    if not args.skip_check:
        ok = quick_check(run, timeout=args.check_timeout) and ok
    bench = not args.no_bench and run.info.get("gpu")
    grid = "full" if args.full_bench else args.grid
    warmed(run).unlink(missing_ok=True)
    warmup = start_compile_warmup(run, grid=grid) if bench else None
    try:
        ok = (
            tests(
                run,
                groups=args.groups,
                timeout=args.test_timeout,
                marker=args.marker,
                fuzz_examples=args.fuzz_examples,
                files=files,
            )
            and ok
        )
    finally:
        if warmup is not None:
            stop_compile_warmup(warmup)
    if not bench:
        run.step("benchmarks", "skipped", 0, "--no-bench" if args.no_bench else "no GPU")
    else:
        ok = benchmarks(run, timeout=args.bench_timeout, grid=grid, warmed=warmed(run)) and ok
    slug = device_slug(run.info.get("name", "cpu"))
    print(f"report: {run.out / 'report.md'} (device {slug})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
