"""The transformers benchmark (moe_kernels/bench/transformers.py: what it measures and against what) with bench/'s
flags (--help), its results in bench/results/.

    .venv/bin/python bench/bench_transformers.py [--quick]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import main  # noqa: E402

from moe_kernels.bench import transformers  # noqa: E402

if __name__ == "__main__":
    main(transformers)
