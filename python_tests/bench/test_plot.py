"""bench/plot.py on tiny synthetic results CSVs (the rows moe_kernels/bench/output.py `report` writes): the
axis it picks, the latest row per (provider, mode, config), the limit line, the PNG and the index."""

import csv
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["op", "provider", "mode", "config", "median_ms", "p20_ms", "p80_ms", "gb_per_s", "machine", "commit"]


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "bench" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path, rows):
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for provider, mode, config, ms in rows:
            writer.writerow(
                dict(
                    op="x",
                    provider=provider,
                    mode=mode,
                    config=config,
                    median_ms=ms,
                    p20_ms=ms,
                    p80_ms=ms,
                    gb_per_s="",
                    machine="test box",
                    commit="abc1234",
                )
            )
    return path


def synthetic(tmp_path):
    rows = []
    for T in (1024, 4096, 16384):
        for E in (8, 64):
            config = f"T={T} E={E} C={T * 2 // E}"  # C is fixed by T and E: no line of its own
            rows += [
                ("moe_kernels", "forward", config, T / 1000),
                ("torch sequence", "forward", config, T / 100),
                ("read pass", "forward", config, T / 4000),
                ("moe_kernels", "fwd+bwd", config, T / 500),
            ]
    rows.insert(0, ("moe_kernels", "forward", "T=1024 E=8 C=256", 999.0))  # an older run: replaced
    return write(tmp_path / "x.csv", rows)


def test_layout_picks_the_size_and_drops_derived_keys(plot):
    configs = [{"T": str(T), "E": str(E), "C": str(T * 2 // E)} for T in (1024, 4096, 16384) for E in (8, 64)]
    assert plot.layout(configs) == ("T", "E", [])
    configs = [{"family": f, "k": "2"} for f in ("mixtral", "qwen3_moe")]
    assert plot.layout(configs) == (None, None, [])  # no swept size: bars


def test_latest_row_wins(plot, tmp_path):
    rows = plot.latest_rows(synthetic(tmp_path))
    first = [
        r for r in rows if (r["provider"], r["mode"], r["config"]) == ("moe_kernels", "forward", "T=1024 E=8 C=256")
    ]
    assert len(first) == 1 and float(first[0]["median_ms"]) == pytest.approx(1.024)


def test_plot_draws_modes_providers_and_the_limit_line(plot, tmp_path):
    fig = plot.figure(synthetic(tmp_path))
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["forward", "fwd+bwd"]
    assert axes[0].get_yscale() == "log" and axes[0].get_xlabel() == ""
    forward = axes[0].get_lines()
    assert len(forward) == 3 * 2  # three providers x two E line styles
    limit = [line for line in forward if line.get_color() == "black"]
    assert len(limit) == 2
    assert sorted(limit[0].get_ydata()) == pytest.approx([1024 / 4000, 4096 / 4000, 16384 / 4000])
    assert len(axes[1].get_lines()) == 2  # fwd+bwd: moe_kernels only


def test_plot_writes_a_png_and_the_index(plot, tmp_path):
    png = plot.plot_csv(synthetic(tmp_path))
    assert png == tmp_path / "x.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "x.md").write_text("# x\n\nCommand: `python bench/bench_x.py`  \n")
    index = plot.write_index(tmp_path).read_text()
    assert "| x | [x.md](x.md) | [x.png](x.png) | `python bench/bench_x.py` |" in index


def test_bars_without_a_swept_size(plot, tmp_path):
    path = write(tmp_path / "y.csv", [(p, "forward", f"family={f} k=2", 1.0) for p in ("a", "b") for f in ("m", "q")])
    fig = plot.figure(path)
    (ax,) = fig.axes
    assert len(ax.patches) == 4 and ax.get_yscale() == "linear"


def test_empty_csv_is_an_error(plot, tmp_path):
    with pytest.raises(ValueError, match="csv_path"):
        plot.figure(write(tmp_path / "z.csv", []))
