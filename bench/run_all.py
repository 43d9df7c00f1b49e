"""`make bench`: run every bench/bench_*.py in turn (a progress bar over them: the whole run takes
minutes), plot each CSV a bench wrote (bench/plot.py), then rewrite bench/results/README.md.
Arguments are passed to every bench (e.g. --quick)."""

import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS  # noqa: E402
from plot import plot_csv, write_index  # noqa: E402

from moe_kernels.bench.output import csv_stamps  # noqa: E402

if __name__ == "__main__":
    extra = sys.argv[1:]
    failed = []
    scripts = sorted(HERE.glob("bench_*.py"))
    bar = tqdm(scripts, desc="make bench", unit="bench", file=sys.stderr)
    for script in bar:
        bar.set_postfix_str(script.name)
        tqdm.write(f"== {script.name}", file=sys.stdout)
        sys.stdout.flush()
        before = csv_stamps(RESULTS)
        if subprocess.run([sys.executable, str(script), *extra]).returncode != 0:
            failed.append(script.name)
        # The CSVs this bench appended to (bench_transformers with --quick writes *_quick.csv).
        for path, stamp in csv_stamps(RESULTS).items():
            if before.get(path) != stamp:
                tqdm.write(f"plot: {plot_csv(path)}", file=sys.stdout)
    bar.close()
    write_index(RESULTS)
    if failed:
        sys.exit(f"failed: {failed}")
