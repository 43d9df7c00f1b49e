"""What a benchmark writes: its rows appended to <out>/<name>.csv (the machine and the commit in every
row), and <out>/<name>.md, a markdown table of each provider's median and its ratio against a
baseline measured in the same run (the figure we quote), peak memory where measured, the
torch.compile baselines' compile times, and the bandwidth against copy_ of the same bytes.

`out` is a folder the caller names: bench/results/ for the repository's scripts (bench/common.py),
--out (default ./moe_kernels_bench/) for python -m moe_kernels.bench; never the package's folder.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from moe_kernels.bench import timing
from moe_kernels.bench.timing import commit, machine


def compile_notes(notes: list[str]) -> str:
    """The markdown under a table: the compile time of each measure_compiled row ('' if none)."""
    if not notes:
        return ""
    head = "torch.compile (dynamic=False), first-call compile time (not in the timings):\n\n"
    return head + "| provider | config | compile s |\n|---|---|---|\n" + "\n".join(notes)


def bandwidth_section(model: str, entries: list[tuple[str, dict, int, dict, dict]]) -> str:
    """A markdown section: each op's achieved GB/s under its bytes-moved model next to copy_ of
    the same bytes. entries: (op, config, bytes moved, the op's measure() row, copy_pass's row)."""
    lines = [
        "\n## Bandwidth against copy_ of the same bytes (forward)\n",
        model + "\n",
        "| op | config | MB moved | ms | GB/s | copy_ GB/s | fraction of copy_ |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, config, nbytes, row, copy in entries:
        cfg = " ".join(f"{k}={v}" for k, v in config.items())
        lines.append(
            f"| {op} | {cfg} | {nbytes / 1e6:.1f} | {row['median_ms']:.3f} | {row['gb_per_s']:.1f} | "
            f"{copy['gb_per_s']:.1f} | {row['gb_per_s'] / copy['gb_per_s']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def write_csv(name: str, rows: list[dict], out: Path) -> Path:
    """Append rows to <out>/<name>.csv; when they bring a column the file lacks (peak_mb),
    the file is rewritten with the union of the columns (old rows get empty cells)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.csv"
    fields = list(dict.fromkeys(k for r in rows for k in r))
    old: list[dict] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            if set(fields) - set(header):
                old = list(reader)
            fields = list(dict.fromkeys(header + fields))
    with path.open("w" if old or not path.exists() else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        if old or f.tell() == 0:
            writer.writeheader()
        writer.writerows(old + rows)
    return path


def csv_stamps(folder: Path) -> dict[Path, int]:
    """The modification time of each CSV in folder: what changed across a benchmark's run is what it wrote."""
    return {p: p.stat().st_mtime_ns for p in Path(folder).glob("*.csv")} if Path(folder).is_dir() else {}


def ratio_table(rows: list[dict], *, baseline: str, providers: list[str]) -> str:
    """Markdown: per (mode, config), each provider's median and baseline_time / provider_time."""
    keys = sorted({(r["mode"], r["config"]) for r in rows}, key=lambda k: [r["config"] for r in rows].index(k[1]))
    head = "| mode | config | " + " | ".join(f"{p} ms" for p in providers)
    head += " | " + " | ".join(f"speed-up of {p} vs {baseline}" for p in providers if p != baseline) + " |"
    lines = [head, "|" + "---|" * (2 + len(providers) + len(providers) - 1)]
    for mode, config in keys:
        t = {r["provider"]: r["median_ms"] for r in rows if r["mode"] == mode and r["config"] == config}
        cells = [f"{t[p]:.3f}" if p in t else "-" for p in providers]
        ratios = [f"{t[baseline] / t[p]:.2f}x" if p in t and baseline in t else "-" for p in providers if p != baseline]
        lines.append(f"| {mode} | {config} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def memory_table(rows: list[dict], providers: list[str]) -> str:
    """Markdown: per (mode, config), each provider's peak_mb where measured ('' if none was)."""
    measured = [r for r in rows if r.get("peak_mb") not in (None, "")]
    if not measured:
        return ""
    shown = [p for p in providers if any(r["provider"] == p for r in measured)]
    keys = list(dict.fromkeys((r["mode"], r["config"]) for r in measured))
    where = "torch.cuda.max_memory_allocated" if timing.DEVICE == "cuda" else "process peak RSS (VmHWM)"
    lines = [
        f"\n## Peak memory of one call, MB above what was in use before it ({where})\n",
        "| mode | config | " + " | ".join(shown) + " |",
        "|---|---|" + "---|" * len(shown),
    ]
    for mode, config in keys:
        m = {r["provider"]: r["peak_mb"] for r in measured if r["mode"] == mode and r["config"] == config}
        cells = [f"{float(m[p]):.1f}" if p in m else "-" for p in shown]
        lines.append(f"| {mode} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(
    name: str, rows: list[dict], *, out: Path, baseline: str, providers: list[str], command: str, notes: str = ""
) -> str:
    """Write <out>/<name>.csv and <out>/<name>.md (the table quoted in docs), return the markdown."""
    write_csv(name, rows, out)
    md = (
        f"# {name}\n\nCommand: `{command}`  \nMachine: {machine()}  \nCommit: {commit()}, torch {torch.__version__}\n\n"
        f"Median of >= 15 runs; ratios are against `{baseline}` measured in the same run.\n\n"
        + ratio_table(rows, baseline=baseline, providers=providers)
        + "\n"
        + memory_table(rows, providers)
        + (f"\n{notes}\n" if notes else "")
    )
    (Path(out) / f"{name}.md").write_text(md)
    print(md)
    return md
