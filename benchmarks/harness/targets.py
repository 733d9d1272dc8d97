"""The speedup split in two factors: how many steps a method needs to reach a target that is not a coin flip
(90% of GRPO's own rise, per seed), how long its steps take (per phase, from paired runs), and their product
projected to a machine where generation takes a share ``s`` of GRPO's step.

A run is ``run_one``'s record: ``generations`` (one per generation batch, its ``step`` and
``population_reward``), ``steps`` (the wall clock at each optimizer step) and ``evals`` (held-out scores at
their ``step``)."""

from __future__ import annotations

import statistics

from .figures import mean_se, trailing_mean

FRACTION = 0.9  # of GRPO's rise: the target
NON_INFERIORITY_MARGIN = 0.05  # of the held-out score: the interval's lower end must lie above -margin

def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def reward_points(run, window):
    """(steps, walls, values): the trailing mean of ``window`` generation batches' population reward, at the
    optimizer step by which each batch has been trained on, from the first full window on."""
    generations = run["generations"]
    walls = {s["step"]: s["wall"] for s in run["steps"]}
    ends = [g["step"] for g in generations[1:]] + [run["steps"][-1]["step"]]
    smoothed = trailing_mean([g["population_reward"] for g in generations], window)
    points = [(end, walls.get(end, 0.0), v) for i, (end, v) in enumerate(zip(ends, smoothed)) if i >= window - 1]
    return tuple(map(list, zip(*points))) if points else ([], [], [])


def heldout_points(run):
    """(steps, walls, scores) of a run's held-out evaluations."""
    return tuple([e[key] for e in run["evals"]] for key in ("step", "wall", "accuracy"))


def training_target(base, window, fraction=FRACTION):
    """``fraction`` of GRPO's rise on its training reward curve: from the mean of its first ``window`` batches to
    that of its last; None where it did not rise."""
    values = [g["population_reward"] for g in base["generations"]]
    start, end = statistics.mean(values[:window]), statistics.mean(values[-window:])
    return start + fraction * (end - start) if end > start else None


def heldout_target(base, fraction=FRACTION):
    """``fraction`` of GRPO's rise on the held-out score, from its first evaluation to its last; None where it
    did not rise."""
    start, end = base["evals"][0]["accuracy"], base["evals"][-1]["accuracy"]
    return start + fraction * (end - start) if end > start else None


def first_reach(points, target):
    """(step, wall) of the first point at or above ``target``; (None, None) if none is (or no target)."""
    if target is not None:
        for step, wall, value in zip(*points):
            if step > 0 and value >= target - 1e-12:
                return step, wall
    return None, None


def _ratio(a, b):
    return a / b if a is not None and b else None


def seed_targets(run, base, window):
    """One seed's figures of ``run`` against GRPO's run ``base``: steps and time to 90% of GRPO's rise, on the
    training reward and on the held-out score, as ratios to GRPO's own (None where either never reached it), and
    the final held-out score's difference to GRPO's."""
    train = training_target(base, window)
    held = heldout_target(base)
    steps, wall = first_reach(reward_points(run, window), train)
    base_steps, base_wall = first_reach(reward_points(base, window), train)
    held_steps, held_wall = first_reach(heldout_points(run), held)
    base_held_steps, base_held_wall = first_reach(heldout_points(base), held)
    return {
        "steps_to_90_ratio": _ratio(steps, base_steps),
        "time_to_90_ratio": _ratio(wall, base_wall),
        "heldout_steps_to_90_ratio": _ratio(held_steps, base_held_steps),
        "heldout_time_to_90_ratio": _ratio(held_wall, base_held_wall),
        "heldout_final_diff": run["evals"][-1]["accuracy"] - base["evals"][-1]["accuracy"],
    }


TARGET_RATIOS = ("steps_to_90_ratio", "time_to_90_ratio", "heldout_steps_to_90_ratio", "heldout_time_to_90_ratio")


def target_figures(runs, method, window, base_method="grpo"):
    """Over the seeds where both ``method`` and ``base_method`` ran: each of ``TARGET_RATIOS`` as ``_mean``,
    ``_se`` (over the seeds that reached the target), ``_per_seed`` (None where a seed never did) and
    ``_reached``; ``seeds``; and ``heldout_final_diff_ci``, the 95% t interval of the final held-out score's
    paired difference to GRPO's, with ``heldout_non_inferior`` (its lower end above -0.05)."""
    by = {(r["method"], r["seed"]): r for r in runs}
    seeds = sorted(s for m, s in by if m == method and (base_method, s) in by)
    per_seed = [seed_targets(by[method, s], by[base_method, s], window) for s in seeds]
    out = {"seeds": seeds}
    for key in TARGET_RATIOS:
        values = [p[key] for p in per_seed]
        out[f"{key}_mean"], out[f"{key}_se"] = mean_se(values)
        out[f"{key}_per_seed"] = values
        out[f"{key}_reached"] = f"{sum(v is not None for v in values)}/{len(values)}"
    diffs = [p["heldout_final_diff"] for p in per_seed]
    mean, se = mean_se(diffs)
    half = t95(len(diffs) - 1) * se if len(diffs) > 1 else None
    out["heldout_final_diff_mean"], out["heldout_final_diff_se"] = mean, se
    out["heldout_final_diff_ci"] = [mean - half, mean + half] if half is not None else None
    out["heldout_non_inferior"] = half is not None and mean - half > -NON_INFERIORITY_MARGIN
    return out


# ------------------------------------------------------------------------------------ time per step, by phase
STEP_PHASES = ("generation", "logps", "loss", "rest")
STEP_PHASE_LABELS = {
    "generation": "generation",
    "logps": "old/reference log-prob passes",
    "loss": "loss forward + backward",
    "rest": "rewards, pruning, optimizer, other",
}


def step_phases(step) -> dict:
    """One optimizer step's record split into ``STEP_PHASES``: the log-prob passes out of scoring, the rest of
    scoring joined to the optimizer and everything else."""
    logps = step.get("logps", 0.0)
    return {
        "generation": step["generation"],
        "logps": logps,
        "loss": step["loss"],
        "rest": step["scoring"] - logps + step["other"],
    }


def phase_means(run, skip=1):
    """Per phase of ``STEP_PHASES`` and ``step`` (their sum): (mean, SE) seconds over a run's steps after the
    first ``skip`` (first-call costs)."""
    steps = [step_phases(s) for s in run["steps"][skip:]]
    out = {p: mean_se([s[p] for s in steps]) for p in STEP_PHASES}
    out["step"] = mean_se([sum(s.values()) for s in steps])
    out["training"] = mean_se([s["logps"] + s["loss"] + s["rest"] for s in steps])  # all but generation
    return out


def ratio_se(a, b):
    """(ratio, SE) of two independent (mean, SE) pairs, to first order; (None, None) where ``b`` is 0."""
    (ma, sa), (mb, sb) = a, b
    if not mb:
        return None, None
    r = ma / mb
    return r, abs(r) * ((sa / ma) ** 2 + (sb / mb) ** 2) ** 0.5 if ma else sb


def phase_ratios(run, base, skip=1):
    """``run``'s seconds per step by phase (and ``step``, ``training``) over ``base``'s: {name: (ratio, SE)}."""
    mine, theirs = phase_means(run, skip), phase_means(base, skip)
    if run is base:  # GRPO against itself: exactly 1 where it took any time
        return {name: (1.0, 0.0) if mine[name][0] else (None, None) for name in mine}
    return {name: ratio_se(mine[name], theirs[name]) for name in mine}


def median_phase_ratios(per_seed):
    """The median over seeds of ``phase_ratios``' (ratio, SE) per name (None where no seed has it); None for no
    seeds."""
    if not per_seed:
        return None
    out = {}
    for name in per_seed[0]:
        pairs = [r[name] for r in per_seed if r[name][0] is not None]
        out[name] = [statistics.median(p[k] for p in pairs) for k in (0, 1)] if pairs else None
    return out


# ------------------------------------------------------------------------------------ the product, projected
SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def projected_time_ratio(steps_ratio, training_ratio, share, generation_ratio=(1.0, 0.0)):
    """The time to the target over GRPO's where generation takes ``share`` of GRPO's step: learning per step
    (``steps_ratio``, mean, SE) times the step ratio ``share x generation ratio + (1 - share) x training ratio``
    (``generation_ratio`` 1 where every step generates GRPO's prompts; below 1 under prompt pruning's cut).
    Returns (ratio, SE), the SE to first order."""
    (s, s_se), (t, t_se), (g, g_se) = steps_ratio, training_ratio, generation_ratio
    step = share * g + (1 - share) * t
    step_se = ((share * g_se) ** 2 + ((1 - share) * t_se) ** 2) ** 0.5
    return s * step, ((s_se * step) ** 2 + (s * step_se) ** 2) ** 0.5


def projection(steps_ratios, training_ratios, shares=SHARES, generation_ratios=None):
    """``[{"method", "generation_share", "time_ratio", "time_ratio_se"}]`` for each method with both factors
    (``steps_ratios``, ``training_ratios``, ``generation_ratios``: {method: (mean, SE)}; a method without a
    generation ratio generates GRPO's batch every step)."""
    rows = []
    for method, steps in steps_ratios.items():
        if method not in training_ratios or steps[0] is None:
            continue
        generation = (generation_ratios or {}).get(method, (1.0, 0.0))
        for share in shares:
            ratio, se = projected_time_ratio(steps, training_ratios[method], share, generation)
            rows.append({"method": method, "generation_share": share, "time_ratio": ratio, "time_ratio_se": se})
    return rows


REVISIT_STATES = ("every completion failed", "spread", "every completion solved")


def revisit_outcomes(runs):
    """How prompts move between visits: over the runs' ``groups`` records (per group: prompt, mean reward, prompt
    weight and, in records from 2026-12-05 on, whether its rewards were all equal; before, read from a mean
    reward of 0 or 1, which holds for 0/1 rewards), for each look of a prompt's last group (``REVISIT_STATES``)
    the number of revisits and the share whose new group was spread: had signal. Runs without the records are
    left out."""
    counts = {state: [0, 0] for state in REVISIT_STATES}
    for run in runs:
        last = {}
        for generation in run["generations"]:
            for entry in generation.get("groups", []):
                prompt, reward = entry[0], entry[1]
                flat = entry[3] if len(entry) > 3 else reward in (0.0, 1.0)
                state = REVISIT_STATES[1] if not flat else REVISIT_STATES[0 if reward <= 0.5 else 2]
                if prompt in last:
                    counts[last[prompt]][0] += 1
                    counts[last[prompt]][1] += not flat
                last[prompt] = state
    return {state: {"revisits": n, "spread_next": spread / n if n else None} for state, (n, spread) in counts.items()}


PROBE_SIZES = (1, 2, 4)


def probe_prediction(runs, sizes=PROBE_SIZES):
    """How well a probe of the first ``k`` completions of a group predicts a group without signal, over the runs'
    ``groups`` records that hold every reward (records from issue 42 on), each group weighted by its prompt weight
    (``1 / pi`` under the cut: a Horvitz-Thompson estimate over every candidate, whatever steered acceptance).
    Per ``k``: the weighted share of probes whose rewards agree, the share of those whose group is flat (a spread
    probe always means a spread group), and the share of spread groups a flat probe hides. None without records."""
    groups = [g for run in runs for generation in run["generations"] for g in generation.get("groups", [])
              if len(g) >= 5]
    if not groups:
        return None
    out = []
    for k in sizes:
        weight = lambda g: 1.0 if g[2] is None else g[2]  # noqa: E731
        flat_probe = [g for g in groups if max(g[4][:k]) == min(g[4][:k])]
        total, flat_total = sum(map(weight, groups)), sum(map(weight, flat_probe))
        spread = sum(weight(g) for g in groups if not g[3])
        hidden = sum(weight(g) for g in flat_probe if not g[3])
        out.append({"k": k, "groups": len(groups), "probe_flat_share": flat_total / total,
                    "group_flat_given_probe_flat": 1 - hidden / flat_total if flat_total else None,
                    "spread_hidden_by_flat_probe": hidden / spread if spread else None})
    return out
