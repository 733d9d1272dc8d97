"""The summary line ``DPPOTrainer`` prints at the end of training."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from ..config import is_real_number


def _is_number(value) -> bool:
    return is_real_number(value, finite=True)


def _number(value) -> str:
    """A logged value for the summary line: 3 decimals, or "n/a" (None, NaN: e.g. every reward was None)."""
    return f"{value:.3f}" if _is_number(value) else "n/a"


class DPPOSummaryCallback(TrainerCallback):
    """Prints one line at the end of training: steps, wall time, reward at the first and last log, the kept
    fraction of completions, the accepted fraction of prompts and the generated fraction of completions, and the
    gradient audit's summary (``audit_summary()``, when it gives one)."""

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
        fractions = (("dppo/kept_fraction", "completions kept"), ("dppo/prompt_accepted_fraction", "prompts accepted"),
                     ("dppo/prompt_generated_fraction", "completions generated"))
        for key, label in fractions:
            values = [h[key] for h in state.log_history if _is_number(h.get(key))]
            if values:
                parts.append(f"{label} {sum(values) / len(values):.3f}")
        audit = self.audit_summary() if self.audit_summary is not None else None
        if audit:
            parts.append(audit)
        print("DPPO summary: " + ", ".join(parts))
