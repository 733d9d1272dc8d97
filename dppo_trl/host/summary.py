"""What ``DPPOTrainer`` says of its run: a line when training starts (the model, ``output_dir``), the summary line
at the end of training, and the summary as JSON in ``output_dir``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from transformers import TrainerCallback

from ..config import is_real_number
from ..output_dir import SUMMARY_FILE


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


def logged_mean(log_history: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the logs that hold a finite number for it (None where none does)."""
    values = [h[key] for h in log_history if _is_number(h.get(key))]
    return sum(values) / len(values) if values else None


def model_name(model) -> str:
    """The name or folder the model was loaded from (a PEFT model's base), or its class name."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or type(model).__name__)


class DPPOSummaryCallback(TrainerCallback):
    """Says, when training starts, which model it trains and where it writes; at the end of training prints one
    line: steps, the run's wall time, reward at the first and last log, the kept fraction of completions, the
    accepted fraction of prompts and the generated fraction of completions, what the run saved (its figures
    ``speed_metrics(seconds)``, said by ``speed_summary(figures)``) and the gradient audit's summary
    (``audit_summary()``), each where it gives one. The last summary, as data, is ``summary`` (None before the end
    of training)."""

    def __init__(self, clock: RunClock, speed_metrics=None, speed_summary=None, audit_summary=None):
        self.clock, self.speed_metrics = clock, speed_metrics
        self.speed_summary, self.audit_summary = speed_summary, audit_summary
        self.summary: dict | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.clock.start(state.global_step)
        if state.is_world_process_zero:
            resumed = f", resuming at step {state.global_step}" if state.global_step else ""
            print(f"DPPO: training {model_name(model)} for {state.max_steps} steps into output_dir "
                  f"{os.path.abspath(args.output_dir)}{resumed}", flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.summary = self._summarize(state)
        print(self.summary["line"])

    def _summarize(self, state) -> dict:
        """The run's summary: its figures and the line that says them."""
        logs = [h for h in state.log_history if "reward" in h]
        seconds = self.clock.seconds()
        summary = {"steps": state.global_step, "seconds": seconds, "resumed_at_step": self.clock.resumed_at,
                   "seconds_cover_whole_run": self.clock.resumed_at is None or self.clock.earlier is not None}
        parts = [f"{state.global_step} steps", f"{seconds:.0f} s{self.clock.covers()}"]
        if logs:
            first, last = logs[0]["reward"], logs[-1]["reward"]
            summary.update(reward_first_log=first if _is_number(first) else None,
                           reward_last_log=last if _is_number(last) else None)
            parts.append(f"reward {_number(first)} (first log) -> {_number(last)} (last log)")
        fractions = (("dppo/kept_fraction", "completions kept"), ("dppo/prompt_accepted_fraction", "prompts accepted"),
                     ("dppo/prompt_generated_fraction", "completions generated"))
        for key, label in fractions:
            mean = logged_mean(state.log_history, key)
            if mean is not None:
                summary[key.removeprefix("dppo/")] = mean
                parts.append(f"{label} {mean:.3f}")
        speed = self.speed_metrics(seconds) if self.speed_metrics else {}
        if self.speed_metrics:
            summary["speed"] = {k.removeprefix("dppo/speed_"): v for k, v in speed.items()}
        for part in (self.speed_summary(speed) if self.speed_summary else None,
                     self.audit_summary() if self.audit_summary else None):
            if part:
                parts.append(part)
        summary["line"] = "DPPO summary: " + ", ".join(parts)
        return summary


def write_summary(output_dir, summary: dict) -> Path:
    """The run's summary as JSON in ``output_dir`` (``SUMMARY_FILE``), beside the model; its path."""
    path = Path(output_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
    return path
