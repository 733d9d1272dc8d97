"""Real-model benchmark: SmolLM2-135M-Instruct (`dppo-trl-smollm2`) with LoRA on a reasoning-gym task, GRPO
(TRL's trainer) vs DPPO (defaults: keep 0.5, stratified, packing) vs DPPO + prompt pruning, the same number of
optimizer steps over the same prompt set (several epochs, so that prompt pruning has a history to act on), each
seed's methods in turns: each in a process of its own, one optimizer step at a time (``harness.interleave``), so
that a load that changes falls alike on every method and each method's clock counts its own steps only.
``--one-after-the-other`` runs them back to back in one process instead: for learning runs (``learning.sh``), whose
steps to a target do not depend on the machine; their time figures are then labelled so (``_one_after_the_other``).

The curve is the reward of every generated completion (all G of a group are scored before any pruning; under
prompt pruning each prompt weighted by 1/its acceptance probability, the Hajek estimate of the policy's reward on
the whole prompt set), a trailing mean over ``--window`` generation batches. The target is GRPO's final value of
that curve; each method's time to reach it is a ratio to GRPO's own time in the same seed. A sampled held-out
evaluation (temperature 1, its own seed, the same draws for every method) runs outside the clock. Standard errors:
of a ratio, over seeds; of a reward, from the step-to-step spread within its window, then over seeds.

The speedup in two factors (``harness.targets``): learning per step, the optimizer steps each method takes to
reach 90% of GRPO's own rise (from its first window to its last) on the training reward and on the held-out
score, per seed, as a ratio to GRPO's; and time per step by phase, from short paired runs on an idle machine
(``--phases-of``); their product projected to a machine where generation takes a share s of GRPO's step.

    make bench-real                                   # 2 seeds, table + JSON + plots in docs/images (58 min here)
    make bench-real-vllm                              # the same with vLLM generating (colocated; its own venv)
    python benchmarks/bench_real.py --seeds 0 --steps 8 --methods grpo dppo
    python benchmarks/bench_real.py --from-runs benchmarks/results/learning/real_seed*_runs.json \
        --phases-of benchmarks/results/bench_real_phases_dapo.json --json benchmarks/results/bench_real_learning.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import (  # noqa: E402
    LORA,
    STEP_PHASES,
    TIMING_IN_TURNS,
    TIMING_ONE_AFTER_THE_OTHER,
    TARGET_COLUMNS,
    mean_se,
    median_phase_ratios,
    phase_means,
    phase_ratios,
    phase_shares,
    plot_projection,
    plot_runs,
    pm,
    pooled,
    projection,
    read_json,
    reasoning_gym_setup,
    result_path,
    probe_prediction,
    revisit_outcomes,
    reward_panels,
    run_methods,
    runs_path,
    summarize_at_budget,
    target_figures,
    text_table,
    warm_up,
    without_per_seed,
    write_json,
)

# DPPOConfig settings of each method; None is TRL's own GRPOConfig + GRPOTrainer.
METHODS = {
    "grpo": None,
    "dppo": dict(completion_keep_rate=0.5),
    # DPPO without prefix sharing (issue 32): every kept row forwards its prompt, as before it.
    "dppo+repeated": dict(completion_keep_rate=0.5, prefix_sharing=False),
    "dppo+prompt": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5, prompt_score="ema"),  # as recorded
    "dppo+calibrated": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5, prompt_score="calibrated"),
    # Issue 42: the cut (2 of each step's 4 prompts generated), set by a probe of 2 completions of every candidate.
    "dppo+cut": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5, prompt_score="probe", prompt_probe_generations=2),
    # The cut set by the history alone (one generation call a step).
    "dppo+cut-calibrated": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5, prompt_score="calibrated",
                                prompt_probe_generations=0),
    "packing": dict(completion_keep_rate=1.0),
    # DPPO with every other batch audited: its logged time ratios, checked against the paired runs' (not for timing:
    # the audit runs GRPO's passes too).
    "dppo+audit": dict(completion_keep_rate=0.5, audit_every=2),
}
PROMPT_PRUNED = {name for name, settings in METHODS.items() if (settings or {}).get("prompt_keep_rate", 1.0) < 1.0}
# The methods that generate fewer groups a step (the cut, issue 42); the others' records are of the retired fill
# mode, which generated GRPO's batch every step.
CUT = {"dppo+cut", "dppo+cut-calibrated"}
# Trainer settings every method of a run gets: TRL's defaults (`dapo`), its other loss types, and GSPO.
VARIANTS = {
    "dapo": {},
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "gspo": dict(importance_sampling_level="sequence"),
}
PAPER_SPEEDUP = 2.37  # DPPO's paper over GRPO, Qwen3-4B on MATH (arXiv 2603.04135)
# Rollout's share of a synchronous RL step on GPUs: "approximately 70% of total training time" (RollPacker,
# arXiv 2509.21009, veRL on Qwen2.5 models, H800s).
TYPICAL_GPU_GENERATION_SHARE = 0.7
AUDIT_TOLERANCE = 0.15  # the audit's projected step ratio against the paired runs' measured one, relative
COLUMNS = [
    ("method", -13, "method:"),
    ("to target", 15, lambda r: pm(r["time_to_target_ratio_mean"], r["time_to_target_ratio_se"], 2)),
    ("reached", 8, "reached_target:"),
    ("total/GRPO", 15, lambda r: pm(r["total_ratio_mean"], r["total_ratio_se"])),
    ("train/GRPO", 15, lambda r: pm(r["training_phase_ratio_mean"], r["training_phase_ratio_se"])),
    ("ideal", 15, lambda r: pm(r["ideal_training_ratio_mean"], r["ideal_training_ratio_se"])),
    ("kept", 6, "kept_fraction:.2f"),
    ("final reward", 16, lambda r: pm(r["final_reward_mean"], r["final_reward_se"])),
    ("- GRPO", 16, lambda r: pm(r["final_reward_diff_mean"], r["final_reward_diff_se"])),
    ("held-out", 16, lambda r: pm(r["heldout_final_mean"], r["heldout_final_se"])),
    ("gen/score/loss/other", 0, phase_shares),
]


def timing_of(runs) -> str:
    """How the runs' times were taken: in turns where every run took turns, else one after the other (records
    from before the turns have no "timing": one after the other)."""
    taken = {r.get("timing", TIMING_ONE_AFTER_THE_OTHER) for r in runs}
    return TIMING_IN_TURNS if taken == {TIMING_IN_TURNS} else TIMING_ONE_AFTER_THE_OTHER


def timed_key(key: str, timing: str) -> str:
    """A time figure's key in a summary: ``phase_ratios`` from runs in turns, ``phase_ratios_one_after_the_other``
    from runs one after the other (one figure per quantity, and a reader sees how it was taken)."""
    return key if timing == TIMING_IN_TURNS else f"{key}_one_after_the_other"


def phase_ratios_of(row):
    """A summary row's time per step by phase over GRPO's, whichever way it was taken (None where none)."""
    return row.get("phase_ratios", row.get("phase_ratios_one_after_the_other"))


SPEED_COLUMNS = [  # the target figures, then the time per step against GRPO's
    *TARGET_COLUMNS,
    ("step/GRPO", 15, lambda r: "-" if phase_ratios_of(r) is None else pm(*phase_ratios_of(r)["step"])),
    ("train/GRPO", 15, lambda r: "-" if phase_ratios_of(r) is None else pm(*phase_ratios_of(r)["training"])),
]


def window_stats(run, first: bool, window: int):
    """(mean, SE) of the per-batch population reward over the first or the last ``window`` generation batches of
    a run; the SE from the batch-to-batch spread."""
    values = [g["population_reward"] for g in run["generations"]]
    part = values[:window] if first else values[-window:]
    return statistics.mean(part), statistics.stdev(part) / math.sqrt(len(part))


def paired_difference(run, base, window: int):
    """(mean, SE) of the per-batch reward difference ``run`` - ``base`` over their last ``window`` batches."""
    diffs = [a["population_reward"] - b["population_reward"]
             for a, b in zip(run["generations"][-window:], base["generations"][-window:])]
    return statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))


def real_figures(runs, rows, window, heldout, first_epoch):
    """Adds to each summary row: ratios as mean ± SE over seeds, the training phase against the ideal (tokens
    trained over GRPO's padded tokens), the final reward ± SE, the held-out accuracy ± SE, what the generated
    batches after the first ``first_epoch`` (GRPO's first epoch, where prompt pruning accepts everything) held;
    and GRPO's rise over the run in standard errors: of the training curve (first vs last window) and of the
    held-out score (start vs end), each pooled over seeds."""
    by = {(r["method"], r["seed"]): r for r in runs}
    for row in rows:
        seeds = sorted(s for m, s in by if m == row["method"] and ("grpo", s) in by)
        for key in ("time_to_target_ratio", "total_ratio", "training_phase_ratio"):
            row[key + "_mean"], row[key + "_se"] = mean_se([p[key] for p in row["per_seed"]])
        ideal = []
        for seed in seeds:
            base = by["grpo", seed]["generations"]
            trained = sum(g["trained_sequence_tokens"] for g in by[row["method"], seed]["generations"])
            ideal.append(trained / sum(g["padded_tokens"] for g in base))
        row["ideal_training_ratio_mean"], row["ideal_training_ratio_se"] = mean_se(ideal)
        row["final_reward_mean"], row["final_reward_se"] = pooled(
            [window_stats(by[row["method"], s], False, window) for s in seeds]
        )
        # Paired with GRPO step by step (the same seed: the same prompts at the same steps without prompt pruning),
        # so the batch-to-batch spread that both runs share drops out of the difference's SE.
        row["final_reward_diff_mean"], row["final_reward_diff_se"] = pooled(
            [paired_difference(by[row["method"], s], by["grpo", s], window) for s in seeds]
        )
        row["zero_variance_share"] = statistics.mean(
            g["zero_variance_groups"] for s in seeds for g in by[row["method"], s]["generations"]
        )
        # What the sampler fed the trainer once prompt pruning acts: groups whose rewards were all equal (no
        # signal) and the generated prompts' raw mean reward (not reweighted: how easy the taken prompts were).
        later = [by[row["method"], s]["generations"][first_epoch:] for s in seeds]
        for key, field in (("later_zero_variance_share", "zero_variance_groups"), ("later_generated_reward", "reward")):
            per_seed = [statistics.mean(g[field] for g in run) for run in later if run]
            row[key + "_mean"], row[key + "_se"] = mean_se(per_seed)
        evals = [by[row["method"], s]["evals"] for s in seeds]
        row["heldout_start_mean"], row["heldout_start_se"] = mean_se([e[0]["accuracy"] for e in evals])
        row["heldout_final_mean"], row["heldout_final_se"] = mean_se([e[-1]["accuracy"] for e in evals])
    grpo = [by["grpo", s] for s in sorted(s for m, s in by if m == "grpo")]
    first = pooled([window_stats(r, True, window) for r in grpo])
    last = pooled([window_stats(r, False, window) for r in grpo])
    rise_se = math.hypot(first[1], last[1])
    # The held-out score's rise: per seed, final - start, each with the binomial SE of a mean of `heldout` scores
    # in [0, 1] (exact for 0/1 scores, an upper bound otherwise), pooled over seeds.
    binomial = lambda p: math.sqrt(max(p * (1 - p), 0.0) / heldout)  # noqa: E731
    held = pooled([(r["evals"][-1]["accuracy"] - r["evals"][0]["accuracy"],
                    math.hypot(binomial(r["evals"][-1]["accuracy"]), binomial(r["evals"][0]["accuracy"])))
                   for r in grpo])
    return {
        "first": first,
        "last": last,
        "rise": last[0] - first[0],
        "rise_se": rise_se,
        "rise_z": (last[0] - first[0]) / rise_se if rise_se else None,
        "heldout_rise": held[0],
        "heldout_rise_se": held[1],
        "heldout_rise_z": held[0] / held[1] if held[1] else None,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["grpo", "dppo", "dppo+prompt"], choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of every method")
    parser.add_argument("--task", default="chain_sum", help="a reasoning-gym task")
    parser.add_argument("--answer-format", default="last_number")
    parser.add_argument("--task-seed", type=int, default=0, help="generator seed of the training set (+1: held out)")
    parser.add_argument("--train-prompts", type=int, default=32, help="prompt set size (steps x prompts / it epochs)")
    parser.add_argument("--heldout", type=int, default=128, help="held-out prompts, one sampled completion each")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts per optimizer step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--eval-every", type=int, default=20, help="optimizer steps between held-out evaluations")
    parser.add_argument("--window", type=int, default=8, help="generation batches in the trailing reward mean")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed warm-up runs of two steps (in turns: of each method, in its own process)")
    parser.add_argument("--one-after-the-other", action="store_true",
                        help="a seed's methods back to back in this process, not in turns (learning runs only: "
                             "their time figures are labelled so)")
    parser.add_argument("--vllm", action="store_true", help="generate with vLLM colocated (the vLLM lane's venv)")
    parser.add_argument("--variant", default="dapo", choices=list(VARIANTS), help="loss type or GSPO, every method")
    parser.add_argument("--json", default=result_path("bench_real"))
    parser.add_argument("--plots", default=None, help="directory for PNG plots (e.g. docs/images)")
    parser.add_argument("--from-runs", nargs="+", default=None,
                        help="train nothing: summarize saved *_runs.json files (their seeds together)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in this --json's per-step records (same settings); run the rest")
    parser.add_argument("--phases-of", default=None,
                        help="a summary JSON of short paired runs: its training-phase ratios make the projection")
    parser.add_argument("--generation-of", default=None,
                        help="bench_cut_generation.py's JSON: the cut's generation ratios for the projection")
    args = parser.parse_args(argv)
    runs_file = runs_path(args.json)  # per-step records, written before any summary
    if args.from_runs:
        runs, trainer_args, elapsed = merged_runs(args.from_runs)
        args.seeds = sorted({r["seed"] for r in runs})  # what the records hold, not the option's default
        return report(args, runs, trainer_args, elapsed, Path(args.from_runs[0]))
    if "grpo" not in args.methods:
        parser.error("--methods must include grpo: every ratio is to GRPO's run of the same seed")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    setup = reasoning_gym_setup(
        task=args.task, answer_format=args.answer_format, task_seed=args.task_seed, train_prompts=args.train_prompts,
        heldout=args.heldout, eval_every=args.eval_every, steps=args.steps, prompts_per_step=args.prompts_per_step,
        max_completion_length=args.max_completion_length, learning_rate=args.learning_rate, vllm=args.vllm,
        generations=args.generations,
    )
    setup["trainer_args"].update(VARIANTS[args.variant])
    in_turns = not args.one_after_the_other
    if not in_turns:  # in turns, each method warms up in its own process
        warm_up(setup, METHODS["dppo"], args.warmup, evaluate=None)

    def note(run):
        rewards = [g["population_reward"] for g in run["generations"]]
        return (f"reward first/last {args.window}: {statistics.mean(rewards[: args.window]):.3f} / "
                f"{statistics.mean(rewards[-args.window :]):.3f}, ")

    def save(runs):
        record = {"runs": runs, "trainer_args": setup["trainer_args"], "elapsed_s": time.perf_counter() - started}
        write_json(runs_file, record, compact=True)

    # --resume: a run already in the per-step records (same trainer settings) is kept: later sessions add seeds.
    saved = read_json(runs_file) if args.resume and runs_file.exists() else None
    done = saved["runs"] if saved and saved["trainer_args"] == setup["trainer_args"] else []
    runs = run_methods({name: METHODS[name] for name in args.methods}, args.seeds, setup, runs=done, started=started,
                       note=note, after_run=save, in_turns=in_turns, threads=args.threads, warmup=args.warmup)
    return report(args, runs, setup["trainer_args"], time.perf_counter() - started, runs_file)


def merged_runs(paths):
    """The runs of saved ``*_runs.json`` files, one per (method, seed), their trainer settings (which must agree)
    and the seconds they took in all."""
    runs, settings, elapsed = {}, None, 0.0
    for path in paths:
        saved = read_json(path)
        if settings is not None and saved["trainer_args"] != settings:
            raise SystemExit(f"{path}: other trainer settings than {paths[0]}'s; summarize them apart")
        settings, elapsed = saved["trainer_args"], elapsed + saved["elapsed_s"]
        for run in saved["runs"]:
            runs.setdefault((run["method"], run["seed"]), run)
    return list(runs.values()), settings, elapsed


SHARING_PHASES = ("logps", "loss", "training", "step")


def prefix_sharing_figures(runs):
    """DPPO (prefix sharing on, the default) against ``dppo+repeated`` (off), seed by seed: per phase of
    ``SHARING_PHASES`` the median over seeds of (ratio, SE), each seed's ratios, and the mean share of token
    positions sharing removed; None without both methods."""
    by = {(r["method"], r["seed"]): r for r in runs}
    seeds = sorted(s for m, s in by if m == "dppo" and ("dppo+repeated", s) in by)
    if not seeds:
        return None
    per_seed = [phase_ratios(by["dppo", s], by["dppo+repeated", s]) for s in seeds]
    saved = [x for s in seeds for x in by["dppo", s].get("prefix_tokens_saved") or []]
    return {
        "seeds": seeds,
        "ratios": {name: median_phase_ratios(per_seed)[name] for name in SHARING_PHASES},
        "per_seed": {name: [r[name][0] for r in per_seed] for name in SHARING_PHASES},  # None: a phase not run
        "prefix_tokens_saved": statistics.mean(saved) if saved else 0.0,
    }


def speed_figures(args, runs, rows):
    """Adds to each row its target figures (learning per step and time to 90% of GRPO's rise) and its time per
    step by phase against GRPO's (median over seeds); returns the audit's check where a ``dppo+audit`` run was
    paired with ``dppo``'s, and the projection where ``--phases-of`` names paired runs."""
    by = {(r["method"], r["seed"]): r for r in runs}
    timing = timing_of(runs)
    for row in rows:
        row.update(target_figures(runs, row["method"], args.window))
        seeds = sorted(s for m, s in by if m == row["method"] and ("grpo", s) in by)
        # Time per step by phase over GRPO's (paired by seed; median over seeds), generation's among them.
        row[timed_key("phase_ratios", timing)] = median_phase_ratios(
            [phase_ratios(by[row["method"], s], by["grpo", s]) for s in seeds])
        row[timed_key("phase_seconds", timing)] = {
            name: statistics.median(phase_means(by[row["method"], s])[name][0] for s in seeds)
            for name in (*STEP_PHASES, "step")}
    check = audit_check(runs, rows)
    paired = read_json(args.phases_of) if args.phases_of else None
    project = None
    if paired is not None:
        training = {r["method"]: tuple(phase_ratios_of(r)["training"]) for r in paired["results"]
                    if phase_ratios_of(r)}
        # An 8-step paired run ends inside the first epoch, where prompt pruning accepts every prompt. What its
        # batches cost later is DPPO's paired training ratio scaled by the tokens each trains over the whole run
        # ("ideal": trained over GRPO's padded tokens, which does not depend on the machine or its load).
        ideal = {r["method"]: r["ideal_training_ratio_mean"] for r in rows}
        if "dppo" in training and "dppo" in ideal:
            mean, se = training["dppo"]
            training.update({m: (mean * ideal[m] / ideal["dppo"], se * ideal[m] / ideal["dppo"])
                             for m in PROMPT_PRUNED if m in ideal})
        steps = {r["method"]: (r["steps_to_90_ratio_mean"], r["steps_to_90_ratio_se"]) for r in rows
                 if r["method"] != "grpo"}
        project = projection(steps, training, generation_ratios=cut_generation_ratios(args, rows))
    return check, project


def cut_generation_ratios(args, rows) -> dict:
    """The cut's generation per step over GRPO's, by method: from ``--generation-of`` (bench_cut_generation.py: the
    calls timed in turn, so load falls on both) where it has the method, else from these runs' own phase ratios
    (labelled with how they were taken). Each row records the one used (``generation_ratio_projected``)."""
    interleaved = read_json(args.generation_of)["ratios"] if args.generation_of else {}
    ratios = {}
    for row in rows:
        if row["method"] not in CUT:
            continue
        if row["method"] in interleaved:
            measured = interleaved[row["method"]]
            ratios[row["method"]] = (measured["ratio_mean"], measured["ratio_se"])
            row["generation_ratio_source"] = "interleaved"
        elif phase_ratios_of(row) and phase_ratios_of(row)["generation"]:
            ratios[row["method"]] = tuple(phase_ratios_of(row)["generation"])
            row["generation_ratio_source"] = "these runs, " + ("in turns" if "phase_ratios" in row
                                                               else "one after the other")
        if row["method"] in ratios:
            row["generation_ratio_projected"] = list(ratios[row["method"]])
    return ratios


def audit_check(runs, rows):
    """The audit's projected step ratio (the median of ``dppo+audit``'s audited batches) against the step ratio
    measured between the paired ``dppo`` and ``grpo`` runs: within ``AUDIT_TOLERANCE``, relative."""
    audited = [r for r in runs if r["method"] == "dppo+audit" and r.get("audit_times")]
    logged = [v for r in audited for v in r["audit_times"]["step_time_ratio"]]  # none from batches without signal
    dppo = next((r for r in rows if r["method"] == "dppo" and phase_ratios_of(r)), None)
    if not logged or dppo is None:
        return None
    logged = statistics.median(logged)
    measured = phase_ratios_of(dppo)["step"][0]
    return {
        "audit_step_time_ratio": logged,
        "audit_generation_share": statistics.median(v for r in audited for v in r["audit_times"]["generation_share"]),
        "paired_step_time_ratio": measured,
        "paired_step_time_ratio_se": phase_ratios_of(dppo)["step"][1],
        "relative_difference": logged / measured - 1,
        "tolerance": AUDIT_TOLERANCE,
        "within_tolerance": abs(logged / measured - 1) <= AUDIT_TOLERANCE,
    }


def report(args, runs, trainer_args, elapsed, runs_file):
    """The table, the plots and the summary JSON of finished runs."""
    rows = summarize_at_budget(runs, args.methods, args.window)
    rise = real_figures(runs, rows, args.window, args.heldout, args.train_prompts // args.prompts_per_step)
    check, project = speed_figures(args, runs, rows)
    sharing = prefix_sharing_figures(runs)
    z = lambda value: "-" if value is None else f"{value:.1f}"  # noqa: E731  (no spread: no z)
    print(f"\nSmolLM2-135M-Instruct + LoRA, reasoning-gym {args.task}, {args.steps} steps x {args.prompts_per_step} "
          f"prompts over {args.train_prompts} (seeds {args.seeds})" + (", vLLM colocated" if args.vllm else ""))
    print(f"GRPO's curve: {rise['first'][0]:.3f} -> {rise['last'][0]:.3f}, a rise of {rise['rise']:.3f} "
          f"± {rise['rise_se']:.3f} ({z(rise['rise_z'])} SE); held-out score: a rise of {rise['heldout_rise']:.3f} "
          f"± {rise['heldout_rise_se']:.3f} ({z(rise['heldout_rise_z'])} SE)")
    print(text_table(rows, COLUMNS))
    print("\nTo 90% of GRPO's rise (ratios to GRPO's, mean ± SE over the seeds that reached it), time per step:")
    print(text_table(rows, SPEED_COLUMNS))
    if project:
        print("\nProjected time to the training-reward target over GRPO's (speedup), by generation's share of GRPO's step:")
        for method in dict.fromkeys(p["method"] for p in project):
            print(f"{method:<13}" + "".join(f"  {p['generation_share']:.0%}: {p['time_ratio']:.2f} ({1 / p['time_ratio']:.2f}x)"
                                            for p in project if p["method"] == method))
    if sharing is not None:
        print("\nPrefix sharing: DPPO over DPPO with repeated prompts (median over seeds of each seed's ratio ± SE), "
              f"token positions removed {sharing['prefix_tokens_saved']:.3f}:")
        ratios = sharing["ratios"]  # None for a phase neither ran (no log-prob passes at GA = spg, beta 0)
        print("  " + ", ".join(f"{name} {pm(*ratios[name]) if ratios[name] else '-'}" for name in SHARING_PHASES))
    if check is not None:
        print(f"audit check: the audit's step ratio {check['audit_step_time_ratio']:.3f} vs the paired runs' "
              f"{check['paired_step_time_ratio']:.3f} ({100 * check['relative_difference']:+.1f}%, "
              f"{'within' if check['within_tolerance'] else 'OUTSIDE'} {100 * AUDIT_TOLERANCE:.0f}%)")
    plots = []
    if args.plots:
        plots = plot_runs(runs, rows, reward_panels(args.window, "sampled held-out score"), args.plots,
                          Path(args.json).stem, "Where the time goes (same number of optimizer steps)")
        if project:
            plots.append(plot_projection(project, Path(args.plots) / f"{Path(args.json).stem}_projection.png",
                                         PAPER_SPEEDUP, TYPICAL_GPU_GENERATION_SHARE))
    out = write_json(args.json, {
        "config": {k: v for k, v in vars(args).items()
                   if k not in ("from_runs", "phases_of", "generation_of", "resume", "one_after_the_other")},
        # How the runs' times were taken (harness.training.TIMING_*): every time figure below was taken so.
        "timing": timing_of(runs),
        "date": datetime.date.today().isoformat(),
        "seeds": sorted({r["seed"] for r in runs}),
        "trainer_args": trainer_args,
        "lora": LORA,
        "grpo_rise": rise,
        "elapsed_s": elapsed,
        "results": without_per_seed(rows),
        "per_seed": {r["method"]: r["per_seed"] for r in rows},
        "runs_file": runs_file.name,
        "audit_check": check,
        "prefix_sharing": sharing,
        # How prompts move between visits, per method (harness.targets.revisit_outcomes; records with groups only).
        "revisits": {row["method"]: revisit_outcomes([r for r in runs if r["method"] == row["method"]])
                     for row in rows},
        # A probe of 1, 2 and 4 completions as a predictor of a flat group (harness.targets.probe_prediction).
        "probe_prediction": {row["method"]: probe_prediction([r for r in runs if r["method"] == row["method"]])
                             for row in rows if row["method"] in CUT},
        "projection": project,
        "projection_sources": {"phases_of": args.phases_of, "generation_of": args.generation_of,
                               "phases_timing": (read_json(args.phases_of).get("timing", TIMING_ONE_AFTER_THE_OTHER)
                                                 if args.phases_of else None),
                               "paper_speedup": PAPER_SPEEDUP,
                               "typical_gpu_generation_share": TYPICAL_GPU_GENERATION_SHARE},
        "plots": plots,
    })
    print(f"wrote {out} ({elapsed:.0f} s in all)")
    return rows


if __name__ == "__main__":
    main()
