"""Tests that start processes: ``torchrun`` of a worker on two CPU processes (gloo), killing every process it started
on a hang; what a worker does at its end; a model's parameters gathered whole on every rank."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def kill_process_tree(pid):
    """SIGKILL the process group of ``pid`` and of every descendant. torchrun starts each worker in a session of
    its own (torch's elastic subprocess handler: ``start_new_session=True``), so killing torchrun's group alone
    leaves hung workers behind, holding the pipes ``communicate`` reads to the end (measured: it then waits
    forever)."""
    import psutil  # an accelerate dependency

    try:
        tree = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        tree = [pid]
    for member in tree:
        try:
            group = os.getpgid(member)
        except ProcessLookupError:
            continue
        if group != os.getpgrp():  # never pytest's own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def run_two_processes(worker, *worker_args, timeout=300, env=None) -> None:
    """``torchrun`` of ``worker`` on 2 CPU processes; fails the test on a non-zero exit or after ``timeout`` s (a
    hang), killing every process it started."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert launcher, "torchrun comes with torch"
    # --standalone: the launcher binds a free local port itself (a port picked here could be taken before it binds)
    command = [launcher, "--standalone", "--nproc_per_node", "2", str(worker), *map(str, worker_args)]
    # Its own process group, so that a hang kills torchrun and not pytest.
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _, stderr = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(run.pid)
        _, stderr = run.communicate()
        pytest.fail(f"no result after {timeout} s (a hang?):\n{stderr[-3000:]}")
    assert run.returncode == 0, stderr[-3000:]


def leave_without_destructors() -> None:
    """End a torchrun worker without running destructors: freeing DDP's reducer frees its gloo process group,
    whose destructor joins gloo's worker thread while holding the GIL, and that thread may still need the GIL to
    free the last gather's tensors. Depending on when that happens, a finished rank hangs or aborts at exit (a
    torch race: pytorch/pytorch#56297, #179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def full_parameters(model) -> dict:
    """Every parameter of ``model``, whole, by name. Under ZeRO-3 (every parameter partitioned: ``ds_tensor``)
    gathered with DeepSpeed's ``GatheredParameters``; an FSDP2 parameter (a DTensor shard) with ``full_tensor()``.
    Both are collectives: every rank calls this, walking the same names in the same order."""
    params = list(model.parameters())
    if params and all(hasattr(p, "ds_tensor") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {name: p.detach().clone() for name, p in model.named_parameters()}
    whole = {}
    for name, p in model.named_parameters():
        p = p.detach()
        whole[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()
    return whole
