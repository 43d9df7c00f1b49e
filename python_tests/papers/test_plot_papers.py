"""examples/plot_papers.py: every paper figure draws from its committed input (the results files in
examples/out/ and the docs' own tables), and the Kool et al. heat map counts what the doc reports."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def papers():
    spec = importlib.util.spec_from_file_location("plot_papers", ROOT / "examples" / "plot_papers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["kool_toy", "noisy_topk", "batchwise", "dselect_k"])
def test_figure_draws_from_its_committed_input(papers, name, tmp_path):
    path = papers.save(name, tmp_path)
    assert path == tmp_path / f"{name}.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kool_grid_matches_the_docs_table(papers):
    grids = papers.kool_grids([ROOT / "examples/out/reinforce.jsonl", ROOT / "examples/out/gating.jsonl"])
    grid = grids[("reinforce", False, 10000)]
    table = papers.doc_table(ROOT / "docs/kool_toy.md", "estimator")  # the first grid: reinforce, plain
    assert [r["estimator"] for r in table] == sorted({n for n, _ in grid}, key=papers.ESTIMATOR_ORDER.index)
    for row in table:
        for column, cell in row.items():
            if column.startswith("tau = "):
                solved, seeds, median = grid[(row["estimator"], float(column.removeprefix("tau = ")))]
                assert cell == f"{solved}/{seeds} ({median:.3f})"


def test_noisy_topk_bars_are_the_docs_numbers(papers):
    rows = papers.doc_table(ROOT / "docs/noisy_topk.md", "w_importance")
    assert len(rows) == 6
    fig = papers.draw_noisy_topk()
    heights = [p.get_height() for p in fig.axes[2].patches]
    assert heights == [float(r["test loss (MSE)"]) for r in rows]


def test_doc_table_names_a_missing_header(papers, tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("| a | b |\n|---|---|\n| 1 | 2 |\n\ntext\n")
    assert papers.doc_table(doc, "a") == [{"a": "1", "b": "2"}]
    with pytest.raises(ValueError, match="first_header"):
        papers.doc_table(doc, "c")
    with pytest.raises(ValueError, match="name"):
        papers.save("nope", tmp_path)
