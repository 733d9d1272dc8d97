"""End-to-end benchmark: GRPO (TRL's trainer), DPPO, DPPO with prompt pruning, and the biased baselines
`topk` (CPPO's rule) and `zero_variance` (DAPO-style filter), trained with the same data budget on the
offline toy task of `make demo-tiny` (warm-started tiny Qwen2, two-digit addition, exact-answer reward).

Per step it records the wall time split into generation / scoring and log-prob passes / loss forward+backward
(+ optimizer), the tokens generated and trained, and the sampled reward; it evaluates greedy held-out accuracy
at fixed steps (outside the clock). It prints a table of ratios to GRPO measured in the same run, the time to
reach GRPO's final reward, the final held-out accuracy with its spread over seeds, and writes JSON (and PNG
plots with ``--plots``). Single-threaded torch. Every method of a seed (those of the sweeps too) takes turns with
the others, one optimizer step at a time, each in a process of its own after its own warm-up run
(``harness.interleave``): a load that changes falls alike on all, so their ratios to GRPO hold.

    make bench                                   # main comparison + keep-rate sweeps, plots in docs/images
    python benchmarks/bench_e2e.py --seeds 0 1 --steps 512 --sweeps --json out.json
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from harness import (  # noqa: E402
    TIMING_IN_TURNS,
    phase_shares,
    plot_runs,
    pm,
    print_table,
    read_json,
    result_path,
    reward_panels,
    run_methods,
    runs_path,
    summarize_at_budget,
    without_per_seed,
    write_json,
)
from harness import reward_curve, time_to, trailing_mean  # noqa: E402, F401  (the tests read them here)

# DPPOConfig settings of each method; None is TRL's own GRPOConfig + GRPOTrainer.
METHODS = {
    "grpo": None,
    "dppo": dict(completion_keep_rate=0.5),
    "dppo+prompt": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5, prompt_score="ema"),  # as recorded
    "topk": dict(prune_sampling="topk", completion_keep_rate=0.5),
    "zero_variance": dict(prune_sampling="zero_variance"),
}
# The sweeps that set the defaults: one knob at a time around the `dppo` method.
SWEEPS = {
    "completion_keep_rate": {f"keep={r}": dict(completion_keep_rate=r) for r in (1.0, 0.75, 0.5, 0.25)},
    "prompt_keep_rate": {  # prompt=1.0 is `dppo` itself (and reuses its runs)
        f"prompt={r}": dict(completion_keep_rate=0.5, **({"prompt_keep_rate": r} if r < 1 else {}))
        for r in (1.0, 0.75, 0.5, 0.25)
    },
}
COLUMNS = [
    ("method", -16, "method:"),
    ("steps", 6, "steps:.0f"),
    ("s/step", 8, "step_s:.3f"),
    ("total s", 9, "total_s:.1f"),
    ("total/GRPO", 11, "total_ratio:.3f"),
    ("train/GRPO", 11, "training_phase_ratio:.3f"),
    ("to target", 10, "time_to_target_ratio:.2f"),
    ("reached", 8, "reached_target:"),
    ("kept", 6, "kept_fraction:.2f"),
    ("reward", 8, "final_reward:.3f"),
    ("held-out acc", 16, lambda r: pm(r["accuracy_mean"], r["accuracy_std"])),
    ("gen/score/loss/other", 0, phase_shares),
]


def plot(runs, rows, window, directory, prefix):
    return plot_runs(runs, rows, reward_panels(window), directory, prefix,
                     "Where the time goes (same number of optimizer steps)")


def prepare_setup(args):
    from datasets import Dataset  # noqa: F401  (imported here so a missing extra fails before training)

    from dppo_trl.demo import prepare
    from dppo_trl.tasks.toy import addition_dataset, addition_pairs, exact_answer_reward, sampled_accuracy

    model_root = Path(args.model_cache)
    if not (model_root / "warm-start" / "config.json").exists():
        prepare(model_root, sft_steps=args.sft_steps)
    train_pairs, heldout_pairs = addition_pairs(seed=0)
    return {
        "model_dir": str(model_root / "warm-start"),
        "train_dataset": addition_dataset(train_pairs[: args.train_prompts]),
        "reward_funcs": exact_answer_reward,
        "evaluate": functools.partial(sampled_accuracy, pairs=heldout_pairs[: args.heldout], limit=args.heldout),
        "eval_every": args.eval_every,
        "steps": args.steps,
        "extension": math.ceil(args.steps * args.extension / args.eval_every) * args.eval_every,
        "trainer_args": dict(
            bf16=False,
            use_cpu=True,
            per_device_train_batch_size=args.batch_size,
            steps_per_generation=args.steps_per_generation,
            num_generations=8,
            max_completion_length=8,
            temperature=1.0,
            beta=args.beta,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
        ),
    }


def group_runs(runs, rows, seeds):
    names = [r["method"] for r in rows]
    return [r for r in runs if r["method"] in names and r["seed"] in seeds]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--sweeps", nargs="*", default=list(SWEEPS), choices=list(SWEEPS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--sweep-seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=768, help="the budget: optimizer steps of every method")
    parser.add_argument("--extension", type=float, default=0.25,
                        help="fraction of --steps the pruned methods go on for, only to see when they reach the "
                        "target; every other figure is read at --steps")
    parser.add_argument("--train-prompts", type=int, default=1024)
    parser.add_argument("--heldout", type=int, default=729, help="held-out pairs evaluated (greedy)")
    parser.add_argument("--eval-every", type=int, default=32, help="optimizer steps between evaluations")
    parser.add_argument("--batch-size", type=int, default=64, help="per_device_train_batch_size (completions)")
    parser.add_argument("--steps-per-generation", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--window", type=int, default=16, help="generation batches in the trailing reward mean")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--model-cache", default="outputs/bench-toy")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs of a few steps")
    parser.add_argument("--json", default=result_path("bench_e2e"))
    parser.add_argument("--plots", default=None, help="directory for PNG plots (e.g. docs/images)")
    parser.add_argument("--from-json", default=None, help="train nothing: print the tables and plot a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        return replot(args.from_json, args.plots)
    torch.set_num_threads(1)
    started = time.perf_counter()

    setup = prepare_setup(args)
    groups = {"methods": {m: METHODS[m] for m in args.methods}}
    for sweep in args.sweeps:
        groups[sweep] = {"grpo": None, **SWEEPS[sweep]}
    runs, tables = [], {}
    for seed in dict.fromkeys([*args.seeds, *args.sweep_seeds]):  # a seed's methods of every group, in turns
        methods = {name: settings for group, members in groups.items()
                   if seed in (args.seeds if group == "methods" else args.sweep_seeds)
                   for name, settings in members.items()}
        run_methods(methods, [seed], setup, runs, started, in_turns=True, threads=1, warmup=args.warmup)
    for group, methods in groups.items():
        seeds = args.seeds if group == "methods" else args.sweep_seeds
        names = ["grpo", *[m for m in methods if m != "grpo"]]
        mine = [r for r in runs if r["method"] in names and r["seed"] in seeds]
        tables[group] = summarize_at_budget(mine, names, args.window)
        print_table(tables[group], COLUMNS, f"{group} (seeds {seeds}, ratios to GRPO in the same run)")

    plots = []
    if args.plots:
        for group, rows in tables.items():
            seeds = args.seeds if group == "methods" else args.sweep_seeds
            plots += plot(group_runs(runs, rows, seeds), rows, args.window, args.plots, f"bench_{group}")
        print("plots: " + ", ".join(plots))
    out = Path(args.json)
    runs_file = write_json(runs_path(out), runs, compact=True)  # per-step records: large, not committed
    write_json(out, {
        "config": vars(args),
        "timing": TIMING_IN_TURNS,
        "trainer_args": setup["trainer_args"],
        "elapsed_s": time.perf_counter() - started,
        "summary": {group: without_per_seed(rows) for group, rows in tables.items()},
        "tables": tables,
        "runs_file": runs_file.name,
        "plots": plots,
    })
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s in all)")
    return tables


def replot(summary_path, directory):
    """Tables (and plots, with ``directory``, from the per-step records beside it) of a run this program saved."""
    saved = read_json(summary_path)
    config = saved["config"]
    for group, rows in saved["tables"].items():
        print_table(rows, COLUMNS, f"{group} ({saved['trainer_args']})")
        if directory:
            seeds = config["seeds"] if group == "methods" else config["sweep_seeds"]
            runs = group_runs(read_json(runs_path(summary_path)), rows, seeds)
            print(", ".join(plot(runs, rows, config["window"], directory, f"bench_{group}")))
    return saved["tables"]


if __name__ == "__main__":
    main()
