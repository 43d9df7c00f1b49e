"""`make bench`: run every bench/bench_*.py in turn; results go to bench/results/."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    extra = sys.argv[1:]
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script), *extra]).returncode != 0:
            failed.append(script.name)
    if failed:
        sys.exit(f"failed: {failed}")
