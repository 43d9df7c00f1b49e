"""Plot bench/results/<op>.csv as bench/results/<op>.png and index the results in
bench/results/README.md (the code: moe_kernels/bench/plot.py).

    .venv/bin/python bench/plot.py [bench/results/<op>.csv ...]   # default: every CSV there
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moe_kernels.bench.plot import figure, latest_rows, layout, parse_config, plot_csv, write_index  # noqa: F401

RESULTS = Path(os.environ.get("MOE_KERNELS_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def main(argv: list[str]) -> None:
    # gpu-<device>.csv (make gpu-check) has its own columns and its table in gpu-<device>.md: no plot.
    paths = [Path(a) for a in argv] or sorted(p for p in RESULTS.glob("*.csv") if not p.name.startswith("gpu-"))
    for path in paths:
        print(f"plot: {plot_csv(path)}")
    print(f"index: {write_index(paths[0].parent if argv else RESULTS)}")


if __name__ == "__main__":
    main(sys.argv[1:])
