"""Runs that take turns, so that a machine's load falls alike on each: the timing behind ``make demo``.

Runs made one after the other in one process see different loads when the machine's load changes between them,
and their ratio of times then says more about the machine than about the runs. Here each run is a job in a process
of its own, and one job runs at a time: A's step, then B's, then A's again, and so on. A load that changes falls on
both within one step.

A job is a picklable function ``fn(turns, *args)``. It runs in a fresh process, with its own threads and random
generators: what it computes is what it computes alone. It runs only while it holds the turn:

- ``turns.begin()`` hands the turn on, waits until it comes back, then starts the job's clock (stopping it first
  if it runs);
- ``turns.end()`` stops the clock.

What a job does before its first ``begin()`` (loading a model) and after its last ``end()`` (an evaluation) also
runs in its turn, off its clock. ``run_in_turns`` hands out the turns and returns what the jobs return.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback

GO = "go"


class Turns:
    """A job's side of the turns, and its clock: the spans from each ``begin()`` to the next ``end()``.

    Without a connection (``Turns()``), the job runs alone: ``begin()`` starts the clock without waiting."""

    def __init__(self, connection=None):
        self.connection = connection
        self.spans = []  # (start, end) of each timed span, time.monotonic(): one clock for every process
        self._start = None

    def begin(self) -> None:
        """Hand the turn on, wait until it comes back, then start the clock (a running clock stops first)."""
        self.end()
        if self.connection is not None:
            self.connection.send(("yield", None))
            _wait_for_turn(self.connection)
        self._start = time.monotonic()

    def end(self) -> None:
        """Stop the clock (nothing when it is stopped)."""
        if self._start is not None:
            self.spans.append((self._start, time.monotonic()))
            self._start = None

    def elapsed(self) -> float:
        """The seconds on the clock: every span so far, the running one included."""
        running = time.monotonic() - self._start if self._start is not None else 0.0
        return sum(end - start for start, end in self.spans) + running


def run_in_turns(jobs: list[tuple], preload: tuple[str, ...] = ()) -> list:
    """Run each job ``(fn, *args)`` as ``fn(turns, *args)`` in a process of its own; return what each returned, in
    the order of ``jobs``.

    The turn goes round the jobs in order (A, B, A, B, ...) and a job that has returned leaves the others to go
    on. A job that raises or dies stops the others; its error is raised here. ``preload``: modules the jobs' processes
    start with, imported once (``_fresh_processes``)."""
    context = _fresh_processes(preload)
    workers = [_start(context, fn, args) for fn, *args in jobs]
    results, live, position = [None] * len(jobs), list(range(len(jobs))), 0
    try:
        while live:
            position %= len(live)
            index = live[position]
            kind, value = _give_turn(workers[index], index, jobs[index][0])
            if kind == "yield":
                position += 1
            else:
                results[index] = value
                live.pop(position)  # the next job moves into this position
    finally:
        for process, connection in workers:
            _stop(process, connection)
    return results


def turns_callback(turns: Turns):
    """A ``transformers.TrainerCallback`` that runs a trainer's optimizer steps in turns: the turn passes as each
    step begins, and the clock runs from each step's begin to the next one's (the step, its logging, the next
    batch's fetch), then to the end of training."""
    from transformers import TrainerCallback

    class TakeTurns(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            turns.begin()

        def on_train_end(self, args, state, control, **kwargs):
            turns.end()

    return TakeTurns()


def _fresh_processes(preload: tuple[str, ...] = ()):
    """Processes forked from a server process that imported this module and ``preload`` (e.g. the trainer, with
    torch and TRL) once per program; spawned ones, which import them each, where there is no fork server. Either
    way, a job's process has run nothing of another job's, and it has the environment the program had when its
    first jobs started."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, *preload])
    return context


def _start(context, fn, args):
    ours, theirs = context.Pipe()
    process = context.Process(target=_run_job, args=(theirs, fn, args), name=f"turns-{_name(fn)}")
    process.start()
    theirs.close()
    return process, ours


def _give_turn(worker, index: int, fn) -> tuple:
    """Give a job the turn; wait until it hands it back ("yield") or returns ("done", its value)."""
    process, connection = worker
    connection.send(GO)
    try:
        kind, value = connection.recv()
    except EOFError:
        process.join(5)
        code = process.exitcode
        raise RuntimeError(f"job {index} ({_name(fn)}) ended without returning (exit code {code})") from None
    if kind == "error":
        raise RuntimeError(f"job {index} ({_name(fn)}) failed:\n{value}")
    return kind, value


def _run_job(connection, fn, args) -> None:
    """The job's process: wait for the first turn, run the job, send back its value or its error."""
    _wait_for_turn(connection)
    try:
        value = fn(Turns(connection), *args)
    except Exception:
        connection.send(("error", traceback.format_exc()))
        return
    connection.send(("done", value))


def _name(fn) -> str:
    return getattr(fn, "__name__", repr(fn))


def _wait_for_turn(connection) -> None:
    try:
        message = connection.recv()
    except EOFError:  # the controller is gone: so is the reason to go on
        raise SystemExit(1) from None
    assert message == GO, message


def _stop(process, connection) -> None:
    connection.close()  # a job still waiting for its turn exits
    process.join(10)
    if process.is_alive():
        process.terminate()
        process.join(10)
