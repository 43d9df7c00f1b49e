#!/bin/sh
# The full grid of docs/kool_toy.md as two chains of one process each, under nice 19, in priority
# order (REINFORCE without Sinkhorn first, then gating, then the Sinkhorn-proposal variants). The
# chains run disjoint (loss, estimator) sets and append to the same results files; a restarted
# command skips the runs already in its --out file.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD
run() { nice -n 19 .venv/bin/python examples/kool_toy.py "$@"; }
R="--loss reinforce --out examples/out/reinforce.jsonl"
G="--loss gating --out examples/out/gating.jsonl"
(
  run $R --estimators sample sample_skip sample_skip_iw gumbel_matching
  run $G --estimators gumbel_matching_iw gumbel_matching_sh
  run $R --sinkhorn --estimators sample_skip_iw sample
  run $G --sinkhorn --estimators sample_skip_iw
) > examples/out/chain1.log 2>&1 &
(
  run $R --estimators gumbel_matching_iw gumbel_matching_sh
  run $G --estimators sample sample_skip sample_skip_iw gumbel_matching
  run $R --sinkhorn --estimators sample_skip
  run $G --sinkhorn --estimators sample sample_skip
) > examples/out/chain2.log 2>&1 &
wait
