#!/bin/sh
# Extension beyond the tau grid of docs/kool_toy.md: differentiable gating at low temperatures,
# where the paper reports it succeeds (Section 3.1, Appendix E). Two chains, nice 19.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD
run() { nice -n 19 .venv/bin/python examples/kool_toy.py --loss gating --taus 0.05 0.1 0.25 --out examples/out/gating.jsonl "$@"; }
( run --estimators sample_skip_iw gumbel_matching_iw gumbel_matching_sh; run --sinkhorn --estimators sample_skip_iw ) > examples/out/low1.log 2>&1 &
( run --estimators sample sample_skip gumbel_matching; run --sinkhorn --estimators sample sample_skip ) > examples/out/low2.log 2>&1 &
wait
