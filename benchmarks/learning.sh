#!/usr/bin/env bash
# Learning per step on the real model (issue 31): bench_real's seeds two side by side, one torch thread each (the
# steps to the target do not depend on the machine), each seed's per-step records kept under
# benchmarks/results/learning/ (a seed already recorded is not run again), then one summary over every recorded
# seed with the projection from the paired per-phase runs (make bench-real-phases).
#
#   bash benchmarks/learning.sh 0 1 2 3 4 5    # TRL's defaults (dapo): GRPO, DPPO, DPPO + prompt pruning (both scores)
#   VARIANT=gspo METHODS="grpo dppo" bash benchmarks/learning.sh 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VARIANT=${VARIANT:-dapo}
METHODS=${METHODS:-grpo dppo dppo+prompt dppo+calibrated}
DIR=benchmarks/results/learning
mkdir -p "$DIR"
tag=$([ "$VARIANT" = dapo ] && echo real || echo "real_$VARIANT")
run_seed() {
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 "$PY" benchmarks/bench_real.py --seeds "$1" --threads 1 --eval-every 4 --resume \
        --variant "$VARIANT" --methods $METHODS --json "$DIR/${tag}_seed$1.json" > "$DIR/${tag}_seed$1.log" 2>&1
}
seeds=("$@")
for ((i = 0; i < ${#seeds[@]}; i += 2)); do
    run_seed "${seeds[i]}" &
    if ((i + 1 < ${#seeds[@]})); then run_seed "${seeds[i + 1]}" & fi
    wait
done
phases=benchmarks/results/bench_real_phases_$VARIANT.json
HF_HUB_OFFLINE=1 "$PY" benchmarks/bench_real.py --from-runs "$DIR/${tag}"_seed*_runs.json --variant "$VARIANT" \
    --methods $METHODS --eval-every 4 $([ -f "$phases" ] && echo --phases-of "$phases") \
    --json "benchmarks/results/bench_${tag}_learning.json" --plots docs/images
