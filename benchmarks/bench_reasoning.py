"""Reasoning-shaped benchmark: GRPO (TRL's trainer), packing alone, DPPO (the default design `stratified`, then
`systematic`, `balanced` and the adaptive keep rate), DPPO + prompt pruning, CPPO's `topk` and the
`zero_variance` filter, each trained the same number of epochs over the same training set (the paper's
protocol), timed with generation included, on the countdown task (`dppo_trl.tasks.countdown`: `"58="` ->
`"58,51,...,2#2"`, long-tailed completion lengths, many zero-variance groups) from one warm-started tiny Qwen2.

TRL's defaults where they matter: `loss_type="dapo"`, `beta=0`, `num_generations=8`, and
`steps_per_generation` (4) larger than `gradient_accumulation_steps` (2). Greedy held-out accuracy (weighted to
the training distribution) at fixed points of data progress, outside the clock. Single-threaded; methods
interleaved within each seed; ratios to GRPO of the same seed. Prints the table and writes JSON (and plots with
``--plots``).

    make bench-reasoning                      # 2 seeds, tables + JSON + plots in docs/images (~55 min here)
    python benchmarks/bench_reasoning.py --seeds 0 --epochs 1 --methods grpo dppo
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_e2e import PHASE_LABELS, PHASES, run_one, seed_mean, trailing_mean  # noqa: E402

# DPPOConfig settings of each method; None is TRL's own GRPOConfig + GRPOTrainer.
METHODS = {
    "grpo": None,
    "packing": dict(completion_keep_rate=1.0),
    "dppo": dict(completion_keep_rate=0.5),
    "dppo+prompt": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5),
    "systematic": dict(prune_sampling="systematic", completion_keep_rate=0.5),
    "balanced": dict(prune_sampling="balanced", completion_keep_rate=0.5),
    "adaptive": dict(completion_keep_rate=0.25, adaptive_keep_error=0.5),
    "topk": dict(prune_sampling="topk", completion_keep_rate=0.5),
    "zero_variance": dict(prune_sampling="zero_variance"),
}


def data_progress(trainer) -> int:
    """How far through the data a run is, in GRPO's optimizer steps (prompt pruning walks faster per step)."""
    if getattr(trainer.args, "prompt_pruning", False):
        return trainer._grpo_equivalent_steps()
    return trainer.state.global_step


def first_reaching(walls, accuracies, target):
    """Wall time of the first evaluation at or above ``target`` (None if none is)."""
    return next((w for w, a in zip(walls, accuracies) if a >= target - 1e-12), None)


def smoothed_accuracy(run, window):
    """(wall times, trailing mean of the held-out accuracy over ``window`` evaluations) of a run."""
    return [e["wall"] for e in run["evals"]], trailing_mean([e["accuracy"] for e in run["evals"]], window)


def per_seed_figures(run, base, window=2):
    """One method's figures in one seed, with ratios to GRPO's run ``base`` of the same seed. The target is
    GRPO's final held-out accuracy, both it and the crossing read on the trailing mean of ``window``
    evaluations (one evaluation is noisy)."""
    total, base_total = run["steps"][-1]["wall"], base["steps"][-1]["wall"]
    phases = {p: sum(s[p] for s in run["steps"]) for p in PHASES}
    base_phases = {p: sum(s[p] for s in base["steps"]) for p in PHASES}
    gens, base_gens = run["generations"], base["generations"]
    curve, base_curve = smoothed_accuracy(run, window), smoothed_accuracy(base, window)
    target = base_curve[1][-1]
    reach, base_reach = first_reaching(*curve, target), first_reaching(*base_curve, target)
    trained = sum(g["trained_sequence_tokens"] for g in gens)
    return {
        "total_s": total,
        "time_per_epoch_ratio": total / base_total,
        "training_phase_ratio": (phases["scoring"] + phases["loss"]) / (base_phases["scoring"] + base_phases["loss"]),
        "ideal_training_ratio": trained / sum(g["padded_tokens"] for g in base_gens),
        "phases": phases,
        "optimizer_steps": len(run["steps"]),
        "generation_batches": len(gens),
        "generated_completions": sum(g["completions"] for g in gens),
        "kept_fraction": sum(g["kept_completions"] for g in gens) / sum(g["completions"] for g in gens),
        "trained_tokens": trained,
        "zero_variance_share": statistics.mean(g["zero_variance_groups"] for g in gens),
        "zero_variance_first_last": [statistics.mean(g["zero_variance_groups"] for g in part)
                                     for part in (gens[: max(1, len(gens) // 4)], gens[-max(1, len(gens) // 4):])],
        "target_accuracy": target,
        "time_to_target_ratio": reach / base_reach if reach is not None and base_reach else None,
        "accuracy_start": run["evals"][0]["accuracy"],
        "accuracy_final": curve[1][-1],
        "greedy_start": run["evals"][0]["greedy_accuracy"],
        "greedy_final": run["evals"][-1]["greedy_accuracy"],
    }  # fmt: skip


def summarize(runs, methods, window=2):
    """One row per method: medians over seeds of the per-seed figures (ratios taken within a seed), the final
    accuracy's mean and spread over seeds, and how many seeds reached GRPO's final accuracy."""
    by = {(r["method"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for method in methods:
        per_seed = [per_seed_figures(by[method, s], by["grpo", s], window) for s in seeds if (method, s) in by]
        if not per_seed:
            continue
        med = lambda key: statistics.median(p[key] for p in per_seed)  # noqa: E731
        reached = [p["time_to_target_ratio"] for p in per_seed if p["time_to_target_ratio"] is not None]
        accuracies = [p["accuracy_final"] for p in per_seed]
        greedy = [p["greedy_final"] for p in per_seed]
        rows.append(
            {
                "method": method,
                "settings": METHODS.get(method),
                "seeds": len(per_seed),
                **{
                    k: med(k)
                    for k in (
                        "total_s",
                        "time_per_epoch_ratio",
                        "training_phase_ratio",
                        "ideal_training_ratio",
                        "optimizer_steps",
                        "generation_batches",
                        "generated_completions",
                        "kept_fraction",
                        "trained_tokens",
                        "zero_variance_share",
                        "accuracy_start",
                        "greedy_start",
                    )
                },  # fmt: skip
                "phase_share": {p: statistics.median(s["phases"][p] / s["total_s"] for s in per_seed) for p in PHASES},
                "phase_s": {p: statistics.median(s["phases"][p] for s in per_seed) for p in PHASES},
                "time_to_target_ratio": statistics.median(reached) if reached else None,
                "reached_target": f"{len(reached)}/{len(per_seed)}",
                "accuracy_mean": statistics.mean(accuracies),
                "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                "greedy_mean": statistics.mean(greedy),
                "greedy_std": statistics.stdev(greedy) if len(greedy) > 1 else 0.0,
                "per_seed": per_seed,
            }
        )
    return rows


def print_table(rows, title):
    print(f"\n{title}")
    print(f"{'method':<14}{'total s':>8}{'epoch/GRPO':>11}{'train/GRPO':>11}{'ideal':>7}{'to target':>10}"
          f"{'reached':>8}{'kept':>6}{'0-var':>6}{'held-out acc':>16}{'greedy':>16}  gen/score/loss/other")  # fmt: skip
    for r in rows:
        target = f"{r['time_to_target_ratio']:.2f}" if r["time_to_target_ratio"] is not None else "-"
        share = "/".join(f"{r['phase_share'][p]:.2f}" for p in PHASES)
        print(f"{r['method']:<14}{r['total_s']:>8.0f}{r['time_per_epoch_ratio']:>11.3f}"
              f"{r['training_phase_ratio']:>11.3f}{r['ideal_training_ratio']:>7.3f}{target:>10}{r['reached_target']:>8}"
              f"{r['kept_fraction']:>6.2f}{r['zero_variance_share']:>6.2f}"
              f"{r['accuracy_mean']:>9.3f} ± {r['accuracy_std']:.3f}{r['greedy_mean']:>9.3f} ± {r['greedy_std']:.3f}"
              f"  {share}")  # fmt: skip


def plot(runs, rows, directory, prefix="bench_reasoning"):
    """Held-out accuracy vs wall time, the zero-variance share vs data progress (each the mean over seeds), and
    the time breakdown; PNG files under ``directory``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [r["method"] for r in rows]
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    seeds = len({r["seed"] for r in runs})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for method in names:
        mine = [r for r in runs if r["method"] == method]
        walls, accuracy = seed_mean([([e["wall"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]])
                                     for r in mine])  # fmt: skip
        axes[0].plot(walls, accuracy, marker="o", ms=3, color=colors[method], lw=1.4, label=method)
        share = seed_mean([(list(range(len(r["generations"]))), [g["zero_variance_groups"] for g in r["generations"]])
                           for r in mine])  # fmt: skip
        axes[1].plot(*share, color=colors[method], lw=1.0, alpha=0.8, label=method)
    axes[0].set(xlabel="wall seconds (evaluation excluded)", ylabel="held-out accuracy (sampled, temperature 1)",
                title=f"Held-out accuracy vs wall time (mean of {seeds} seeds)")  # fmt: skip
    axes[1].set(xlabel="generation batch", ylabel="share of groups with zero reward variance",
                title="Zero-variance groups over training")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    written = [directory / f"{prefix}_curves.png"]
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    left = [0.0] * len(rows)
    for phase in PHASES:
        widths = [r["phase_s"][phase] for r in rows]
        ax.barh(names, widths, left=left, label=PHASE_LABELS[phase])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set(xlabel="seconds (median over seeds)", title="Where the time goes (same epochs over the same data)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    fig.tight_layout()
    written.append(directory / f"{prefix}_breakdown.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return [str(p) for p in written]


def evaluate(model, tokenizer, starts, samples, seed=1234):
    """Held-out accuracy over ``starts`` (draws from the held-out starts under the training law): sampled (the
    mean over ``samples`` completions per draw at temperature 1, what GRPO optimizes; the main figure) and
    greedy. The sampling uses its own seed (the same in every run: common random numbers across methods) and
    leaves the training's random state untouched."""
    from dppo_trl.tasks.countdown import heldout_accuracy

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        sampled = heldout_accuracy(model, tokenizer, starts, greedy=False, samples=samples)
    return {"accuracy": sampled, "greedy_accuracy": heldout_accuracy(model, tokenizer, starts)}


def prepare_setup(args):
    from dppo_trl.tasks.countdown import (
        countdown_dataset,
        countdown_reward,
        countdown_splits,
        max_completion_tokens,
        training_draws,
        warm_start,
    )

    train, heldout = countdown_splits(train_size=args.train_prompts, seed=0)
    heldout_set = training_draws(heldout, args.heldout, random.Random(1))
    model_dir = Path(args.model_cache) / f"warm-start-{args.hidden_size}x{args.layers}-{args.sft_steps}"
    warm = {}
    if not (model_dir / "config.json").exists():
        start = time.perf_counter()
        warm = warm_start(model_dir, heldout, args.sft_steps, args.hidden_size, args.layers)
        warm["seconds"] = time.perf_counter() - start
        print(f"warm start: {args.sft_steps} supervised steps in {warm['seconds']:.0f} s, loss {warm['loss']:.3f}, "
              f"greedy held-out {warm['heldout_accuracy']:.3f}", flush=True)  # fmt: skip
    prompts_per_step = args.batch_size * args.gradient_accumulation_steps // 8
    steps_per_epoch = len(train) // prompts_per_step
    return {
        "model_dir": str(model_dir),
        "warm_start": warm,
        "train_dataset": countdown_dataset(train),
        "reward_funcs": countdown_reward,
        "evaluate": functools.partial(evaluate, starts=heldout_set, samples=args.eval_samples),
        "eval_every": max(1, round(steps_per_epoch * args.eval_every)),
        "epochs": args.epochs,
        "progress": data_progress,
        "trainer_args": dict(
            bf16=False,
            use_cpu=True,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            steps_per_generation=args.steps_per_generation,
            num_generations=8,
            max_completion_length=max_completion_tokens(),
            temperature=1.0,
            loss_type="dapo",
            beta=0.0,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
        ),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--train-prompts", type=int, default=256, help="training prompts (draws, with repeats)")
    parser.add_argument(
        "--heldout",
        type=int,
        default=256,
        help="held-out evaluation draws (from the held-out starts, under the training law)",
    )
    parser.add_argument("--eval-every", type=float, default=0.25, help="epochs of data between evaluations")
    parser.add_argument("--eval-samples", type=int, default=1, help="sampled completions per held-out draw")
    parser.add_argument("--eval-window", type=int, default=2, help="evaluations in the trailing accuracy mean")
    parser.add_argument("--batch-size", type=int, default=32, help="per_device_train_batch_size (completions)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--steps-per-generation", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model-cache", default="outputs/bench-reasoning")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs of a few steps")
    parser.add_argument("--json", default="benchmarks/results/bench_reasoning.json")
    parser.add_argument("--plots", default=None, help="directory for PNG plots (e.g. docs/images)")
    parser.add_argument("--from-json", default=None, help="train nothing: print the table and plot a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        return replot(Path(args.from_json), args.plots)
    if "grpo" not in args.methods:
        parser.error("--methods must include grpo: every ratio is to GRPO's run of the same seed")
    torch.set_num_threads(1)
    started = time.perf_counter()
    setup = prepare_setup(args)
    for _ in range(args.warmup):  # first-call costs (imports, kernels) land here, not in GRPO's first run
        run_one("warmup", METHODS["dppo"], 0, dict(setup, epochs=None, steps=2, extension=0, evaluate=None))
    runs = []
    for seed in args.seeds:
        for name in args.methods:
            run = run_one(name, METHODS[name], seed, setup)
            print(f"[{time.perf_counter() - started:7.0f} s] {name} seed {seed}: {len(run['steps'])} steps, "
                  f"{run['steps'][-1]['wall']:.1f} s, held-out {run['evals'][0]['accuracy']:.3f} -> "
                  f"{run['evals'][-1]['accuracy']:.3f}", flush=True)  # fmt: skip
            runs.append(run)
    rows = summarize(runs, args.methods, args.eval_window)
    print_table(rows, f"countdown, {args.epochs:g} epochs x {args.train_prompts} prompts (seeds {args.seeds}, "
                      "ratios to GRPO in the same run)")  # fmt: skip
    plots = plot(runs, rows, args.plots) if args.plots else []
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_file = out.with_name(out.stem + "_runs.json")  # per-step records: large, not committed
    runs_file.write_text(json.dumps(runs, separators=(",", ":")))
    saved = {
        "config": vars(args),
        "trainer_args": setup["trainer_args"],
        "warm_start": setup["warm_start"],
        "elapsed_s": time.perf_counter() - started,
        "results": [{k: v for k, v in r.items() if k != "per_seed"} for r in rows],
        "per_seed": {r["method"]: r["per_seed"] for r in rows},
        "runs_file": runs_file.name,
        "plots": plots,
    }
    out.write_text(json.dumps(saved, indent=1))
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s in all)")
    return rows


def replot(summary_path: Path, directory):
    """The table (and plots, with ``directory``, from the per-run records beside it) of a saved run."""
    saved = json.loads(summary_path.read_text())
    rows = saved["results"]
    print_table(rows, f"{summary_path} ({saved['trainer_args']})")
    if directory:
        runs = json.loads((summary_path.parent / saved["runs_file"]).read_text())
        print(", ".join(plot(runs, rows, directory)))
    return rows


if __name__ == "__main__":
    main()
