"""Learning per generation with reuse (issue 49): TRL's ``num_iterations`` (GRPO's ``mu``) trains each generation
batch ``mu`` times. GRPO pays its training phase ``mu`` times a generation, DPPO 0.09 of it. On the real-model task
(SmolLM2-135M-Instruct + LoRA, reasoning-gym ``chain_sum``, TRL's defaults, ``bench_real``'s protocol), each method
runs for the same number of generation batches and is evaluated on the held-out set at the same generation counts.

Methods: ``grpo`` at ``mu`` 1, 2, 4 (TRL's own trainer), ``dppo`` at 1, 2, 4, 8 (keep 0.5, its defaults), and
``grpo@2lr``, GRPO at ``mu = 1`` with twice the learning rate (so a reader can tell reuse from a larger step);
every other row keeps the benchmark's learning rate.

Learning per generation does not depend on the machine: seeds run side by side, one thread each, a seed's methods
one after the other, each seed's per-step records under ``benchmarks/results/reuse/`` (a run already recorded is not
run again: later sessions add seeds). The ``mu = 1`` rows read bench_real's learning records
(``benchmarks/results/learning/real_seed*_runs.json``, the same protocol) where they hold the seed.

    python benchmarks/bench_reuse.py run --seeds 0 --methods grpo@mu2 dppo@mu4    # one seed's runs, recorded
    python benchmarks/bench_reuse.py run --seeds 0 --vllm                            # vLLM generating (its venv)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import read_json, reasoning_gym_setup, run_methods, write_json  # noqa: E402
from harness.training import GRPO_TRAINER, generation_progress  # noqa: E402

LEARNING_RATE = 2e-4  # bench_real's
DPPO = dict(completion_keep_rate=0.5)
# Each method: its num_iterations and DPPOConfig settings (None: TRL's GRPOTrainer; {"trainer": "grpo", ...}: TRL's
# GRPOTrainer with these GRPOConfig fields).
METHODS = {
    "grpo": None,
    "grpo@mu2": {"trainer": GRPO_TRAINER, "num_iterations": 2},
    "grpo@mu4": {"trainer": GRPO_TRAINER, "num_iterations": 4},
    "grpo@2lr": {"trainer": GRPO_TRAINER, "learning_rate": 2 * LEARNING_RATE},
    "dppo": DPPO,
    "dppo@mu2": {**DPPO, "num_iterations": 2},
    "dppo@mu4": {**DPPO, "num_iterations": 4},
    "dppo@mu8": {**DPPO, "num_iterations": 8},
}
RECORDS = Path("benchmarks/results/reuse")
LEARNING_RECORDS = Path("benchmarks/results/learning")  # bench_real's, for the mu = 1 rows


def iterations_of(method: str) -> int:
    return (METHODS[method] or {}).get("num_iterations", 1)


def setup_of(args) -> dict:
    """bench_real's setup, with ``steps`` counting generation batches and the held-out score every
    ``--eval-every`` generation batches."""
    setup = reasoning_gym_setup(
        task="chain_sum", answer_format="last_number", task_seed=0, train_prompts=32, heldout=128,
        eval_every=args.eval_every, steps=args.generations, prompts_per_step=4, max_completion_length=16,
        learning_rate=LEARNING_RATE, vllm=args.vllm, generations=8,
    )
    setup["progress"] = generation_progress
    return setup


def records_path(seed: int, vllm: bool) -> Path:
    return RECORDS / f"reuse{'_vllm' if vllm else ''}_seed{seed}_runs.json"


def run(args) -> None:
    torch.set_num_threads(args.threads)
    setup = setup_of(args)
    RECORDS.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        path = records_path(seed, args.vllm)
        started = time.perf_counter()
        saved = read_json(path) if path.exists() else None
        if saved is not None and saved["trainer_args"] != setup["trainer_args"]:
            raise SystemExit(f"{path}: recorded with other trainer settings; move it away to run afresh")
        done = saved["runs"] if saved else []
        elapsed = saved["elapsed_s"] if saved else 0.0

        def save(runs):
            write_json(path, {"runs": runs, "trainer_args": setup["trainer_args"],
                              "elapsed_s": elapsed + time.perf_counter() - started}, compact=True)

        run_methods({name: METHODS[name] for name in args.methods}, [seed], setup, runs=done, started=started,
                    after_run=save, label="reuse ")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", help="train and record the runs of each seed (those recorded are kept)")
    runner.add_argument("--seeds", nargs="+", type=int, required=True)
    runner.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in ("grpo", "dppo")],
                        choices=list(METHODS))
    runner.add_argument("--generations", type=int, default=40, help="generation batches of every method")
    runner.add_argument("--eval-every", type=int, default=4, help="generation batches between held-out scores")
    runner.add_argument("--threads", type=int, default=1)
    runner.add_argument("--vllm", action="store_true", help="generate with vLLM colocated (the vLLM lane's venv)")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)


if __name__ == "__main__":
    main()
