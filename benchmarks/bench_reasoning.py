"""Reasoning-shaped benchmark: GRPO (TRL's trainer), packing alone, DPPO (the default design `stratified`, then
`systematic`, `balanced` and the adaptive keep rate), DPPO + prompt pruning, CPPO's `topk` and the
`zero_variance` filter, each trained the same number of epochs over the same training set (the paper's
protocol), timed with generation included, on the countdown task (`dppo_trl.tasks.countdown`: `"58="` ->
`"58,51,...,2#2"`, long-tailed completion lengths, many zero-variance groups) from one warm-started tiny Qwen2.

TRL's defaults where they matter: `loss_type="dapo"`, `beta=0`, `num_generations=8`, and
`steps_per_generation` (4) larger than `gradient_accumulation_steps` (2). Greedy held-out accuracy (weighted to
the training distribution) at fixed points of data progress, outside the clock. Single-threaded; a seed's methods
take turns, one optimizer step at a time, each in a process of its own after its own warm-up run
(``harness.interleave``), so a load that changes falls alike on all; ratios to GRPO of the same seed. Prints the
table and writes JSON (and plots with ``--plots``).

    make bench-reasoning                      # 2 seeds, tables + JSON + plots in docs/images (~55 min here)
    python benchmarks/bench_reasoning.py --seeds 0 --epochs 1 --methods grpo dppo
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from harness import (  # noqa: E402
    PHASES,
    TARGET_COLUMNS,
    TIMING_IN_TURNS,
    Panel,
    cost_figures,
    countdown_setup,
    eval_curve,
    phase_shares,
    plot_runs,
    pm,
    print_table,
    read_json,
    result_path,
    run_methods,
    runs_path,
    summarize,
    target_figures,
    text_table,
    time_to_target_ratio,
    without_per_seed,
    write_json,
)
from harness import time_to  # noqa: E402, F401  (the tests read it here)

# DPPOConfig settings of each method; None is TRL's own GRPOConfig + GRPOTrainer.
METHODS = {
    "grpo": None,
    "packing": dict(completion_keep_rate=1.0),
    "dppo": dict(completion_keep_rate=0.5),
    "dppo+prompt": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5, prompt_score="ema"),  # as recorded
    "systematic": dict(prune_sampling="systematic", completion_keep_rate=0.5),
    "balanced": dict(prune_sampling="balanced", completion_keep_rate=0.5),
    "adaptive": dict(completion_keep_rate=0.25, adaptive_keep_error=0.5),
    "topk": dict(prune_sampling="topk", completion_keep_rate=0.5),
    "zero_variance": dict(prune_sampling="zero_variance"),
}
MEDIANS = ("total_s", "time_per_epoch_ratio", "training_phase_ratio", "ideal_training_ratio", "optimizer_steps",
           "generation_batches", "generated_completions", "kept_fraction", "trained_tokens", "zero_variance_share",
           "accuracy_start", "greedy_start")
COLUMNS = [
    ("method", -14, "method:"),
    ("total s", 8, "total_s:.0f"),
    ("epoch/GRPO", 11, "time_per_epoch_ratio:.3f"),
    ("train/GRPO", 11, "training_phase_ratio:.3f"),
    ("ideal", 7, "ideal_training_ratio:.3f"),
    ("to target", 10, "time_to_target_ratio:.2f"),
    ("reached", 8, "reached_target:"),
    ("kept", 6, "kept_fraction:.2f"),
    ("0-var", 6, "zero_variance_share:.2f"),
    ("held-out acc", 16, lambda r: pm(r["accuracy_mean"], r["accuracy_std"])),
    ("greedy", 16, lambda r: pm(r["greedy_mean"], r["greedy_std"])),
    ("gen/score/loss/other", 0, phase_shares),
]


def smoothed_accuracy(run, window):
    """(wall times, trailing mean of the held-out accuracy over ``window`` evaluations) of a run."""
    return eval_curve(run, "accuracy", window)


def per_seed_figures(run, base, window=2):
    """One method's figures in one seed, with ratios to GRPO's run ``base`` of the same seed. The target is
    GRPO's final held-out accuracy, both it and the crossing read on the trailing mean of ``window``
    evaluations (one evaluation is noisy)."""
    gens = run["generations"]
    curve, base_curve = smoothed_accuracy(run, window), smoothed_accuracy(base, window)
    figures = cost_figures(run["steps"], base["steps"], gens, total_ratio="time_per_epoch_ratio")
    quarter, target = max(1, len(gens) // 4), base_curve[1][-1]
    return {
        **figures,
        "ideal_training_ratio": figures["trained_tokens"] / sum(g["padded_tokens"] for g in base["generations"]),
        "optimizer_steps": len(run["steps"]),
        "generation_batches": len(gens),
        "zero_variance_share": statistics.mean(g["zero_variance_groups"] for g in gens),
        "zero_variance_first_last": [statistics.mean(g["zero_variance_groups"] for g in part)
                                     for part in (gens[:quarter], gens[-quarter:])],
        "target_accuracy": target,
        "time_to_target_ratio": time_to_target_ratio(curve, base_curve, target),
        "accuracy_start": run["evals"][0]["accuracy"],
        "accuracy_final": curve[1][-1],
        "greedy_start": run["evals"][0]["greedy_accuracy"],
        "greedy_final": run["evals"][-1]["greedy_accuracy"],
    }


def summarize_runs(runs, methods, window=2, target_window=8):
    """One row per method: medians over seeds of the per-seed figures (ratios taken within a seed), the final
    accuracy's mean and spread over seeds, how many seeds reached GRPO's final accuracy, and the steps and time
    to 90% of GRPO's rise (``harness.target_figures``: the training reward over ``target_window`` generation
    batches, the held-out accuracy), as ratios to GRPO's, with the final accuracy's paired interval."""

    def extra(method, per_seed):
        targets = target_figures(runs, method, target_window)
        return {"settings": METHODS.get(method),
                "phase_s": {p: statistics.median(s["phases"][p] for s in per_seed) for p in PHASES},
                **{k: v for k, v in targets.items() if k != "seeds"}}  # "seeds" stays the count

    return summarize(runs, methods, functools.partial(per_seed_figures, window=window), MEDIANS,
                     finals=("accuracy", "greedy"), extra=extra)


def plot(runs, rows, directory, prefix="bench_reasoning"):
    """Held-out accuracy vs wall time, the zero-variance share vs data progress (each the mean over seeds), and
    the time breakdown; PNG files under ``directory``."""

    def zero_variance(run):
        return list(range(len(run["generations"]))), [g["zero_variance_groups"] for g in run["generations"]]

    panels = [
        Panel(eval_curve, "wall seconds (evaluation excluded)", "held-out accuracy (sampled, temperature 1)",
              "Held-out accuracy vs wall time (mean of {seeds} seeds)", dict(marker="o", ms=3, lw=1.4)),
        Panel(zero_variance, "generation batch", "share of groups with zero reward variance",
              "Zero-variance groups over training", dict(lw=1.0, alpha=0.8)),
    ]
    return plot_runs(runs, rows, panels, directory, prefix, "Where the time goes (same epochs over the same data)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--train-prompts", type=int, default=256, help="training prompts (draws, with repeats)")
    parser.add_argument("--heldout", type=int, default=256,
                        help="held-out evaluation draws (from the held-out starts, under the training law)")
    parser.add_argument("--eval-every", type=float, default=0.25, help="epochs of data between evaluations")
    parser.add_argument("--eval-samples", type=int, default=1, help="sampled completions per held-out draw")
    parser.add_argument("--eval-window", type=int, default=2, help="evaluations in the trailing accuracy mean")
    parser.add_argument("--window", type=int, default=8,
                        help="generation batches in the trailing reward mean of the 90%%-of-rise target")
    parser.add_argument("--batch-size", type=int, default=32, help="per_device_train_batch_size (completions)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--steps-per-generation", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--max-completion-length", type=int, default=None,
                        help="default: the longest correct chain's tokens (a shorter one truncates the long chains)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model-cache", default="outputs/bench-reasoning")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs of a few steps")
    parser.add_argument("--json", default=result_path("bench_reasoning"))
    parser.add_argument("--plots", default=None, help="directory for PNG plots (e.g. docs/images)")
    parser.add_argument("--from-json", default=None, help="train nothing: print the table and plot a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        return replot(Path(args.from_json), args.plots)
    if "grpo" not in args.methods:
        parser.error("--methods must include grpo: every ratio is to GRPO's run of the same seed")
    torch.set_num_threads(1)
    started = time.perf_counter()
    setup = countdown_setup(
        train_prompts=args.train_prompts, heldout=args.heldout, eval_samples=args.eval_samples,
        eval_every=args.eval_every, epochs=args.epochs, batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, steps_per_generation=args.steps_per_generation,
        learning_rate=args.learning_rate, sft_steps=args.sft_steps, hidden_size=args.hidden_size, layers=args.layers,
        model_cache=args.model_cache, max_completion_length=args.max_completion_length,
    )
    runs = run_methods({name: METHODS[name] for name in args.methods}, args.seeds, setup, started=started,
                       in_turns=True, threads=1, warmup=args.warmup)
    rows = summarize_runs(runs, args.methods, args.eval_window, args.window)
    print_table(rows, COLUMNS, f"countdown, {args.epochs:g} epochs x {args.train_prompts} prompts "
                               f"(seeds {args.seeds}, ratios to GRPO in the same run)")
    print("\nTo 90% of GRPO's rise (ratios to GRPO's, mean ± SE over the seeds that reached it):")
    print(text_table(rows, TARGET_COLUMNS))
    plots = plot(runs, rows, args.plots) if args.plots else []
    out = Path(args.json)
    runs_file = write_json(runs_path(out), runs, compact=True)  # per-step records: large, not committed
    write_json(out, {
        "config": vars(args),
        "timing": TIMING_IN_TURNS,
        "trainer_args": setup["trainer_args"],
        "warm_start": setup["warm_start"],
        "elapsed_s": time.perf_counter() - started,
        "results": without_per_seed(rows),
        "per_seed": {r["method"]: r["per_seed"] for r in rows},
        "runs_file": runs_file.name,
        "plots": plots,
    })
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s in all)")
    return rows


def replot(summary_path: Path, directory):
    """The table (and plots, with ``directory``, from the per-run records beside it) of a saved run."""
    saved = read_json(summary_path)
    rows = saved["results"]
    print_table(rows, COLUMNS, f"{summary_path} ({saved['trainer_args']})")
    if directory:
        print(", ".join(plot(read_json(summary_path.parent / saved["runs_file"]), rows, directory)))
    return rows


if __name__ == "__main__":
    main()
