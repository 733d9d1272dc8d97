"""The benchmarks' harness: what every training benchmark shares, so that each script only declares its methods,
its setup and its figures.

- ``training``: the timed trainer (``timed``: TRL's phases clocked, each generation batch recorded), the clock
  callback, ``run_one`` (one method, one seed), ``warm_up``, ``run_methods`` (methods x seeds; ``in_turns``: a
  seed's methods take turns, one optimizer step each, in processes of their own, ``harness.interleave``).
- ``figures``: curves (``reward_curve``, ``eval_curve``, ``trailing_mean``), ``time_to`` a target and its ratio
  to GRPO's, ``cost_figures`` of a method against GRPO's run of the same seed, ``summarize`` (one row per method
  over seeds; ``summarize_at_budget`` at a common step budget), ``mean_se`` and ``pooled`` standard errors.
- ``report``: text and markdown tables, ``pm`` (mean ± SE), ``plot_runs`` (curves, e.g. ``reward_panels``, and
  the time breakdown), the JSON results (``benchmarks/results/``: ``result_path``, ``write_json``, ``read_json``,
  ``runs_path``).
- ``targets``: the speedup in two factors: steps and time to 90% of GRPO's rise per seed (``target_figures``),
  seconds per step by phase against GRPO's (``phase_ratios``), their product projected over generation shares
  (``projection``).
- ``setups``: the countdown and SmolLM2 + reasoning-gym setups, their held-out evaluations, vLLM on a CPU,
  ``group_advantages`` (TRL's, of simulated rewards), ``config_default`` (``DPPOConfig``'s defaults) and
  ``suite_helper`` (a helper module of ``tests/``).

The scripts run from the repository root (``python benchmarks/bench_x.py``: Python puts ``benchmarks/`` on
``sys.path``, so ``import harness`` finds this package)."""

from .figures import (
    budget_figures,
    cost_figures,
    eval_curve,
    mean_se,
    pooled,
    reward_curve,
    seed_mean,
    summarize,
    summarize_at_budget,
    time_to,
    time_to_target_ratio,
    trailing_mean,
)
from .report import (
    TARGET_COLUMNS,
    Panel,
    md_table,
    phase_shares,
    plot_projection,
    plot_runs,
    pm,
    print_table,
    read_json,
    result_path,
    reward_panels,
    runs_path,
    text_table,
    without_per_seed,
    write_json,
)
from .setups import (
    LORA,
    config_default,
    countdown_accuracy,
    countdown_setup,
    group_advantages,
    reasoning_gym_score,
    reasoning_gym_setup,
    suite_helper,
    vllm_on_cpu,
)
from .targets import (
    SHARES,
    STEP_PHASE_LABELS,
    STEP_PHASES,
    median_phase_ratios,
    phase_means,
    phase_ratios,
    projection,
    probe_prediction,
    revisit_outcomes,
    target_figures,
)
from .training import (
    PHASE_LABELS,
    PHASES,
    TIMING_IN_TURNS,
    TIMING_ONE_AFTER_THE_OTHER,
    clock,
    data_progress,
    run_methods,
    run_one,
    timed,
    turn_job,
    warm_up,
)

__all__ = [
    "budget_figures", "clock", "config_default", "cost_figures", "countdown_accuracy", "countdown_setup",
    "data_progress", "eval_curve", "group_advantages", "LORA", "md_table", "mean_se", "median_phase_ratios", "Panel",
    "PHASE_LABELS", "phase_means", "phase_ratios", "phase_shares", "PHASES", "plot_projection", "plot_runs", "pm",
    "pooled", "print_table", "probe_prediction", "projection", "read_json", "reasoning_gym_score",
    "reasoning_gym_setup", "result_path", "revisit_outcomes", "reward_curve", "reward_panels", "run_methods",
    "run_one", "runs_path", "seed_mean", "SHARES",
    "STEP_PHASE_LABELS", "STEP_PHASES", "suite_helper", "summarize", "summarize_at_budget", "target_figures",
    "TARGET_COLUMNS", "text_table", "time_to", "time_to_target_ratio", "timed", "TIMING_IN_TURNS",
    "TIMING_ONE_AFTER_THE_OTHER", "trailing_mean", "turn_job", "vllm_on_cpu",
    "warm_up", "without_per_seed", "write_json",
]
