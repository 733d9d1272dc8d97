"""The gradient audit's and the speed check's ledger: which generation batches they take, what each found (the
comparison of GRPO's and DPPO's gradients, the running bias statistic and its alarm, the measured time ratios),
and what the run's summary says of them. The passes that measure are the host's (``host.audit``); the math is in
``dppo_trl.core.audit``."""

from __future__ import annotations

import logging
import statistics

import torch

from ..core.audit import (
    BIAS_ALARM_MIN_AUDITS,
    BIAS_ALARM_T,
    PhaseSeconds,
    audited_batch,
    bias_alarm,
    bias_t,
    compare_gradients,
    measured_error_scale,
    projected_time_ratios,
    representative_timing,
    run_speed_metrics,
    speed_check_batch,
)
from .view import TrainerView

logger = logging.getLogger(__name__)

# What an audited batch is, decided when it is generated (the same on every rank: from the gathered scores).
NO_SIGNAL = "no signal"  # every score exactly 0 and no term without A: both gradients are float residue
EXACT = "exact"  # every row that counts kept at weight 1: DPPO's estimate is GRPO's gradient in exact arithmetic
PRUNED = "pruned"

# What an audited batch's audit is, decided before it is generated (the same on every rank).
COUNTED = "counted"  # an `audit_every` batch: compared, counted in the bias statistic, timed
TIMED = "timed"  # the speed check's batch (`speed_check`): only timed


class AuditLedger:
    """The run's audit results, in ``records`` (checkpointed): audits run, batches without signal, cosines,
    measured-to-model error ratios, the projections that enter the bias statistic, its t after each, the counted
    audit at which it first alarmed, the measured time ratios and what measuring cost.

    Args:
        config: the run's ``DPPOConfig``.
        view: the trainer (``components.view.TrainerView``).
        iterations: ``num_iterations`` (every iteration's training counts in a timed step).
        speed_refusal: why the speed check does not run on this trainer (None: it runs).
    """

    def __init__(self, config, view: TrainerView, iterations: int, speed_refusal: str | None):
        self.config, self.view, self.iterations, self.speed_refusal = config, view, iterations, speed_refusal
        self.records = {"audits": 0, "no_signal": 0, "cosine": [], "ratio": [], "projection": [], "bias_t": [],
                        "alarm_at": None, "train_time_ratio": [], "step_time_ratio": [], "generation_share": [],
                        "timed_token_fraction": [], "measuring_seconds": 0.0, "speed_check_at": None}

    def plan(self, index: int, batches: int) -> str | None:
        """Generation batch ``index``'s audit (of ``batches`` in the run): ``COUNTED`` (an ``audit_every`` batch),
        ``TIMED`` (the speed check's) or None; the same on every rank."""
        if audited_batch(index, self.config.audit_every, self.config.seed):
            return COUNTED
        if self.speed_refusal is None and self.records["speed_check_at"] is None:
            return TIMED if index >= speed_check_batch(batches) else None
        return None

    def measured_error_scale(self) -> float:
        """How much the measured pruning error exceeded the model-based one on the audits so far (1.0 before any,
        or with ``adaptive_keep_error_source='model'``): earlier batches only."""
        if self.config.adaptive_keep_error_source != "audit":
            return 1.0
        return measured_error_scale(self.records["ratio"])

    def count(self, kind: str) -> None:
        """A counted audit of a batch of ``kind``."""
        self.records["audits"] += 1
        self.records["no_signal"] += kind == NO_SIGNAL

    def spent(self, seconds: float, step: int | None = None) -> None:
        """``seconds`` of measuring (counted against the saving); ``step``: the speed check's, when it timed."""
        self.records["measuring_seconds"] += seconds
        if step is not None and self.records["speed_check_at"] is None:
            self.records["speed_check_at"] = step

    def record_comparison(self, dppo: torch.Tensor, grpo: torch.Tensor, kind: str, model_error: float | None) -> None:
        """Log one audit's comparison (``dppo/audit_*``) and update the run's bias statistic: the projection enters
        it unless DPPO's estimate of this batch is GRPO's gradient in exact arithmetic (``EXACT``: its projection is
        float rounding, which has no mean-zero guarantee)."""
        records, log = self.records, self.view.log_metric
        comparison = compare_gradients(dppo, grpo)
        if comparison is None:
            return
        for name in ("cosine", "rel_error", "projection"):
            log(f"dppo/audit_{name}", comparison[name])
        records["cosine"].append(comparison["cosine"])
        if model_error:
            ratio = comparison["rel_error"] / model_error
            log("dppo/audit_noise_to_signal", ratio)
            records["ratio"].append(ratio)
        if kind == PRUNED:
            self._add_to_bias_statistic(comparison["projection"])

    def record_times(self, grpo: PhaseSeconds, dppo: PhaseSeconds, kept_token_fraction: float) -> None:
        """Log what pruning saves on this machine, from the audited batch's phases at the same parameters:
        ``dppo/audit_train_time_ratio`` (log-prob and gradient passes), ``dppo/audit_step_time_ratio`` (with
        generation, projected) and ``dppo/audit_generation_share`` (generation's share of GRPO's step); and the
        share of completion tokens the timed iteration kept (whether the timing stands for the run)."""
        ratios = projected_time_ratios(grpo, dppo, self.iterations)
        if ratios is None:
            return
        for name, value in ratios.items():
            self.view.log_metric(f"dppo/audit_{name}", value)
            self.records[name].append(value)
        self.records["timed_token_fraction"].append(kept_token_fraction)

    def _add_to_bias_statistic(self, projection: float) -> None:
        records = self.records
        records["projection"].append(projection)
        t = bias_t(records["projection"])
        if t is None:
            return
        records["bias_t"].append(t)
        self.view.log_metric("dppo/audit_bias_t", t)
        if records["alarm_at"] is None and bias_alarm(records["projection"]):
            records["alarm_at"] = len(records["projection"])
            logger.warning(
                "DPPO gradient audit: bias alarm. After %d counted audits DPPO's gradient is %s GRPO's along GRPO's "
                "own direction by %.1f%% on average (bias t %.2f, alarm beyond +-%.0f): prune_sampling=%r does not "
                "estimate GRPO's gradient without bias on this run.", len(records["projection"]),
                "shorter than" if t < 0 else "longer than", 100 * statistics.fmean(records["projection"]), t,
                BIAS_ALARM_T, self.config.prune_sampling,
            )
        self.view.log_metric("dppo/audit_bias_alarm", float(records["alarm_at"] is not None))

    def summary(self) -> str | None:
        """``audits N, median cosine C, bias t T over K audits`` and the alarm for the summary line; None without
        audits."""
        records = self.records
        if records["audits"] == 0:
            return None
        cosine = f"{statistics.median(records['cosine']):.3f}" if records["cosine"] else "n/a"
        parts = [f"audits {records['audits']}", f"median cosine {cosine}"]
        if records["no_signal"]:
            parts.append(f"{records['no_signal']} without signal")
        t, counted = bias_t(records["projection"]), len(records["projection"])
        if t is not None:
            parts.append(f"bias t {t:.2f} over {counted} audits")
        if records["alarm_at"] is not None:
            parts.append(f"BIAS ALARM (|t| > {BIAS_ALARM_T:g} at audit {records['alarm_at']})")
        elif counted >= BIAS_ALARM_MIN_AUDITS:
            parts.append(f"no bias alarm (|t| <= {BIAS_ALARM_T:g})")
        return ", ".join(parts)

    def speed_metrics(self, run_seconds: float) -> dict:
        """What the run saved, for the final log (``report_to``): the measured ratios (the median over the timed
        batches) and the projection over ``run_seconds``, what the speed check and audits took counted against the
        saving; empty before any batch was timed."""
        r = self.records
        return run_speed_metrics(r["train_time_ratio"], r["step_time_ratio"], r["generation_share"], run_seconds,
                                 r["measuring_seconds"])

    def speed_summary(self, metrics: dict, run_kept_token_fraction: float) -> str | None:
        """The summary line's part on what the run saved (``metrics``: ``speed_metrics``'s), or why it was not
        measured (None on GRPO's path or with ``speed_check=False`` and no audit); ``run_kept_token_fraction``: the
        run's mean share of completion tokens kept (whether the timed batches stand for the run)."""
        if metrics:
            records = self.records
            timed = len(records["step_time_ratio"])
            step, train, share, grpo, saved, measuring = (metrics[f"dppo/speed_{name}"] for name in (
                "step_time_ratio", "train_time_ratio", "generation_share", "projected_grpo_seconds",
                "projected_seconds_saved", "measuring_seconds"))
            reuse = (f"; each generation batch trained num_iterations={self.iterations} times, every "
                     "iteration counted" if self.iterations > 1 else "")
            what = "the speed check and the audits" if records["audits"] else "the speed check"
            return (f"measured here: a step takes {step:.2f} of GRPO's time (training {train:.2f}, generation "
                    f"{share:.0%} of GRPO's step; {timed} batch{'es' if timed > 1 else ''} timed{reuse}), projected "
                    f"time saved {saved:.0f} s of GRPO's {grpo:.0f} s ({what} took {measuring:.0f} s of this run, "
                    f"counted against the saving){self._timing_caveat(run_kept_token_fraction)}")
        if not self.config.speed_check or not self.config.dppo_training_path:
            return None
        return f"speed not measured: {self.speed_refusal or 'the run ended before its timed batch'}"

    def _timing_caveat(self, run: float) -> str:
        """The summary line's warning when the timed batches kept far more or fewer completion tokens than the
        run's batches did on average (``run``; "" when they stand for the run)."""
        timed_token_fractions = self.records["timed_token_fraction"]
        if representative_timing(timed_token_fractions, run):
            return ""
        timed = statistics.median(timed_token_fractions)
        return (f"; NOT REPRESENTATIVE: the timed batch kept {timed:.0%} of its completion tokens, the run's batches "
                f"{run:.0%} on average, so the projection is not this run's")

    def state_dict(self) -> dict | None:
        """The audit history for a checkpoint: a resumed run goes on with the bias statistic and the measured/model
        ratios that ``adaptive_keep_error_source='audit'`` reads, and the speed check's timings (None while neither
        runs)."""
        saves = self.config.audit_every or self.speed_refusal is None
        return {"records": self.records} if saves else None

    def load_state_dict(self, state: dict) -> None:
        self.records.update({k: v for k, v in state["records"].items() if k in self.records})
