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

The training phase per generation is timed apart, in turns (``timing``: every method a few generation batches, one
optimizer step at a time each, in processes of their own, ``harness.interleave``), its ratio to GRPO ``mu = 1``'s
per seed. ``report`` summarizes every recorded seed (``benchmarks/results/bench_reuse.json``): per row the
generation batches to 90% of GRPO ``mu = 1``'s rise (held-out score and training reward) over GRPO's, the held-out
final difference with its 95% CI, the training ratio per generation, and the projected time ratio
``generations ratio x (s + (1 - s) x training ratio)`` at generation shares ``s`` 0.5, 0.7 and 0.9, with plots.

    python benchmarks/bench_reuse.py run --seeds 0 --methods grpo@mu2 dppo@mu4    # one seed's runs, recorded
    python benchmarks/bench_reuse.py run --seeds 0 --vllm                            # vLLM generating (its venv)
    python benchmarks/bench_reuse.py timing --seeds 0                                # the training phase, in turns
    python benchmarks/bench_reuse.py report --plots docs/images                      # the summary JSON and plots
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import mean_se, pm, read_json, reasoning_gym_setup, run_methods, text_table, write_json  # noqa: E402
from harness.targets import heldout_points, step_phases, target_figures  # noqa: E402
from harness.training import GRPO_TRAINER, TIMING_IN_TURNS, generation_progress  # noqa: E402

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
SHARES = (0.5, 0.7, 0.9)  # generation's share of GRPO (mu = 1)'s step, for the projection
WINDOW = 8  # generation batches in the training reward's trailing mean (bench_real's)
BASE = "grpo"  # every ratio is to GRPO at mu = 1, same seed
# The targets (issue 49) at a 70% generation share: the best DPPO row's projected time at most 0.42 of GRPO's
# (mu = 1; 2.37x, the paper's figure) with a non-inferior held-out score, and at most 0.75 of GRPO's best row.
TARGET_SHARE, TARGET_VS_GRPO, TARGET_VS_GRPO_BEST = 0.7, 0.42, 0.75


def iterations_of(method: str) -> int:
    return (METHODS[method] or {}).get("num_iterations", 1)


def setup_of(args) -> dict:
    """bench_real's setup, with ``steps`` counting generation batches and the held-out score every
    ``--eval-every`` generation batches."""
    setup = reasoning_gym_setup(
        task="chain_sum", answer_format="last_number", task_seed=0, train_prompts=args.train_prompts,
        heldout=args.heldout, eval_every=args.eval_every, steps=args.generations,
        prompts_per_step=args.prompts_per_step, max_completion_length=args.max_completion_length,
        learning_rate=LEARNING_RATE, vllm=args.vllm, generations=args.group_size,
    )
    setup["progress"] = generation_progress
    return setup


def records_path(folder, seed, vllm: bool, kind: str = "reuse", part: str = "") -> Path:
    """A seed's records: ``kind`` (``reuse``: learning runs; ``timing``: runs in turns), a process's ``part``."""
    return Path(folder) / f"{kind}{'_vllm' if vllm else ''}_seed{seed}{'-' + part if part else ''}_runs.json"


def run(args) -> None:
    torch.set_num_threads(args.threads)
    setup = setup_of(args)
    for seed in args.seeds:
        path = records_path(args.records, seed, args.vllm, part=args.part)
        started = time.perf_counter()
        saved = read_json(path) if path.exists() else None
        if saved is not None and saved["trainer_args"] != setup["trainer_args"]:
            raise SystemExit(f"{path}: recorded with other trainer settings; move it away to run afresh")
        elapsed = saved["elapsed_s"] if saved else 0.0
        # The runs of this seed already recorded in any part (another process may be adding to its own part).
        parts = sorted(glob.glob(str(records_path(args.records, seed, args.vllm, part="*")))) + [str(path)]
        done = [r for part in parts if Path(part).exists() for r in read_json(part)["runs"]]

        def save(runs):
            mine = [r for r in runs if r["method"] in args.methods]
            write_json(path, {"runs": mine, "trainer_args": setup["trainer_args"],
                              "elapsed_s": elapsed + time.perf_counter() - started}, compact=True)

        run_methods({name: METHODS[name] for name in args.methods}, [seed], setup, runs=done, started=started,
                    after_run=save, label="reuse ")


def timing(args) -> None:
    """Each seed's methods in turns (one optimizer step each, in processes of their own), ``--generations`` generation
    batches each (the first one's first-call costs left out: ``training_seconds_per_generation``), recorded under
    ``timing_seed*_runs.json`` (a ``--part`` of its own for each group of methods: every group holds ``grpo``, the
    base of its ratios, so that processes kept alive in turns fit in memory)."""
    if BASE not in args.methods:
        raise SystemExit(f"--methods must include {BASE}: every training ratio is to its run in the same turns")
    setup = {**setup_of(args), "evaluate": None}
    for seed in args.seeds:
        path = records_path(args.records, seed, args.vllm, "timing", args.part)
        started = time.perf_counter()
        runs = run_methods({name: METHODS[name] for name in args.methods}, [seed], setup, started=started,
                           label="timing ", in_turns=True, threads=args.threads)
        write_json(path, {"runs": runs, "trainer_args": setup["trainer_args"],
                          "elapsed_s": time.perf_counter() - started}, compact=True)


def in_generations(run: dict) -> dict:
    """``run`` with every step counted in generation batches (optimizer steps over its ``num_iterations``), so that
    ``target_figures``' steps to a target are generation batches to it."""
    mu = iterations_of(run["method"])
    return dict(
        run,
        steps=[dict(s, step=s["step"] // mu) for s in run["steps"] if s["step"] % mu == 0],
        generations=[dict(g, step=g["step"] // mu) for g in run["generations"]],
        evals=[dict(e, step=e["step"] // mu) for e in run["evals"]],
    )


def load_runs(args, trainer_args: dict) -> tuple[list[dict], float]:
    """Every recorded learning run, one per (method, seed): this benchmark's, and bench_real's ``grpo`` and ``dppo``
    (``mu = 1``) with the same trainer settings; and the seconds this benchmark's records took."""
    tag = "_vllm" if args.vllm else ""
    runs, elapsed = {}, 0.0
    for path in sorted(glob.glob(str(records_path(args.records, "*", args.vllm)))):
        saved = read_json(path)
        if saved["trainer_args"] != trainer_args:
            raise SystemExit(f"{path}: other trainer settings than this benchmark's")
        elapsed += saved["elapsed_s"]
        for run in saved["runs"]:
            runs.setdefault((run["method"], run["seed"]), run)
    for path in sorted(glob.glob(str(Path(args.learning_records) / f"real{tag}_seed*_runs.json"))):
        saved = read_json(path)
        if saved["trainer_args"] != trainer_args:
            continue
        for run in saved["runs"]:
            if run["method"] in ("grpo", "dppo"):
                runs.setdefault((run["method"], run["seed"]), run)
    return [in_generations(run) for run in runs.values()], elapsed


def training_seconds_per_generation(run: dict) -> float:
    """A run's seconds a generation batch outside generation (log-prob passes, loss, the rest), after its first."""
    mu = iterations_of(run["method"])
    steps = [step_phases(s) for s in run["steps"]][mu:]
    return sum(s["logps"] + s["loss"] + s["rest"] for s in steps) / (len(steps) / mu)


def training_ratios(args) -> tuple[dict, list[int], float]:
    """{method: (mean, SE) over the runs in turns of its training seconds a generation over GRPO (mu = 1)'s in the
    same turns (one record a seed and group of methods), the seeds and the seconds they took."""
    per_method, seeds, elapsed = {}, set(), 0.0
    for path in sorted(glob.glob(str(records_path(args.records, "*", args.vllm, "timing")))):
        saved = read_json(path)
        elapsed += saved["elapsed_s"]
        by = {r["method"]: r for r in saved["runs"] if r.get("timing") == TIMING_IN_TURNS}
        if BASE not in by:
            continue
        seeds.add(by[BASE]["seed"])
        base = training_seconds_per_generation(by[BASE])
        for method, run in by.items():
            per_method.setdefault(method, []).append(training_seconds_per_generation(run) / base)
    return {m: mean_se(v) for m, v in per_method.items()}, sorted(seeds), elapsed


def summary_rows(runs: list[dict], training: dict) -> list[dict]:
    """One row per method with runs: learning per generation against GRPO (mu = 1) and the training ratio."""
    rows = []
    for method in METHODS:
        if not any(r["method"] == method for r in runs):
            continue
        figures = target_figures(runs, method, WINDOW, base_method=BASE)
        row = {"method": method.split("@")[0], "name": method, "num_iterations": iterations_of(method),
               "learning_rate": (METHODS[method] or {}).get("learning_rate", LEARNING_RATE),
               "seeds": figures["seeds"]}
        for ours, theirs in (("heldout_generations_to_90_ratio", "heldout_steps_to_90_ratio"),
                             ("generations_to_90_ratio", "steps_to_90_ratio")):
            for suffix in ("_mean", "_se", "_reached", "_per_seed"):
                row[ours + suffix] = figures[theirs + suffix]
        for key in ("heldout_final_diff_mean", "heldout_final_diff_se", "heldout_final_diff_ci",
                    "heldout_non_inferior"):
            row[key] = figures[key]
        finals = [r["evals"][-1]["accuracy"] for r in runs if r["method"] == method]
        row["heldout_final_mean"], row["heldout_final_se"] = mean_se(finals)
        row["training_ratio_per_generation"] = list(training[method]) if method in training else None
        rows.append(row)
    return rows


def projection_rows(rows: list[dict]) -> list[dict]:
    """Per row and share ``s``: generations ratio (held-out) x (s + (1 - s) x training ratio per generation), its
    SE to first order; rows without both factors are left out."""
    out = []
    for row in rows:
        generations = (row["heldout_generations_to_90_ratio_mean"], row["heldout_generations_to_90_ratio_se"])
        training = row["training_ratio_per_generation"]
        if generations[0] is None or training is None:
            continue
        for share in SHARES:
            step = share + (1 - share) * training[0]
            step_se = (1 - share) * training[1]
            out.append({"method": row["method"], "num_iterations": row["num_iterations"], "name": row["name"],
                        "generation_share": share, "time_ratio": generations[0] * step,
                        "time_ratio_se": ((generations[1] * step) ** 2 + (generations[0] * step_se) ** 2) ** 0.5})
    return out


def verdict(rows: list[dict], projection: list[dict]) -> dict | None:
    """The issue's targets at ``TARGET_SHARE``: the best DPPO row against GRPO (mu = 1) and GRPO's best row; a row
    wins where it is non-inferior on the held-out score and faster."""
    at = {p["name"]: p for p in projection if p["generation_share"] == TARGET_SHARE}
    by = {r["name"]: r for r in rows}
    dppo = [n for n in at if by[n]["method"] == "dppo" and by[n]["heldout_non_inferior"]]
    grpo = [n for n in at if by[n]["method"] == "grpo" and n != "grpo@2lr"]
    if not dppo or not grpo:
        return None
    best, grpo_best = min(dppo, key=lambda n: at[n]["time_ratio"]), min(grpo, key=lambda n: at[n]["time_ratio"])
    ratio_to_best = at[best]["time_ratio"] / at[grpo_best]["time_ratio"]
    return {"generation_share": TARGET_SHARE, "dppo_best": best, "dppo_best_time_ratio": at[best]["time_ratio"],
            "dppo_best_time_ratio_se": at[best]["time_ratio_se"], "grpo_best": grpo_best,
            "grpo_best_time_ratio": at[grpo_best]["time_ratio"], "dppo_best_over_grpo_best": ratio_to_best,
            "target_vs_grpo": TARGET_VS_GRPO, "target_vs_grpo_best": TARGET_VS_GRPO_BEST,
            "met": at[best]["time_ratio"] <= TARGET_VS_GRPO and ratio_to_best <= TARGET_VS_GRPO_BEST}


def _ratio_cell(row: dict, key: str) -> str:
    return f"{pm(row[key + '_mean'], row[key + '_se'], 2)} ({row[key + '_reached']})"


def _difference_cell(row: dict) -> str:
    ci = row["heldout_final_diff_ci"]
    return "-" if ci is None else f"{row['heldout_final_diff_mean']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"


COLUMNS = [
    ("row", -10, "name:"),
    ("seeds", 6, lambda r: str(len(r["seeds"]))),
    ("held-out gens to 90%", 22, lambda r: _ratio_cell(r, "heldout_generations_to_90_ratio")),
    ("reward gens to 90%", 22, lambda r: _ratio_cell(r, "generations_to_90_ratio")),
    ("held-out final - GRPO [95% CI]", 32, _difference_cell),
    ("train/gen over GRPO", 20, lambda r: "-" if r["training_ratio_per_generation"] is None else
     pm(*r["training_ratio_per_generation"], 2)),
]


def plot(runs: list[dict], rows: list[dict], projection: list[dict], directory: str, tag: str) -> list[str]:
    """The held-out score (mean over seeds) against generation batches and against projected time at s = 0.7."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at = {p["name"]: p for p in projection if p["generation_share"] == TARGET_SHARE}
    training = {r["name"]: r["training_ratio_per_generation"] for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in rows:
        curves = [heldout_points(r) for r in runs if r["method"] == row["name"]]
        length = min(len(c[0]) for c in curves)
        x = curves[0][0][:length]
        y = [statistics.mean(c[2][i] for c in curves) for i in range(length)]
        style = dict(ls="-" if row["method"] == "dppo" else "--", marker="o", ms=3,
                     label=f"{row['name']} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        axes[0].plot(x, y, **style)
        if row["name"] in at and training[row["name"]] is not None:
            step = TARGET_SHARE + (1 - TARGET_SHARE) * training[row["name"]][0]  # GRPO mu = 1's step: 1
            axes[1].plot([g * step for g in x], y, **style)
    axes[0].set(xlabel="generation batches", ylabel="held-out score (sampled)",
                title=f"Held-out score per generation (mean of seeds)")
    axes[1].set(xlabel=f"projected time, GRPO (mu = 1) steps at a {TARGET_SHARE:.0%} generation share",
                title="Held-out score against projected time")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # the time panel is empty where no row has both factors
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(directory) / f"bench_reuse{tag}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def report(args) -> dict:
    setup = setup_of(args)
    runs, elapsed = load_runs(args, setup["trainer_args"])
    training, timing_seeds, timing_elapsed = training_ratios(args)
    rows = summary_rows(runs, training)
    projection = projection_rows(rows)
    tag = "_vllm" if args.vllm else ""
    summary = {
        "config": {"task": "chain_sum", "generations": args.generations, "eval_every": args.eval_every,
                   "window": WINDOW, "learning_rate": LEARNING_RATE, "vllm": args.vllm,
                   "methods": {name: METHODS[name] for name in METHODS}},
        "date": datetime.date.today().isoformat(),
        "trainer_args": setup["trainer_args"],
        "learning": "one after the other (learning per generation does not depend on the machine)",
        "timing": TIMING_IN_TURNS, "timing_seeds": timing_seeds,
        "elapsed_s": elapsed + timing_elapsed,
        "results": rows, "projection": projection, "verdict": verdict(rows, projection),
    }
    if args.plots:
        summary["plots"] = plot(runs, rows, projection, args.plots, tag)
    print(f"Learning per generation, SmolLM2-135M-Instruct + LoRA on chain_sum{', vLLM' if args.vllm else ''}: "
          f"ratios to GRPO (mu = 1), mean ± SE over seeds")
    print(text_table(rows, COLUMNS))
    for name in dict.fromkeys(p["name"] for p in projection):
        print(f"{name:<10}" + "".join(f"  s={p['generation_share']:.1f}: {pm(p['time_ratio'], p['time_ratio_se'], 2)}"
                                      for p in projection if p["name"] == name))
    write_json(args.json or Path("benchmarks/results") / f"bench_reuse{tag}.json", summary)
    return summary


def main(argv=None):
    common = argparse.ArgumentParser(add_help=False)  # the protocol (bench_real's) and where records live
    common.add_argument("--vllm", action="store_true", help="generate with vLLM colocated (the vLLM lane's venv)")
    common.add_argument("--train-prompts", type=int, default=32)
    common.add_argument("--heldout", type=int, default=128)
    common.add_argument("--prompts-per-step", type=int, default=4)
    common.add_argument("--group-size", type=int, default=8, help="completions per prompt (num_generations)")
    common.add_argument("--max-completion-length", type=int, default=16)
    common.add_argument("--records", default=str(RECORDS), help="the per-seed records' folder")
    common.add_argument("--learning-records", default=str(LEARNING_RECORDS),
                        help="bench_real's learning records, read for the mu = 1 rows")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", parents=[common], help="train and record each seed's runs (recorded ones kept)")
    runner.add_argument("--seeds", nargs="+", type=int, required=True)
    runner.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in ("grpo", "dppo")],
                        choices=list(METHODS))
    runner.add_argument("--generations", type=int, default=40, help="generation batches of every method")
    runner.add_argument("--eval-every", type=int, default=4, help="generation batches between held-out scores")
    runner.add_argument("--threads", type=int, default=1)
    runner.add_argument("--part", default="", help="a name for this process's records of the seed (processes side by "
                        "side each write their own part; every part is read)")
    timer = sub.add_parser("timing", parents=[common], help="the training phase per generation, methods in turns")
    timer.add_argument("--seeds", nargs="+", type=int, required=True)
    timer.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    timer.add_argument("--generations", type=int, default=4, help="timed generation batches of every method")
    timer.add_argument("--eval-every", type=int, default=10**6)
    timer.add_argument("--threads", type=int, default=1)
    timer.add_argument("--part", default="", help="a name for this group's record (groups of methods, each with grpo)")
    summary = sub.add_parser("report", parents=[common], help="summarize every recorded seed (the JSON and plot)")
    summary.add_argument("--generations", type=int, default=40)
    summary.add_argument("--eval-every", type=int, default=4)
    summary.add_argument("--plots", default=None, help="directory for the PNG plot (e.g. docs/images)")
    summary.add_argument("--json", default=None, help="default: benchmarks/results/bench_reuse[_vllm].json")
    args = parser.parse_args(argv)
    return {"run": run, "timing": timing, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
