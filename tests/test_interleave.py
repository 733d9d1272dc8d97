"""``benchmarks/harness/interleave.py``, the timing of ``make demo``: two jobs whose steps take fixed times under a simulated load
that grows midway. Taking turns, their ratio of times stays the true one; one after the other, the load skews it.

The load is simulated (a step sleeps longer once it has come), so that the tests do not depend on the machine's own.
Taking turns starts processes (``subprocess``): each imports the harness, a few seconds."""

import contextlib
import multiprocessing
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from harness.interleave import Turns, run_in_turns  # noqa: E402

STEPS = 10
FAST, SLOW = 0.04, 0.08  # seconds a step takes without the load: the true ratio of times is 0.5
LOADED = 2.0  # how much longer every step takes once the load has come
LOAD_AFTER = 0.42  # seconds after the first step begins: midway through the steps taken in turns, and when
# the first job has ended (10 x 0.04 s) when the jobs run one after the other


def the_load_comes(switch_file, after: float) -> None:
    """The first step of any job fixes when the load comes: ``after`` seconds later (on the clock of the turns, one
    for every process)."""
    with contextlib.suppress(FileExistsError), open(switch_file, "x") as f:
        f.write(str(time.monotonic() + after))


def load(switch_file) -> float:
    """How much longer a step takes now."""
    with open(switch_file) as f:
        return LOADED if time.monotonic() >= float(f.read()) else 1.0


def steps_under_load(turns, seconds: float, steps: int, switch_file) -> dict:
    """A job of ``steps`` steps of ``seconds`` each (times the load); its clock's total and its spans."""
    for _ in range(steps):
        turns.begin()
        the_load_comes(switch_file, LOAD_AFTER)
        time.sleep(seconds * load(switch_file))
        turns.end()
    return dict(seconds=turns.elapsed(), spans=turns.spans)


def steps_of(turns, name: str, steps: int) -> dict:
    """A job of ``steps`` empty steps; its name and its spans."""
    for _ in range(steps):
        turns.begin()
        turns.end()
    return dict(name=name, spans=turns.spans)


def fails_at_step(turns, step: int):
    """A job that raises as its step ``step`` begins."""
    for _ in range(step):
        turns.begin()
    raise ValueError(f"failed at step {step}")


def owners_in_time_order(*jobs: dict) -> list:
    """Whose each span was, spans sorted by their start; that no two spans overlap."""
    spans = sorted((start, end, job["name"]) for job in jobs for start, end in job["spans"])
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(spans, spans[1:]))
    return [name for _, _, name in spans]


@pytest.mark.subprocess
def test_taking_turns_the_ratio_holds_under_a_load_that_changes_midway(tmp_path):
    switch_file = tmp_path / "load"
    fast, slow = run_in_turns([(steps_under_load, FAST, STEPS, switch_file),
                               (steps_under_load, SLOW, STEPS, switch_file)])
    fast["name"], slow["name"] = "fast", "slow"
    assert owners_in_time_order(fast, slow) == ["fast", "slow"] * STEPS
    loaded_steps = sum(end >= float(switch_file.read_text()) for job in (fast, slow) for _, end in job["spans"])
    assert STEPS // 2 <= loaded_steps <= 2 * STEPS - STEPS // 2  # the load came midway
    assert fast["seconds"] / slow["seconds"] == pytest.approx(FAST / SLOW, abs=0.06)


def test_one_after_the_other_the_same_load_skews_the_ratio(tmp_path):
    """The same jobs and load, the second job after the first in one process, as ``make demo`` ran them before:
    the load falls on the second alone (what the test above would see without the turns)."""
    switch_file = tmp_path / "load"
    fast = steps_under_load(Turns(), FAST, STEPS, switch_file)
    slow = steps_under_load(Turns(), SLOW, STEPS, switch_file)
    assert fast["seconds"] / slow["seconds"] == pytest.approx(FAST / (SLOW * LOADED), abs=0.06)
    assert abs(fast["seconds"] / slow["seconds"] - FAST / SLOW) > 0.15


@pytest.mark.subprocess
def test_a_job_that_ends_first_leaves_the_other_its_steps_and_values_come_back_in_order():
    a, b, c = run_in_turns([(steps_of, "a", 2), (steps_of, "b", 4), (steps_of, "c", 1)])
    assert [a["name"], b["name"], c["name"]] == ["a", "b", "c"]
    assert owners_in_time_order(a, b, c) == ["a", "b", "c", "a", "b", "b", "b"]


@pytest.mark.subprocess
def test_a_job_that_fails_stops_the_others_and_its_error_comes_back():
    with pytest.raises(RuntimeError, match=r"job 1 \(fails_at_step\) failed:(.|\n)*ValueError: failed at step 2"):
        run_in_turns([(steps_of, "a", 5), (fails_at_step, 2)])
    assert multiprocessing.active_children() == []
