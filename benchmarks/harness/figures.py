"""What a run's records give: curves (trailing means over generation batches or evaluations), the time a curve
takes to reach a target, the per-seed cost figures of a method against GRPO's run of the same seed, one summary row
per method over seeds, and means with standard errors."""

from __future__ import annotations

import math
import statistics

from .training import PHASES


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


def eval_curve(run, key="accuracy", window=1):
    """(wall times, trailing mean of ``key`` over ``window`` evaluations) of a run's held-out evaluations."""
    return [e["wall"] for e in run["evals"]], trailing_mean([e[key] for e in run["evals"]], window)


def time_to(curve, target):
    """First wall time at which the curve ``(walls, values)`` reaches ``target`` (None if it never does)."""
    for wall, value in zip(*curve):
        if value >= target - 1e-12:
            return wall
    return None


def time_to_target_ratio(curve, base_curve, target):
    """The time ``curve`` takes to reach ``target`` over the time ``base_curve`` takes (None if either never
    does)."""
    reach, base_reach = time_to(curve, target), time_to(base_curve, target)
    return reach / base_reach if reach is not None and base_reach else None


def cost_figures(steps, base_steps, generations, total_ratio="total_ratio"):
    """The cost side of one method in one seed, its ``steps`` and ``generations`` records against GRPO's
    ``base_steps``: wall seconds and their ratio to GRPO's (named ``total_ratio``), the training phase's ratio
    (scoring and log-prob passes + loss), the seconds per phase, the kept fraction, the trained tokens and the
    generated completions."""
    phases = {p: sum(s[p] for s in steps) for p in PHASES}
    base_phases = {p: sum(s[p] for s in base_steps) for p in PHASES}
    completions = sum(g["completions"] for g in generations)
    return {
        "total_s": steps[-1]["wall"],
        total_ratio: steps[-1]["wall"] / base_steps[-1]["wall"],
        "training_phase_ratio": (phases["scoring"] + phases["loss"]) / (base_phases["scoring"] + base_phases["loss"]),
        "phases": phases,
        "kept_fraction": sum(g["kept_completions"] for g in generations) / completions,
        "trained_tokens": sum(g["trained_sequence_tokens"] for g in generations),
        "generated_completions": completions,
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs, methods, figures, medians, finals=("accuracy",), extra=None):
    """One row per method of ``methods`` that has runs: ``figures(run, base)`` of each seed (``base`` GRPO's run
    of that seed), then over seeds the median of each of ``medians`` (None where no seed has it), the median phase
    shares, the median time-to-target ratio over the seeds that reached the target and how many did, the mean and
    standard deviation of each ``<name>_final`` of ``finals`` (``<name>_mean``, ``<name>_std``), the fields of
    ``extra(method, per_seed)``, and the per-seed figures themselves (``per_seed``)."""
    by = {(r["method"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for method in methods:
        per_seed = [figures(by[method, s], by["grpo", s]) for s in seeds if (method, s) in by and ("grpo", s) in by]
        if not per_seed:
            continue
        reached = [p["time_to_target_ratio"] for p in per_seed if p["time_to_target_ratio"] is not None]
        row = {
            "method": method,
            "seeds": len(per_seed),
            **{key: _median(p[key] for p in per_seed) for key in medians},
            "phase_share": {p: statistics.median(s["phases"][p] / s["total_s"] for s in per_seed) for p in PHASES},
            "time_to_target_ratio": statistics.median(reached) if reached else None,
            "reached_target": f"{len(reached)}/{len(per_seed)}",
        }
        for name in finals:
            values = [p[f"{name}_final"] for p in per_seed if p[f"{name}_final"] is not None]
            row[f"{name}_mean"] = statistics.mean(values) if values else None
            row[f"{name}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append({**row, **(extra(method, per_seed) if extra else {}), "per_seed": per_seed})
    return rows


BUDGET_MEDIANS = ("steps", "step_s", "total_s", "total_ratio", "training_phase_ratio", "kept_fraction",
                  "generated_completions", "trained_tokens", "final_reward", "accuracy_start")


def budget_figures(run, base, window):
    """One method's figures in one seed against GRPO's run ``base``, at the common step budget (``run_one``'s
    ``setup["steps"]``), except the time to GRPO's final reward (the trailing mean of ``window`` generation
    batches), which may use the extension."""
    budget = run["budget"]
    steps = [s for s in run["steps"] if s["step"] <= budget]
    base_curve = reward_curve(base, window, budget)
    target = base_curve[1][-1]
    evals = [e for e in run["evals"] if e["step"] <= budget]
    return {
        "steps": len(steps),
        **cost_figures(steps, [s for s in base["steps"] if s["step"] <= budget],
                       [g for g in run["generations"] if g["step"] < budget]),
        "step_s": statistics.median(s["seconds"] for s in steps),
        "target_reward": target,
        "final_reward": reward_curve(run, window, budget)[1][-1],
        "time_to_target_ratio": time_to_target_ratio(reward_curve(run, window), base_curve, target),
        "accuracy_start": evals[0]["accuracy"] if evals else None,
        "accuracy_final": evals[-1]["accuracy"] if evals else None,
    }


def summarize_at_budget(runs, methods, window):
    """``summarize`` of ``budget_figures``: one row per method, medians over seeds of step time, phase split,
    tokens, ratios to GRPO (per seed, same run), time to GRPO's final reward, and final held-out accuracy (mean
    and spread over seeds)."""
    return summarize(runs, methods, lambda run, base: budget_figures(run, base, window), BUDGET_MEDIANS)


def mean_se(values):
    """(mean, standard error of the mean) of ``values`` less the Nones (SE 0 for one value; (None, None) for
    none)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.mean(values), se


def pooled(stats):
    """Mean over seeds of per-seed (mean, SE) pairs, with the SE of that mean (independent seeds)."""
    means, ses = zip(*stats)
    return statistics.mean(means), math.sqrt(sum(se**2 for se in ses)) / len(ses)


def seed_mean(curves):
    """Element-wise mean of (x, y) curves of equal layout (one per seed), cut to the shortest."""
    size = min(len(x) for x, _ in curves)
    return tuple([statistics.mean(c[k][i] for c in curves) for i in range(size)] for k in (0, 1))
