"""End-to-end benchmark: GRPO (TRL's trainer), DPPO, DPPO with prompt pruning, and the biased baselines
`topk` (CPPO's rule) and `zero_variance` (DAPO-style filter), trained with the same data budget on the
offline toy task of `make demo` (warm-started tiny Qwen2, two-digit addition, exact-answer reward).

Per step it records the wall time split into generation / scoring and log-prob passes / loss forward+backward
(+ optimizer), the tokens generated and trained, and the sampled reward; it evaluates greedy held-out accuracy
at fixed steps (outside the clock). It prints a table of ratios to GRPO measured in the same run, the time to
reach GRPO's final reward, the final held-out accuracy with its spread over seeds, and writes JSON (and PNG
plots with ``--plots``). Single-threaded torch; one warm-up run; methods interleaved within each seed.

    make bench                                   # main comparison + keep-rate sweeps, plots in docs/
    python benchmarks/bench_e2e.py --seeds 0 1 --steps 512 --sweeps --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# DPPOConfig settings of each method; None is TRL's own GRPOConfig + GRPOTrainer.
METHODS = {
    "grpo": None,
    "dppo": dict(completion_keep_rate=0.5),
    "dppo+prompt": dict(completion_keep_rate=0.5, prompt_keep_rate=0.5),
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
PHASES = ("generation", "scoring", "loss", "other")
PHASE_LABELS = {
    "generation": "generation",
    "scoring": "rewards + log-prob passes",
    "loss": "loss forward + backward",
    "other": "optimizer, logging, other",
}


def timed(trainer_cls):
    """A subclass of ``trainer_cls`` that clocks TRL's phases: ``_generate`` (rollouts), the rest of
    ``_generate_and_score_completions`` (rewards, advantages, log-prob passes, DPPO's pruning), and the rest
    of ``training_step`` (loss forward + backward). It also records each generation batch's reward and tokens."""

    class Timed(trainer_cls):
        def _bench_reset(self):
            self.bench_phase = dict.fromkeys(PHASES[:-1], 0.0)
            self.bench_generations = []
            self._bench_prompt_weights = None

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.bench_phase["generation"] += time.perf_counter() - start

        def _take_prompt_decision(self, inputs, scores):
            weights, normalizer = super()._take_prompt_decision(inputs, scores)
            self._bench_prompt_weights = weights.detach().double().cpu()
            return weights, normalizer

        def _generate_and_score_completions(self, inputs):
            start, generation_before = time.perf_counter(), self.bench_phase["generation"]
            output = super()._generate_and_score_completions(inputs)
            total = time.perf_counter() - start
            self.bench_phase["scoring"] += total - (self.bench_phase["generation"] - generation_before)
            self.bench_phase["loss"] -= total  # training_step's clock below contains this call
            self._bench_record_generation(output)
            return output

        def training_step(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super().training_step(*args, **kwargs)
            finally:
                self.bench_phase["loss"] += time.perf_counter() - start

        def _bench_record_generation(self, output):
            rewards = self._bench_rewards.float().cpu()
            completion_tokens = output["completion_mask"].sum(1).float().cpu()
            width = output["completion_mask"].size(1)
            sequence_tokens = completion_tokens + output["prompt_mask"].sum(1).float().cpu()
            keep = output.get("dppo_keep")
            keep = torch.ones_like(rewards, dtype=torch.bool) if keep is None else keep.cpu()
            weights = self._bench_prompt_weights
            self._bench_prompt_weights = None
            spread = rewards.view(-1, self.num_generations)
            zero_variance = float((spread.amax(1) == spread.amin(1)).float().mean())
            # With prompt pruning the generated prompts are a weighted sample: the Hajek estimate (weights
            # q_bar / q) is the reward of the policy on the whole training set, comparable with GRPO's.
            population = float((weights * rewards).sum() / weights.sum()) if weights is not None else None
            self.bench_generations.append(
                {
                    "step": self.state.global_step,
                    "reward": float(rewards.mean()),
                    "population_reward": population if population is not None else float(rewards.mean()),
                    "zero_variance_groups": zero_variance,
                    "completions": int(rewards.numel()),
                    "padded_tokens": float(rewards.numel() * (output["prompt_mask"].size(1) + width)),
                    "kept_completions": int(keep.sum()),
                    "completion_tokens": float(completion_tokens.sum()),
                    "trained_sequence_tokens": float(sequence_tokens[keep].sum()),
                    "sequence_tokens": float(sequence_tokens.sum()),
                }
            )

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            weights = self.reward_weights.to(rewards_per_func.device)
            rank = self.accelerator.process_index
            local = slice(rank * len(prompts), (rank + 1) * len(prompts))  # TRL gathered every rank's rows
            self._bench_rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)[local]
            return rewards_per_func

    Timed.__name__ = f"Timed{trainer_cls.__name__}"
    return Timed


def bench_callback(trainer, evaluate, eval_every, budget, progress=None):
    """Per-step wall clock (evaluation excluded), phase split, and held-out accuracy each time ``progress``
    (optimizer steps by default; a function of the trainer, e.g. GRPO-equivalent steps of data walked) passes a
    multiple of ``eval_every``, at the start, at the step budget and at the end."""
    progress = progress or (lambda trainer: trainer.state.global_step)
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.steps, self.evals, self.excluded = [], [], 0.0

        def _evaluate(self, state):
            if evaluate is None:
                return
            start = time.perf_counter()
            model = trainer.accelerator.unwrap_model(trainer.model)
            was_training = model.training
            model.eval()
            result = evaluate(model)  # a float, or a dict with the main figure under "accuracy"
            model.train(was_training)
            self.excluded += time.perf_counter() - start
            self.evals.append({"step": state.global_step, "progress": progress(trainer), "wall": self.wall(),
                               **(result if isinstance(result, dict) else {"accuracy": result})})  # fmt: skip

        def wall(self):
            return time.perf_counter() - self.start - self.excluded

        def on_train_begin(self, args, state, control, **kwargs):
            trainer._bench_reset()
            self.start = time.perf_counter()
            self.last_phase = dict(trainer.bench_phase)
            self.last_wall, self.next_eval = 0.0, eval_every
            self._evaluate(state)

        def on_step_end(self, args, state, control, **kwargs):
            wall = self.wall()
            phase = {k: trainer.bench_phase[k] - self.last_phase[k] for k in trainer.bench_phase}
            phase["other"] = (wall - self.last_wall) - sum(phase.values())
            self.steps.append({"step": state.global_step, "wall": wall, "seconds": wall - self.last_wall, **phase})
            self.last_phase, self.last_wall = dict(trainer.bench_phase), wall
            if progress(trainer) >= self.next_eval or state.global_step == budget:
                self._evaluate(state)
                while self.next_eval <= progress(trainer):
                    self.next_eval += eval_every

        def on_train_end(self, args, state, control, **kwargs):
            if not self.evals or self.evals[-1]["step"] != state.global_step:
                self._evaluate(state)

    return Clock()


def run_one(name, settings, seed, setup):
    """Train one method (``settings``: DPPOConfig fields, None for TRL's GRPO) from ``setup["model_dir"]`` for
    ``setup["steps"]`` optimizer steps (pruned methods go on for ``setup["extension"]`` more, used only to see
    when they reach GRPO's final reward), or for ``setup["epochs"]`` epochs where given; return its per-step,
    per-generation and evaluation records."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.hooks.callbacks import DPPOSummaryCallback

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="dppo-bench-"),
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
        logging_steps=10**6,
        seed=seed,
        **(
            dict(num_train_epochs=setup["epochs"])  # the epoch protocol (bench_reasoning.py): no step budget
            if setup.get("epochs")
            else dict(max_steps=setup["steps"] + (setup["extension"] if settings is not None else 0))
        ),
        **setup["trainer_args"],
    )
    if settings is None:
        trainer_cls, args = timed(GRPOTrainer), GRPOConfig(**common)
    else:
        trainer_cls, args = timed(DPPOTrainer), DPPOConfig(**common, **settings)
    trainer = trainer_cls(
        setup["model_dir"],
        setup["reward_funcs"],
        args=args,
        train_dataset=setup["train_dataset"],
        **setup.get("trainer_kwargs", {}),  # e.g. peft_config (bench_real.py)
    )
    evaluate = setup.get("evaluate")
    if evaluate is not None:
        evaluate = functools.partial(evaluate, tokenizer=trainer.processing_class)
    clock = bench_callback(trainer, evaluate, setup["eval_every"], setup.get("steps"), setup.get("progress"))
    trainer.add_callback(clock)
    for quiet in (PrinterCallback, ProgressCallback, DPPOSummaryCallback):  # the table is the report
        trainer.remove_callback(quiet)
    torch.manual_seed(seed)
    trainer.train()
    return {
        "method": name,
        "settings": settings,
        "seed": seed,
        "budget": setup.get("steps"),
        "steps": clock.steps,
        "generations": trainer.bench_generations,
        "evals": clock.evals,
    }


def trailing_mean(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def reward_curve(run, window, last_step=None):
    """(wall seconds at the end of the generation's steps, trailing-mean population reward) per generation,
    up to ``last_step``."""
    walls = {s["step"]: s["wall"] for s in run["steps"]}
    steps = [g["step"] for g in run["generations"]]
    ends = steps[1:] + [run["steps"][-1]["step"]]
    smoothed = trailing_mean([g["population_reward"] for g in run["generations"]], window)
    last_step = run["steps"][-1]["step"] if last_step is None else last_step
    return tuple(zip(*[(walls.get(max(end, 1), 0.0), v) for end, v in zip(ends, smoothed) if end <= last_step]))


def time_to(curve, target):
    """First wall time at which the curve reaches ``target`` (None if it never does)."""
    for wall, value in zip(*curve):
        if value >= target - 1e-12:
            return wall
    return None


def summarize(runs, methods, window):
    """One row per method: medians over seeds of step time, phase split, tokens, ratios to GRPO (per seed,
    same run), time to GRPO's final reward, and final held-out accuracy (mean and spread over seeds). All
    read at the common step budget, except the time to target, which may use the extension."""
    by = {(r["method"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for method in methods:
        per_seed = []
        for seed in seeds:
            run, base = by.get((method, seed)), by.get(("grpo", seed))
            if run is None or base is None:
                continue
            budget = run["budget"]
            steps = [s for s in run["steps"] if s["step"] <= budget]
            base_steps = [s for s in base["steps"] if s["step"] <= budget]
            base_curve = reward_curve(base, window, budget)
            target = base_curve[1][-1]
            total = steps[-1]["wall"]
            phases = {p: sum(s[p] for s in steps) for p in PHASES}
            base_phases = {p: sum(s[p] for s in base_steps) for p in PHASES}
            reach, base_reach = time_to(reward_curve(run, window), target), time_to(base_curve, target)
            gens = [g for g in run["generations"] if g["step"] < budget]
            evals = [e for e in run["evals"] if e["step"] <= budget]
            per_seed.append(
                {
                    "steps": len(steps),
                    "total_s": total,
                    "step_s": statistics.median(s["seconds"] for s in steps),
                    "total_ratio": total / base_steps[-1]["wall"],
                    "training_phase_ratio": (phases["scoring"] + phases["loss"])
                    / (base_phases["scoring"] + base_phases["loss"]),
                    "phases": phases,
                    "kept_fraction": sum(g["kept_completions"] for g in gens) / sum(g["completions"] for g in gens),
                    "trained_tokens": sum(g["trained_sequence_tokens"] for g in gens),
                    "generated_completions": sum(g["completions"] for g in gens),
                    "target_reward": target,
                    "final_reward": reward_curve(run, window, budget)[1][-1],
                    "time_to_target_ratio": reach / base_reach if reach is not None and base_reach else None,
                    "accuracy_start": evals[0]["accuracy"] if evals else None,
                    "accuracy_final": evals[-1]["accuracy"] if evals else None,
                }
            )
        if not per_seed:
            continue
        med = lambda key: statistics.median(p[key] for p in per_seed)  # noqa: E731
        reached = [p["time_to_target_ratio"] for p in per_seed if p["time_to_target_ratio"] is not None]
        accuracies = [p["accuracy_final"] for p in per_seed if p["accuracy_final"] is not None]
        rows.append(
            {
                "method": method,
                "seeds": len(per_seed),
                "steps": med("steps"),
                "step_s": med("step_s"),
                "total_s": med("total_s"),
                "total_ratio": med("total_ratio"),
                "training_phase_ratio": med("training_phase_ratio"),
                "phase_share": {p: statistics.median(s["phases"][p] / s["total_s"] for s in per_seed) for p in PHASES},
                "kept_fraction": med("kept_fraction"),
                "generated_completions": med("generated_completions"),
                "trained_tokens": med("trained_tokens"),
                "final_reward": med("final_reward"),
                "time_to_target_ratio": statistics.median(reached) if reached else None,
                "reached_target": f"{len(reached)}/{len(per_seed)}",
                "accuracy_start": med("accuracy_start") if accuracies else None,
                "accuracy_mean": statistics.mean(accuracies) if accuracies else None,
                "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                "per_seed": per_seed,
            }
        )
    return rows


def print_table(rows, title):
    print(f"\n{title}")
    header = (
        f"{'method':<16}{'steps':>6}{'s/step':>8}{'total s':>9}{'total/GRPO':>11}{'train/GRPO':>11}"
        f"{'to target':>10}{'reached':>8}{'kept':>6}{'reward':>8}{'held-out acc':>16}  gen/score/loss/other"
    )
    print(header)
    for r in rows:
        target = f"{r['time_to_target_ratio']:.2f}" if r["time_to_target_ratio"] is not None else "-"
        share = "/".join(f"{r['phase_share'][p]:.2f}" for p in PHASES)
        accuracy = f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f}" if r["accuracy_mean"] is not None else "-"
        print(
            f"{r['method']:<16}{r['steps']:>6.0f}{r['step_s']:>8.3f}{r['total_s']:>9.1f}{r['total_ratio']:>11.3f}"
            f"{r['training_phase_ratio']:>11.3f}{target:>10}{r['reached_target']:>8}{r['kept_fraction']:>6.2f}"
            f"{r['final_reward']:>8.3f}{accuracy:>16}  {share}"
        )


def seed_mean(curves):
    """Element-wise mean of (x, y) curves of equal layout (one per seed), cut to the shortest."""
    size = min(len(x) for x, _ in curves)
    return tuple([statistics.mean(c[k][i] for c in curves) for i in range(size)] for k in (0, 1))


def plot(runs, rows, methods, window, directory, prefix, eval_label="greedy held-out accuracy"):
    """Reward and held-out accuracy vs wall time (each the mean over seeds, point by point) and the phase
    breakdown; PNG files under ``directory``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        walls, reward = seed_mean([reward_curve(r, window) for r in mine])
        axes[0].plot(walls, reward, color=colors[method], lw=1.4, label=method)
        walls, accuracy = seed_mean(
            [([e["wall"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]]) for r in mine]
        )
        axes[1].plot(walls, accuracy, marker="o", ms=3, color=colors[method], lw=1.4, label=method)
    seeds = len({r["seed"] for r in runs})
    axes[0].set(xlabel="wall seconds (evaluation excluded)", title=f"Reward vs wall time (mean of {seeds} seeds)",
                ylabel=f"sampled reward (trailing mean of {window} batches)")  # fmt: skip
    axes[1].set(xlabel="wall seconds (evaluation excluded)", ylabel=eval_label,
                title=f"Held-out evaluation vs wall time (mean of {seeds} seeds)")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = directory / f"{prefix}_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = [r["method"] for r in rows]
    left = [0.0] * len(rows)
    for phase in PHASES:
        widths = [statistics.median(s["phases"][phase] for s in r["per_seed"]) for r in rows]
        ax.barh(names, widths, left=left, label=PHASE_LABELS[phase])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set(xlabel="seconds (median over seeds)", title="Where the time goes (same number of optimizer steps)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    fig.tight_layout()
    path = directory / f"{prefix}_breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    return written


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--sweeps", nargs="*", default=list(SWEEPS), choices=list(SWEEPS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--sweep-seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=768, help="the budget: optimizer steps of every method")
    parser.add_argument("--extension", type=float, default=0.25,
                        help="fraction of --steps the pruned methods go on for, only to see when they reach the "
                        "target; every other figure is read at --steps")  # fmt: skip
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
    parser.add_argument("--json", default="benchmarks/results/bench_e2e.json")
    parser.add_argument("--plots", default=None, help="directory for PNG plots (e.g. docs/images)")
    parser.add_argument("--from-json", default=None, help="train nothing: print the tables and plot a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        return replot(args.from_json, args.plots)
    torch.set_num_threads(1)
    started = time.perf_counter()

    setup = prepare_setup(args)
    for _ in range(args.warmup):  # first-call costs (imports, kernels) land here, not in GRPO's first run
        warm = dict(setup, steps=2, extension=0)
        run_one("warmup", METHODS["dppo"], 0, warm)

    groups = {"methods": {m: METHODS[m] for m in args.methods}}
    for sweep in args.sweeps:
        groups[sweep] = {"grpo": None, **SWEEPS[sweep]}
    runs, tables = [], {}
    for group, methods in groups.items():
        seeds = args.seeds if group == "methods" else args.sweep_seeds
        for seed in seeds:
            for name, settings in methods.items():
                if any(r["method"] == name and r["seed"] == seed for r in runs):
                    continue
                cached = [r for r in runs if r["seed"] == seed and r["settings"] == settings]
                if cached:  # the same settings under another name (e.g. keep=0.5 is `dppo`): reuse the run
                    runs.append(dict(cached[0], method=name))
                    continue
                run = run_one(name, settings, seed, setup)
                print(f"[{time.perf_counter() - started:7.0f} s] {group} {name} seed {seed}: "
                      f"{len(run['steps'])} steps, {run['steps'][-1]['wall']:.1f} s, "
                      f"held-out {run['evals'][0]['accuracy']:.3f} -> {run['evals'][-1]['accuracy']:.3f}",
                      flush=True)  # fmt: skip
                runs.append(run)
        names = ["grpo", *[m for m in methods if m != "grpo"]]
        group_runs = [r for r in runs if r["method"] in names and r["seed"] in seeds]
        tables[group] = summarize(group_runs, names, args.window)
        print_table(tables[group], f"{group} (seeds {seeds}, ratios to GRPO in the same run)")

    plots = []
    if args.plots:
        for group, rows in tables.items():
            names = [r["method"] for r in rows]
            seeds = args.seeds if group == "methods" else args.sweep_seeds
            group_runs = [r for r in runs if r["method"] in names and r["seed"] in seeds]
            plots += plot(group_runs, rows, names, args.window, args.plots, f"bench_{group}")
        print("plots: " + ", ".join(plots))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {group: [{k: v for k, v in r.items() if k != "per_seed"} for r in rows] for group, rows in tables.items()}
    runs_file = runs_path(out)
    runs_file.write_text(json.dumps(runs, separators=(",", ":")))  # per-step records: large, not committed
    saved = {
        "config": vars(args),
        "trainer_args": setup["trainer_args"],
        "elapsed_s": time.perf_counter() - started,
        "summary": summary,
        "tables": tables,
        "runs_file": runs_file.name,
        "plots": plots,
    }
    out.write_text(json.dumps(saved, indent=1))
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s in all)")
    return tables


def runs_path(summary_path: Path) -> Path:
    """Where the per-step records of a run saved at ``summary_path`` go (``*_runs.json``, git-ignored)."""
    return summary_path.with_name(summary_path.stem + "_runs.json")


def replot(summary_path, directory):
    """Tables (and plots, with ``directory``, from the per-step records beside it) of a run this program saved."""
    saved = json.loads(Path(summary_path).read_text())
    window = saved["config"]["window"]
    for group, rows in saved["tables"].items():
        print_table(rows, f"{group} ({saved['trainer_args']})")
        if directory:
            names = [r["method"] for r in rows]
            seeds = saved["config"]["seeds"] if group == "methods" else saved["config"]["sweep_seeds"]
            runs = json.loads(runs_path(Path(summary_path)).read_text())
            group_runs = [r for r in runs if r["method"] in names and r["seed"] in seeds]
            print(", ".join(plot(group_runs, rows, names, window, directory, f"bench_{group}")))
    return saved["tables"]


if __name__ == "__main__":
    main()
