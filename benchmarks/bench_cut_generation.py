"""What prompt pruning's cut costs in generation on the real model (issue 42): GRPO's one generation call (P prompts
x G completions) against the cut with the probe (two calls: the probe, P x k; then the rest of the accepted groups,
m x (G - k)) and the cut by history (one call, m x G), timed in turn, call for call, on the same trainer and
prompts, so that a change of load falls on all three (SmolLM2-135M-Instruct + LoRA, reasoning-gym chain_sum, TRL's
own ``_generate``). With ``--vllm``: vLLM colocated (prefix caching on, its default), in the vLLM lane's venv.

    python benchmarks/bench_cut_generation.py --reps 12
    MASTER_PORT=29650 .venv-vllm/bin/python benchmarks/bench_cut_generation.py --vllm --reps 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import mean_se, reasoning_gym_setup, result_path, write_json  # noqa: E402


def build_trainer(vllm: bool, prompts_per_step: int, group: int, max_completion_length: int):
    from dppo_trl import DPPOConfig, DPPOTrainer

    setup = reasoning_gym_setup(task="chain_sum", answer_format="last_number", task_seed=0, train_prompts=256,
                                heldout=1, eval_every=1, steps=1, prompts_per_step=prompts_per_step,
                                max_completion_length=max_completion_length, learning_rate=2e-4, vllm=vllm)
    args = DPPOConfig(output_dir=tempfile.mkdtemp(prefix="dppo-bench-"), report_to=[], save_strategy="no",
                      gradient_checkpointing=False, disable_tqdm=True, max_steps=1, seed=0,
                      prompt_keep_rate=0.5, **setup["trainer_args"])
    assert args.num_generations == group
    trainer = DPPOTrainer(setup["model_dir"], setup["reward_funcs"], args=args, train_dataset=setup["train_dataset"],
                          **setup["trainer_kwargs"])
    trainer.model.train()
    return trainer, setup["train_dataset"]


def timed_generation(trainer, prompts: list, group: int) -> float:
    """Seconds of TRL's ``_generate`` on ``prompts`` (each repeated ``group`` times consecutively)."""
    rows = [p for p in prompts for _ in range(group)]
    with trainer._generating_groups_of(group):
        start = time.perf_counter()
        trainer._generate(rows)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--reps", type=int, default=12, help="pairs of steps timed, GRPO and the cut in turn")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts-per-step", type=int, default=4, help="P, the step's candidates")
    parser.add_argument("--accepted", type=int, default=2, help="m, the accepted candidates")
    parser.add_argument("--probe", type=int, default=2, help="k, the probe's completions of each candidate")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    group = 8
    started = time.perf_counter()
    trainer, dataset = build_trainer(args.vllm, args.prompts_per_step, group, args.max_completion_length)
    p, m, k = args.prompts_per_step, args.accepted, args.probe
    times = {"grpo": [], "dppo+cut": [], "dppo+cut-calibrated": [], "probe": []}
    for rep in range(args.warmup + args.reps):
        prompts = [dataset[(rep * p + j) % len(dataset)]["prompt"] for j in range(p)]

        def with_probe():
            first = timed_generation(trainer, prompts, k)
            return {"probe": first, "dppo+cut": first + timed_generation(trainer, prompts[:m], group - k)}

        calls = [lambda: {"grpo": timed_generation(trainer, prompts, group)}, with_probe,
                 lambda: {"dppo+cut-calibrated": timed_generation(trainer, prompts[:m], group)}]
        measured = {}
        for i in range(3):  # rotate which goes first
            measured.update(calls[(rep + i) % 3]())
        if rep >= args.warmup:
            for name, seconds in measured.items():
                times[name].append(seconds)
    engine = "vLLM colocated" if args.vllm else "transformers"
    completions = {"dppo+cut": (p * k + m * (group - k)) / (p * group), "dppo+cut-calibrated": m / p}
    ratios = {}
    for method in completions:
        ratio, se = mean_se([c / g for c, g in zip(times[method], times["grpo"])])
        ratios[method] = {"ratio_mean": ratio, "ratio_se": se, "completions_ratio": completions[method]}
        print(f"{engine}, {method}: {statistics.mean(times[method]):.2f} s against GRPO's "
              f"{statistics.mean(times['grpo']):.2f} s: {ratio:.3f} ± {se:.3f} of GRPO's generation per step, for "
              f"{completions[method]:.3f} of its completions")
    path = args.json or result_path("bench_cut_generation" + ("_vllm" if args.vllm else ""))
    out = write_json(path, {
        "config": {k_: v for k_, v in vars(args).items() if k_ != "json"} | {"group": group, "engine": engine},
        "seconds": times, "ratios": ratios, "elapsed_s": time.perf_counter() - started,
    })
    print(f"wrote {out}")
    os._exit(0)  # vLLM's engine threads would hold the exit


if __name__ == "__main__":
    main()
