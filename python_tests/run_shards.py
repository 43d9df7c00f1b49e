"""Runs one pytest pass as n processes, each a shard of the tests (MOE_KERNELS_TEST_SHARD=i/n,
python_tests/conftest.py), each with one intra-op thread; prints each shard's output when it ends
and exits non-zero if any shard failed. The Makefile's interpreter pass runs this way: the Triton
interpreter is single-threaded Python, so a 2-core machine runs two shards in about half the time.

    python python_tests/run_shards.py N -- python -m pytest python_tests -m triton ...
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    n = max(1, int(argv[0]))
    command = argv[2:]
    logs, procs = [], []
    start = time.monotonic()
    for i in range(n):
        env = dict(os.environ, MOE_KERNELS_TEST_SHARD=f"{i}/{n}", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    print(f"{n} shard(s) of: {' '.join(command)}", flush=True)
    failed = []
    for i, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        rc = proc.wait()
        log.seek(0)
        print(f"\n===== shard {i}/{n}: exit {rc} after {time.monotonic() - start:.0f} s =====", flush=True)
        sys.stdout.write(log.read())
        sys.stdout.flush()
        if rc != 0:
            failed.append(i)
    if failed:
        print(f"\nshards {failed} of {n} failed", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
