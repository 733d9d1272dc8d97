#!/usr/bin/env bash
# Learning per step on the real model (issue 31): bench_real's seeds side by side, one torch thread each, a seed's
# methods one after the other (--one-after-the-other: the steps to the target do not depend on the machine; the
# summary labels its time figures so, and the projection takes the time per step from paired runs taken in turns),
# each seed's per-step records kept under
# benchmarks/results/learning/ (a seed already recorded is not run again), then one summary over every recorded
# seed with the projection from paired per-phase runs: for TRL's default loss, make bench-prefix's (prefix sharing on,
# the default), for the other losses make bench-real-phases' (recorded before it).
#
#   bash benchmarks/learning.sh 0 1 2 3 4 5    # TRL's defaults (dapo): GRPO, DPPO, prompt pruning's retired fill mode
#                                              # (both scores) and its cut (the probe, the calibrated history)
#   VARIANT=gspo METHODS="grpo dppo" bash benchmarks/learning.sh 0 1 2
#   ENGINE=vllm bash benchmarks/learning.sh 0 1 2 3 4 5    # vLLM generating, colocated (the vLLM lane's venv)
#   PARALLEL=1 bash benchmarks/learning.sh 4 5             # seeds one at a time (default: 2, with vLLM 1)
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${VARIANT:-dapo}
ENGINE=${ENGINE:-transformers}
DIR=benchmarks/results/learning
mkdir -p "$DIR"
case "$ENGINE" in
    transformers)
        PY=${PYTHON:-.venv/bin/python}
        METHODS=${METHODS:-grpo dppo dppo+prompt dppo+calibrated dppo+cut dppo+cut-calibrated}
        PARALLEL=${PARALLEL:-2} engine_flag=() engine_tag="" ;;
    vllm)
        PY=${PYTHON:-.venv-vllm/bin/python}
        METHODS=${METHODS:-grpo dppo dppo+calibrated dppo+cut}  # the ema score's 6 transformers seeds settled it
        # A colocated engine's run holds 10-12 GiB: two do not fit in 24 GiB. One run with glibc's large blocks
        # returned at free (MALLOC_MMAP_THRESHOLD_=131072) holds 5-10 GiB and fits beside one without, at 1.6x
        # the time per step (2026-12-05, seeds 2-5).
        PARALLEL=${PARALLEL:-1} engine_flag=(--vllm) engine_tag=_vllm ;;
    *) echo "ENGINE must be transformers or vllm, not '$ENGINE'" >&2; exit 2 ;;
esac
tag=real$engine_tag$([ "$VARIANT" = dapo ] || echo "_$VARIANT")
if [ "$VARIANT" = dapo ]; then phases=benchmarks/results/bench_real_prefix$engine_tag.json
else phases=benchmarks/results/bench_real_phases${engine_tag}_$VARIANT.json; fi
generation=benchmarks/results/bench_cut_generation$engine_tag.json  # the cut's generation, timed call for call
run_seed() {  # a port of its own: colocated vLLM and the CPU process group would both take 29500
    MASTER_PORT=$((29600 + $1)) HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 "$PY" benchmarks/bench_real.py --seeds "$1" \
        --threads 1 --eval-every 4 --resume --one-after-the-other "${engine_flag[@]}" --variant "$VARIANT" --methods $METHODS \
        --json "$DIR/${tag}_seed$1.json" > "$DIR/${tag}_seed$1.log" 2>&1
}
seeds=("$@")
for ((i = 0; i < ${#seeds[@]}; i += PARALLEL)); do  # PARALLEL seeds side by side, one thread each
    for seed in "${seeds[@]:i:PARALLEL}"; do run_seed "$seed" & done
    wait
done
HF_HUB_OFFLINE=1 "$PY" benchmarks/bench_real.py --from-runs "$DIR/${tag}"_seed*_runs.json --variant "$VARIANT" \
    "${engine_flag[@]}" --methods $METHODS --eval-every 4 $([ -f "$phases" ] && echo --phases-of "$phases") \
    $([ -f "$generation" ] && echo --generation-of "$generation") \
    --json "benchmarks/results/bench_${tag}_learning.json" --plots docs/images
