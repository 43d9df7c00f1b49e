"""Plot a results CSV (<out>/<op>.csv, output.write_csv's rows) as <out>/<op>.png, and index the
results of a folder in its README.md (bench/results/README.md). Needs matplotlib (the package CLI
imports this module only when matplotlib is importable).

A plot shows, per mode (forward, fwd+bwd, ...), the median time per call (log scale) against the
swept size (T, B, n, E or d: the one taking the most values) for each provider, with the limit
providers (`read pass`, `write pass`, `copy_`, `torch.clone`: one pass over the bytes;
topk_softmax's `forward + write`) drawn in black. Configs that vary in more than the size become a
line style (the key with the most values, up to 4) and more panels (the rest). Keys fixed by the
others (dispatch's C, batchwise's m) are left out. Without a swept size (one config, or configs
differing by model family only) it is a bar chart
(linear time axis from zero: bars on a log axis mislead).
The CSV is appended to by every run: a plot uses the last row of each (provider, mode, config).

    .venv/bin/python bench/plot.py [bench/results/<op>.csv ...]   # default: every CSV there
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on benchmark machines
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

LIMIT_PROVIDERS = ("read pass", "write pass", "copy_", "torch.clone", "forward + write")
SIZE_KEYS = ("T", "B", "n", "E", "d")  # candidates for the x axis, preferred in this order on ties
LINE_STYLES = ("-", "--", ":", "-.")


def latest_rows(path: Path) -> list[dict]:
    """The last row of each (provider, mode, config) in the CSV, in the order they first appear."""
    latest: dict[tuple, dict] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            latest[(row["provider"], row["mode"], row["config"])] = row
    return list(latest.values())


def parse_config(text: str) -> dict[str, str]:
    """'T=4096 E=8 k=2' -> {'T': '4096', 'E': '8', 'k': '2'}."""
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def _number(value: str | None) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def layout(configs: list[dict[str, str]]) -> tuple[str | None, str | None, list[str]]:
    """(x key, line-style key, panel keys) for these configs; x is None when no size varies."""
    keys = list(dict.fromkeys(k for c in configs for k in c))
    values = {k: list(dict.fromkeys(c.get(k) for c in configs)) for k in keys}
    varying = [k for k in keys if len(values[k]) > 1]
    sizes = [k for k in SIZE_KEYS if k in varying and all(_number(v) is not None for v in values[k])]
    if not sizes:
        return None, None, []
    x = max(sizes, key=lambda k: (len(values[k]), -SIZE_KEYS.index(k)))
    kept = [k for k in varying if k != x]
    # A key that the others determine (C = ceil(cf T k / E)) would split every line into points.
    for key in reversed(list(kept)):
        others = [x, *(k for k in kept if k != key)]
        seen: dict[tuple, str | None] = {}
        if all(seen.setdefault(tuple(c.get(k) for k in others), c.get(key)) == c.get(key) for c in configs):
            kept.remove(key)
    styled = [k for k in kept if len(values[k]) <= len(LINE_STYLES)]
    style = max(styled, key=lambda k: len(values[k])) if styled else None
    return x, style, [k for k in kept if k != style]


def _fixed_by(x: str, configs: list[dict[str, str]]) -> list[str]:
    """The varying keys that x alone determines (balanced_assignment's k = f(n)): shown in x ticks."""
    keys = [k for k in dict.fromkeys(k for c in configs for k in c) if k != x]
    out = []
    for key in keys:
        seen: dict[str | None, str | None] = {}
        varies = len({c.get(key) for c in configs}) > 1
        if varies and all(seen.setdefault(c.get(x), c.get(key)) == c.get(key) for c in configs):
            out.append(key)
    return out


def _label(config: dict[str, str], keys: list[str]) -> str:
    return " ".join(f"{k}={config.get(k, '-')}" for k in keys)


def _colors(providers: list[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ours = [p for p in providers if p not in LIMIT_PROVIDERS]
    return {p: ("black" if p in LIMIT_PROVIDERS else cycle[ours.index(p) % len(cycle)]) for p in providers}


def _title(op: str, rows: list[dict], log: bool) -> str:
    commits = ", ".join(sorted({r["commit"] for r in rows}))
    machines = ", ".join(sorted({r["machine"] for r in rows}))
    scale = " (log)" if log else ""
    return f"{op}: median ms per call{scale}, last run of each row\n{machines}; commit {commits}"


def figure(csv_path: Path):
    """The matplotlib Figure for one results CSV (the caller saves or closes it)."""
    rows = latest_rows(Path(csv_path))
    if not rows:
        raise ValueError(f"csv_path: {csv_path} holds no result rows")
    for r in rows:
        r["_config"] = parse_config(r["config"])
        r["_ms"] = float(r["median_ms"])
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    colors = _colors(providers)
    x, style, panel_keys = layout(list({r["config"]: r["_config"] for r in rows}.values()))
    if x is None:
        fig = _bars(rows, providers, modes, colors)
    else:
        fig = _lines(rows, providers, modes, colors, x, style, panel_keys)
    fig.suptitle(_title(Path(csv_path).stem, rows, log=x is not None), fontsize=9)
    return fig


def plot_csv(csv_path: Path, png_path: Path | None = None) -> Path:
    """Draw the PNG beside the CSV (or at png_path) and return its path."""
    png_path = Path(png_path) if png_path else Path(csv_path).with_suffix(".png")
    fig = figure(csv_path)
    fig.savefig(png_path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png_path


def _lines(rows, providers, modes, colors, x, style, panel_keys):
    panels = list(dict.fromkeys(_label(r["_config"], panel_keys) for r in rows))
    styles = list(dict.fromkeys(r["_config"].get(style) for r in rows)) if style else [None]
    fig, axes = plt.subplots(
        len(modes), len(panels), figsize=(3.4 * len(panels) + 1, 2.9 * len(modes) + 0.8), squeeze=False
    )
    xs_all = sorted({float(r["_config"][x]) for r in rows})
    fixed = _fixed_by(x, [r["_config"] for r in rows])
    by_x = {float(r["_config"][x]): r["_config"] for r in rows}
    ticks = [f"{v:g}" + "".join(f"\n{k}={by_x[v].get(k, '-')}" for k in fixed) for v in xs_all]
    for i, mode in enumerate(modes):
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            for provider in providers:
                for s, value in enumerate(styles):
                    points = sorted(
                        (float(r["_config"][x]), r["_ms"])
                        for r in rows
                        if r["provider"] == provider
                        and r["mode"] == mode
                        and _label(r["_config"], panel_keys) == panel
                        and (style is None or r["_config"].get(style) == value)
                    )
                    if points:
                        limit = provider in LIMIT_PROVIDERS
                        ax.plot(
                            *zip(*points),
                            color=colors[provider],
                            linestyle=LINE_STYLES[s],
                            marker="." if limit else "o",
                            markersize=3 if limit else 4,
                            linewidth=1 if limit else 1.5,
                        )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(xs_all, ticks)
            ax.minorticks_off()
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(" | ".join(t for t in (mode, panel) if t), fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(modes) - 1:
                ax.set_xlabel(x, fontsize=8)
            if j == 0:
                ax.set_ylabel("ms", fontsize=8)
    handles = [
        Line2D([], [], color=colors[p], marker="o", label=p + (" (limit)" if p in LIMIT_PROVIDERS else ""))
        for p in providers
    ]
    if style:
        handles += [
            Line2D([], [], color="gray", linestyle=LINE_STYLES[s], label=f"{style}={v if v is not None else '-'}")
            for s, v in enumerate(styles)
        ]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, (0.3 + 0.2 * (len(handles) // 6)) / height, 1, 1 - 0.6 / height))
    return fig


def _bars(rows, providers, modes, colors):
    configs = list(dict.fromkeys(r["config"] for r in rows))
    parsed = [parse_config(c) for c in configs]
    varying = [k for k in dict.fromkeys(k for c in parsed for k in c) if len({c.get(k) for c in parsed}) > 1]
    names = [_label(c, varying) or config for c, config in zip(parsed, configs)]
    fig, axes = plt.subplots(
        len(modes),
        1,
        figsize=(max(5, 1.1 * len(configs) * len(providers) ** 0.5 + 2), 2.8 * len(modes) + 0.8),
        squeeze=False,
    )
    width = 0.8 / len(providers)
    for i, mode in enumerate(modes):
        ax = axes[i][0]
        for p, provider in enumerate(providers):
            t = {r["config"]: r["_ms"] for r in rows if r["provider"] == provider and r["mode"] == mode}
            xs = [c + (p - (len(providers) - 1) / 2) * width for c, config in enumerate(configs) if config in t]
            ax.bar(xs, [t[config] for config in configs if config in t], width, color=colors[provider], label=provider)
        ax.set_xticks(range(len(configs)), names, fontsize=7, rotation=20 if len(configs) > 3 else 0)
        ax.set_title(mode, fontsize=8)
        ax.set_ylabel("ms", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, frameon=False, ncol=min(len(providers), 4))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    return fig


def command_of(md_path: Path) -> str:
    """The `Command:` line of a bench/results/<op>.md, or '-'."""
    match = re.search(r"^Command: `([^`]*)`", md_path.read_text(), re.MULTILINE) if md_path.exists() else None
    return match.group(1) if match else "-"


def write_index(results: Path) -> Path:
    """bench/results/README.md: one line per result (op, its table, its plot, the command)."""
    lines = [
        "# Benchmark results",
        "",
        "Written by `make bench` (bench/run_all.py): each bench appends its rows to `<op>.csv`, writes the",
        "table `<op>.md` and, through bench/plot.py, the plot `<op>.png` (median ms per call against the",
        "swept size, per provider and mode; `read pass` / `copy_` / `torch.clone`, where measured, is the",
        "memory-bandwidth limit). `*_quick` files come from `--quick` smoke runs. Regenerate the plots and",
        "this index from the CSVs alone with `.venv/bin/python bench/plot.py`.",
        "",
        "| op | table | plot | command |",
        "|---|---|---|---|",
    ]
    for csv_path in sorted(results.glob("*.csv")):
        op, md, png = csv_path.stem, csv_path.with_suffix(".md"), csv_path.with_suffix(".png")
        table = f"[{md.name}]({md.name})" if md.exists() else "-"
        image = f"[{png.name}]({png.name})" if png.exists() else "-"
        lines.append(f"| {op} | {table} | {image} | `{command_of(md)}` |")
    path = results / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
