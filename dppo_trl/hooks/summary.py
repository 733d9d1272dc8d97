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


class RunClock:
    """The run's wall seconds: those of the parts before a resume (from the checkpoint's ``run`` state) plus this
    part's, timed from ``on_train_begin``."""

    def __init__(self):
        self.earlier: float | None = None  # the seconds before this part, when a checkpoint recorded them
        self.resumed_at: int | None = None  # the step this part began at, when it resumed a checkpoint
        self._started: float | None = None

    def start(self, step: int) -> None:
        self._started, self.resumed_at = time.perf_counter(), step or None

    def seconds(self) -> float:
        return (self.earlier or 0.0) + (time.perf_counter() - self._started if self._started is not None else 0.0)

    def covers(self) -> str:
        """What ``seconds()`` covers, for the summary line ("" for a run that did not resume)."""
        if self.resumed_at is None:
            return ""
        if self.earlier is None:
            return f" (since the resume at step {self.resumed_at}: the checkpoint did not record the earlier time)"
        return f" (the whole run; resumed at step {self.resumed_at})"

    def state_dict(self) -> dict:
        return {"seconds": self.seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.earlier = float(state["seconds"])


class DPPOSummaryCallback(TrainerCallback):
    """Prints one line at the end of training: steps, the run's wall time, reward at the first and last log, the
    kept fraction of completions, the accepted fraction of prompts and the generated fraction of completions, what
    the run saved (``speed_summary(seconds)``) and the gradient audit's summary (``audit_summary()``), each where it
    gives one."""

    def __init__(self, clock: RunClock, speed_summary=None, audit_summary=None):
        self.clock, self.speed_summary, self.audit_summary = clock, speed_summary, audit_summary

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        logs = [h for h in state.log_history if "reward" in h]
        seconds = self.clock.seconds()
        parts = [f"{state.global_step} steps", f"{seconds:.0f} s{self.clock.covers()}"]
        if logs:
            parts.append(f"reward {_number(logs[0]['reward'])} (first log) -> {_number(logs[-1]['reward'])} (last log)")
        fractions = (("dppo/kept_fraction", "completions kept"), ("dppo/prompt_accepted_fraction", "prompts accepted"),
                     ("dppo/prompt_generated_fraction", "completions generated"))
        for key, label in fractions:
            values = [h[key] for h in state.log_history if _is_number(h.get(key))]
            if values:
                parts.append(f"{label} {sum(values) / len(values):.3f}")
        for summary in (self.speed_summary(seconds) if self.speed_summary else None,
                        self.audit_summary() if self.audit_summary else None):
            if summary:
                parts.append(summary)
        print("DPPO summary: " + ", ".join(parts))
