"""The paper reproductions' figures, docs/img/<name>.png, drawn from their committed results only:

  kool_toy     examples/out/reinforce.jsonl + gating.jsonl: Kool et al. Figure 2b / 2c as heat
               maps (estimator x tau, colour = share of seeds solved, cells 'solved/seeds (median MSE)')
  noisy_topk   the Table 6 of docs/noisy_topk.md (examples/shazeer_balance.py prints it, no file):
               balance and test loss per (w_importance, w_load) row
  batchwise    the per-seed table of docs/batchwise.md (examples/batchwise_thresholds.py --tune)
  dselect_k    the recovery table of docs/dselect_k.md (examples/dselect_recovery.py, reduced run)

    .venv/bin/python examples/plot_papers.py [kool_toy noisy_topk batchwise dselect_k]

Nothing here runs an experiment: re-run the example, update its doc or results file, then re-plot.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OUT = ROOT / "examples" / "out"
SUCCESS = 0.02  # examples/kool_toy.py SUCCESS: a run is solved when its final MSE is below this
ESTIMATOR_ORDER = (
    "sample",
    "sample_skip",
    "sample_skip_iw",
    "gumbel_matching",
    "gumbel_matching_iw",
    "gumbel_matching_sh",
)


def doc_table(doc: Path, first_header: str) -> list[dict[str, str]]:
    """The markdown table of `doc` whose header row starts with `| first_header |`, as dicts."""
    lines = Path(doc).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |")), None)
    if start is None:
        raise ValueError(f"first_header: no table starting with '| {first_header} |' in {doc}")
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[start:]]
    rows = []
    for row in cells[2:]:
        if len(row) != len(cells[0]) or not lines[start + 2 + len(rows)].startswith("|"):
            break
        rows.append(dict(zip(cells[0], row)))
    return rows


def kool_grids(paths: list[Path]) -> dict[tuple, dict[tuple, tuple[int, int, float]]]:
    """{(loss, sinkhorn, steps): {(estimator, tau): (solved, seeds, median final MSE)}}, the last
    line of each seed winning, as examples/kool_toy.py --summarize counts them."""
    runs: dict[tuple, dict[int, float]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            runs.setdefault((r["loss"], r["sinkhorn"], r["steps"], r["estimator"], r["tau"]), {})[r["seed"]] = r["mse"]
    grids: dict[tuple, dict] = {}
    for (loss, sink, steps, name, tau), by_seed in runs.items():
        mses = sorted(by_seed.values())
        median = (mses[(len(mses) - 1) // 2] + mses[len(mses) // 2]) / 2
        grids.setdefault((loss, sink, steps), {})[(name, tau)] = (sum(m < SUCCESS for m in mses), len(mses), median)
    return grids


def draw_kool_toy():
    grids = kool_grids([OUT / "reinforce.jsonl", OUT / "gating.jsonl"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), squeeze=False)
    for ax, ((loss, sink, steps), grid) in zip(
        axes.flat, sorted(grids.items(), key=lambda kv: (kv[0][0] != "reinforce", kv[0][1]))
    ):
        names = sorted({n for n, _ in grid}, key=lambda n: ESTIMATOR_ORDER.index(n) if n in ESTIMATOR_ORDER else 99)
        taus = sorted({t for _, t in grid})
        share = [[grid[(n, t)][0] / grid[(n, t)][1] if (n, t) in grid else float("nan") for t in taus] for n in names]
        image = ax.imshow(share, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, n in enumerate(names):
            for j, t in enumerate(taus):
                if (n, t) in grid:
                    solved, seeds, median = grid[(n, t)]
                    ax.text(
                        j,
                        i,
                        f"{solved}/{seeds}\n({median:.3f})",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black" if solved / seeds > 0.5 else "white",
                    )
        ax.set_xticks(range(len(taus)), [f"{t:g}" for t in taus], fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_xlabel("tau", fontsize=8)
        ax.set_title(f"{loss}, {'Sinkhorn' if sink else 'plain'} proposals, {steps} steps", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.6, label=f"share of seeds solved (final MSE < {SUCCESS})")
    fig.suptitle(
        "Kool et al. toy (Figure 2b: reinforce, 2c: gating): solved/seeds (median final MSE)\n"
        "examples/out/reinforce.jsonl, gating.jsonl: every run, 10 seeds per cell",
        fontsize=10,
    )
    return fig


def _bars(ax, labels, series: dict[str, list[float]], ylabel: str):
    width = 0.8 / len(series)
    for s, (name, values) in enumerate(series.items()):
        xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=6)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, frameon=False)


def draw_noisy_topk():
    rows = doc_table(DOCS / "noisy_topk.md", "w_importance")
    labels = [f"w_imp={r['w_importance']}\nw_load={r['w_load']}" for r in rows]
    column = lambda name: [float(r[name]) for r in rows]  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    _bars(
        axes[0],
        labels,
        {"CV(Importance(X))": column("CV(Importance(X))"), "CV(Load(X))": column("CV(Load(X))")},
        "coefficient of variation",
    )
    _bars(
        axes[1],
        labels,
        {"max/mean Load(X)": column("max/mean Load(X)"), "max/mean counted load": column("max/mean counted load")},
        "max / mean",
    )
    axes[1].set_ylim(bottom=1)
    _bars(axes[2], labels, {"test loss (MSE)": column("test loss (MSE)")}, "test MSE")
    fig.suptitle(
        "Shazeer et al. Table 6 at a small size: every balance loss lowers both CVs; w_load >= 0.1 has the least "
        "overloaded expert\ndocs/noisy_topk.md's table (examples/shazeer_balance.py, mean of held-out seeds 100-102)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def draw_batchwise():
    rows = doc_table(DOCS / "batchwise.md", "seed")
    labels = [f"seed {r['seed']}" if r["seed"] != "mean" else "mean" for r in rows]
    column = lambda name: [float(r[name]) for r in rows]  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    _bars(
        axes[0],
        labels,
        {"agreement": column("agreement"), "jaccard": column("jaccard")},
        "threshold mask vs batchwise mask",
    )
    axes[0].set_ylim(0.8, 1.03)
    axes[0].legend(fontsize=7, frameon=False, ncol=2, loc="upper center")
    _bars(axes[1], labels, {"max_load (thresholds)": column("max_load")}, "largest expert load / mean")
    axes[1].axhline(1.0, color="black", linewidth=1, linestyle="--", label="batchwise mask: exactly 1")
    axes[1].legend(fontsize=7, frameon=False)
    axes[1].set_ylim(bottom=0.9)
    _bars(axes[2], labels, {"over_k": column("over_k"), "none": column("none")}, "share of tokens")
    fig.suptitle(
        "Learned thresholds reproduce the batchwise mask on held-out batches\n"
        "docs/batchwise.md's table (examples/batchwise_thresholds.py --tune, held-out seeds 0-2)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    return fig


def draw_dselect_k():
    rows = doc_table(DOCS / "dselect_k.md", "gate")
    seeds_column = next(k for k in rows[0] if k.startswith("true experts recovered"))
    seeds = seeds_column.rsplit("seeds", 1)[1].split("/")
    labels = [f"seed {s.strip()}" for s in seeds]
    series = {r["gate"]: [float(v) for v in r[seeds_column].split("/")] for r in rows}
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    _bars(ax, labels, series, "true experts among the 4 selected")
    ax.set_ylim(0, 4.4)
    fig.suptitle(
        "DSelect-k recovery (Appendix C.2.2), reduced run: not reproduced (Top-k recovers more)\n"
        "docs/dselect_k.md's table (examples/dselect_recovery.py --epochs 10, held-out seeds 10-12)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.85))
    return fig


FIGURES = {
    "kool_toy": draw_kool_toy,
    "noisy_topk": draw_noisy_topk,
    "batchwise": draw_batchwise,
    "dselect_k": draw_dselect_k,
}


def save(name: str, out_dir: Path = DOCS / "img") -> Path:
    if name not in FIGURES:
        raise ValueError(f"name: {name!r} is not one of {list(FIGURES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    fig = FIGURES[name]()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    for name in sys.argv[1:] or FIGURES:
        print(save(name))
