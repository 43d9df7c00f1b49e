"""`make gpu-report` (on a GPU machine): the CUDA test matrix, then every benchmark on the GPU, then
bench/results/gpu-<device name>.md with the test summary, each benchmark's ratio table (against
the torch sequences, measured in the same run) and the achieved GB/s of every row that states its
bytes, as a fraction of the device's peak memory bandwidth (from its properties).

    make gpu-report      (or, in a CUDA venv with the extension built: python bench/gpu_report.py)
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# CPU-only by design: gloo processes exchanging CPU tensors (docs/expert_parallel.md); the exact
# assignment against scipy (numpy on the host; its CUDA solver is opt-in, never run on a GPU).
CPU_ONLY = {"bench_expert_parallel.py", "bench_assignment.py"}


def peak_bandwidth(props) -> float | None:
    """Peak DRAM bandwidth in bytes/s: memory clock (kHz) x 2 (double data rate) x bus width (bits)
    / 8, from torch.cuda.get_device_properties; None if the properties do not say."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if not clock_khz or not bus_bits:
        return None
    return clock_khz * 1e3 * 2 * bus_bits / 8


def device_slug(name: str) -> str:
    """A file-name-safe form of the device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def bandwidth_table(rows: list[dict], peak: float | None) -> str:
    """Markdown: every row with a GB/s figure, and its share of the peak."""
    lines = ["| op | provider | mode | config | median ms | GB/s | % of peak |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("gb_per_s") in ("", None):
            continue
        gbs = float(r["gb_per_s"])
        share = f"{100 * gbs * 1e9 / peak:.1f}%" if peak else "-"
        lines.append(
            f"| {r['op']} | {r['provider']} | {r['mode']} | {r['config']} | {float(r['median_ms']):.4f} "
            f"| {gbs:.1f} | {share} |"
        )
    return "\n".join(lines)


def write_report(
    props, rows: list[dict], tables: dict[str, str], tests: str, failed: list[str], out_dir: Path, extra: str = ""
) -> Path:
    """Write <out_dir>/gpu-<device>.md and return its path. `props`: the device's properties;
    `rows`: benchmark rows (bench/common.measure); `tables`: each benchmark's markdown by name;
    `tests`: the test run's summary line; `failed`: benchmarks that failed."""
    peak = peak_bandwidth(props)
    peak_text = f"{peak / 1e9:.0f} GB/s" if peak else "unknown (the properties give no memory clock / bus width)"
    parts = [
        f"# GPU report: {props.name}\n",
        f"Compute capability {props.major}.{props.minor}, {props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.1f} GiB, peak memory bandwidth {peak_text}. {extra}\n",
        f"Tests (`pytest python_tests` with the GPU cases): {tests}\n",
        "## Achieved bandwidth\n",
        bandwidth_table(rows, peak) + "\n",
    ]
    if failed:
        parts.append("Benchmarks that failed (see the make output): " + ", ".join(failed) + "\n")
    for name, md in sorted(tables.items()):
        parts.append(f"## {name}\n\n" + re.sub(r"^# .*\n", "", md).strip() + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu-{device_slug(props.name)}.md"
    path.write_text("\n".join(parts))
    return path


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu-report needs a CUDA device (torch.cuda.is_available() is False): run it on a GPU machine")
    props = torch.cuda.get_device_properties(0)
    test = subprocess.run(
        [sys.executable, "-m", "pytest", "python_tests", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(test.stdout[-5000:], test.stderr[-2000:], flush=True)
    summary = (test.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MOE_KERNELS_BENCH_DEVICE="cuda", MOE_KERNELS_BENCH_RESULTS=tmp)
        for script in sorted(HERE.glob("bench_*.py")):
            if script.name in CPU_ONLY:
                continue
            print(f"== {script.name} on {props.name}", flush=True)
            if subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT).returncode != 0:
                failed.append(script.name)
        rows: list[dict] = []
        for path in sorted(Path(tmp).glob("*.csv")):
            with path.open() as f:
                rows += list(csv.DictReader(f))
        tables = {p.stem: p.read_text() for p in sorted(Path(tmp).glob("*.md"))}
    extra = f"torch {torch.__version__} (CUDA {torch.version.cuda})."
    path = write_report(props, rows, tables, summary, failed, HERE / "results", extra)
    print(f"wrote {path}")
    return 1 if failed or test.returncode != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
