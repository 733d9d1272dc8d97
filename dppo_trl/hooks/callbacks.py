"""Callbacks and a scheduler wrapper of ``DPPOTrainer``: the summary line, and the schedule and progress bar that
follow data progress in epoch-based runs with prompt pruning."""

from __future__ import annotations

import math
import time

from transformers import TrainerCallback


class DataProgressScheduler:
    """Wraps a step-based LR scheduler so that it follows data progress: each ``step()`` advances it to the
    number of optimizer steps GRPO would have taken to consume the same prompts. A pruned epoch takes fewer
    steps but the schedule still reaches its end with the last epoch."""

    def __init__(self, scheduler, target_steps):
        self.scheduler = scheduler
        self.target_steps = target_steps

    def step(self, *args, **kwargs):
        target = self.target_steps()
        while self.scheduler.last_epoch < target:
            self.scheduler.step()

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value) -> str:
    """A logged value for the summary line: 3 decimals, or "n/a" (None, NaN: e.g. every reward was None)."""
    return f"{value:.3f}" if _is_number(value) else "n/a"


class DPPOSummaryCallback(TrainerCallback):
    """Prints one line at the end of training: steps, wall time, reward at the first and last log, the kept
    fractions of completions and prompts, and the gradient audit's summary (``audit_summary()``, when it gives one)."""

    def __init__(self, audit_summary=None):
        self.audit_summary = audit_summary

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        logs = [h for h in state.log_history if "reward" in h]
        parts = [
            f"{state.global_step} steps",
            f"{time.perf_counter() - getattr(self, '_start', time.perf_counter()):.0f} s",
        ]
        if logs:
            parts.append(f"reward {_number(logs[0]['reward'])} (first log) -> {_number(logs[-1]['reward'])} (last log)")
        for key, label in (("dppo/kept_fraction", "completions kept"), ("dppo/prompt_keep_rate", "prompts accepted")):
            values = [h[key] for h in state.log_history if _is_number(h.get(key))]
            if values:
                parts.append(f"{label} {sum(values) / len(values):.3f}")
        audit = self.audit_summary() if self.audit_summary is not None else None
        if audit:
            parts.append(audit)
        print("DPPO summary: " + ", ".join(parts))


class DataProgressBarCallback(TrainerCallback):
    """Epoch-based runs with prompt pruning: the progress bar (planned for GRPO's step count) shows data
    progress, the steps GRPO would have taken to walk as far through the data, so it ends full."""

    def __init__(self, target_steps, callbacks):
        self.target_steps = target_steps
        self.callbacks = callbacks

    def on_step_end(self, args, state, control, **kwargs):
        from transformers.trainer_callback import ProgressCallback

        for callback in self.callbacks():
            bar = getattr(callback, "training_bar", None) if isinstance(callback, ProgressCallback) else None
            if bar is not None:
                bar.n = min(max(self.target_steps(), state.global_step), bar.total or bar.n)
                bar.refresh()
