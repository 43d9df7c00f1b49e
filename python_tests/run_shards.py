"""Runs one pytest pass as n processes that share its tests out as they go: each collects them
all and runs the next one no process has claimed (MOE_KERNELS_TEST_CLAIMS, conftest's
pytest_runtestloop), with one intra-op thread. Prints each process's output when it ends; exits
non-zero if any failed, or if between them they did not run every collected test once. The
Makefile's interpreter pass runs this way: the Triton interpreter is single-threaded Python, so
a 2-core machine runs two processes in about half the time. (Not the first pass: on its own its
user and system time is about 1.1 times its wall time on 2 cores, yet two processes, each with
torch's threads, took 849 s where one took 893, and 768 s where one took 802 before.)

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
    claims = tempfile.TemporaryDirectory(prefix="moe_kernels_claims_")
    for i in range(n):
        env = dict(
            os.environ,
            MOE_KERNELS_TEST_SHARD=f"{i}/{n}",
            MOE_KERNELS_TEST_CLAIMS=claims.name,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
        )
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
    return check_claims(claims.name)


def check_claims(claims_dir: str) -> int:
    """0 where the processes collected the same tests (one `collected-<hash>` file) and claimed
    each of them (files 0 .. count - 1); else 1, saying what differs. A process that ran no
    pytest (a plain command) leaves neither: nothing to check."""
    names = os.listdir(claims_dir)
    collected = [name for name in names if name.startswith("collected-")]
    if not collected:
        return 0
    if len(collected) != 1:
        print(f"\nthe processes collected {len(collected)} different lists of tests: some may have run twice, some not")
        return 1
    with open(os.path.join(claims_dir, collected[0])) as f:
        count = int(f.read())
    claimed = {int(name) for name in names if name.isdigit()}
    if claimed != set(range(count)):
        print(f"\n{count - len(claimed & set(range(count)))} of {count} collected tests were not run")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
