#!/bin/sh
# The full grid of docs/kool_toy.md: two chains, one process each, under nice 19.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD
PY=/work/main/.venv/bin/python
(
  nice -n 19 $PY examples/kool_toy.py --loss reinforce --out examples/out/reinforce.jsonl
  nice -n 19 $PY examples/kool_toy.py --loss reinforce --sinkhorn --estimators sample sample_skip sample_skip_iw --out examples/out/reinforce.jsonl
) > examples/out/reinforce.log 2>&1 &
(
  nice -n 19 $PY examples/kool_toy.py --loss gating --out examples/out/gating.jsonl
  nice -n 19 $PY examples/kool_toy.py --loss gating --sinkhorn --estimators sample sample_skip sample_skip_iw --out examples/out/gating.jsonl
) > examples/out/gating.log 2>&1 &
wait
