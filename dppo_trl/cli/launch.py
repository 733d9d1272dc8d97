"""How a ``dppo-trl`` run with launch options gets its processes: ``accelerate launch`` of ``-m dppo_trl`` as
``trl grpo`` does, except that ``--num_processes N`` > 1 on the CPU goes through torch.distributed.run (gloo),
where accelerate would start one process, and N > 1 that accelerate would cut to one on GPUs is refused; and how
a process of such a CPU group ends (``_exit_without_finalizers``); how a ``CLIError`` that every process of a launch
meets is printed once (``report``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .arguments import CLIError

_LAUNCHED = "DPPO_TRL_LAUNCHED"  # set for the launched processes: they run the training, not another launch

_DISTRIBUTED_LAUNCHERS = ("multi_gpu", "use_deepspeed", "use_fsdp", "use_megatron_lm", "tpu")


def process_plan(num_processes: int, multi_process_launcher: bool, on_cpu: bool, devices: int) -> str:
    """How the ``num_processes`` processes asked for get started, given how ``accelerate launch`` would read the
    launch options (``multi_process_launcher``: through torch.distributed.run, DeepSpeed, mpirun, ...) and
    where the run goes: ``"accelerate"`` (it starts them as asked: one, or N through that launcher) or ``"cpu"``
    (N > 1 processes on the CPU, which accelerate's single-process launcher would silently cut to one; they go
    through torch.distributed.run with gloo instead). N > 1 on GPUs that accelerate would give a single process
    (fewer than two GPUs, or a config file of one process) is a CLIError that names --num_processes. The
    invariant: never one process where N > 1 were asked for."""
    if num_processes <= 1 or multi_process_launcher:
        return "accelerate"
    if on_cpu:
        return "cpu"
    visible = f"{devices} GPU{'' if devices == 1 else 's'} visible"
    raise CLIError(
        f"--num_processes {num_processes} would start a single process here ({visible}): `accelerate launch` "
        "starts several only through a multi-process launcher (one process per GPU, --multi_gpu, or an "
        "--accelerate_config of that kind). Use --num_processes 1, or add --use_cpu true to run "
        f"{num_processes} processes on the CPU."
    )


def _accelerate_reading(accelerate_args):
    """``accelerate launch``'s own reading of ``accelerate_args`` (its config file, its defaults, the GPUs it
    finds), on a copy and without its warnings (the launch prints them): (number of processes, whether it
    would use a multi-process launcher)."""
    import copy
    import logging

    from accelerate.commands.launch import _validate_launch_command
    from accelerate.utils import ComputeEnvironment

    logger = logging.getLogger("accelerate.commands.launch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        args, defaults, _ = _validate_launch_command(copy.deepcopy(accelerate_args))
    except ValueError as error:  # e.g. two of --cpu, --multi_gpu, --use_deepspeed
        raise CLIError(str(error)) from None
    finally:
        logger.setLevel(level)
    sagemaker = defaults is not None and defaults.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER
    distributed = any(getattr(args, name, False) for name in _DISTRIBUTED_LAUNCHERS) and not args.cpu
    return args.num_processes or 1, distributed or sagemaker or args.mpirun_hostfile is not None


def plan_launch(launch_args: list[str], training_argv: list[str], use_cpu: bool):
    """(the ``accelerate launch`` arguments that start the run, the environment they need). ``--num_processes
    N`` > 1 on the CPU (``--cpu``, ``use_cpu``, or no GPU) goes to accelerate's multi-GPU launcher, which is
    torch.distributed.run and works on the CPU (gloo), with ACCELERATE_USE_CPU so that every process joins the
    CPU group; accelerate's own CPU launcher would start one process (see ``process_plan``). An
    ``--accelerate_config`` among ``launch_args`` becomes accelerate's ``--config_file`` first."""
    import torch
    from accelerate.commands.launch import launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    try:
        launch_args = resolve_accelerate_config_argument(launch_args)
    except ValueError as error:  # an --accelerate_config that is neither a file nor one TRL ships
        raise CLIError(str(error)) from None
    args = launch_command_parser().parse_args(launch_args + ["--module", "dppo_trl"] + training_argv)
    num_processes, multi_process_launcher = _accelerate_reading(args)
    on_cpu = args.cpu or use_cpu or not torch.accelerator.is_available()
    devices = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    if process_plan(num_processes, multi_process_launcher, on_cpu, devices) == "accelerate":
        return args, {}
    # --multi_gpu picks accelerate's torch.distributed.run launcher; use_cpu, its CPU threads per process
    args.cpu, args.use_cpu, args.multi_gpu, args.num_processes = False, True, True, num_processes
    if args.main_process_port is None and (args.num_machines or 1) <= 1:
        args.standalone = True  # torch.distributed.run binds a free local port itself
    print(f"dppo-trl: {num_processes} processes on the CPU (torch.distributed.run, gloo)", file=sys.stderr)
    return args, {"ACCELERATE_USE_CPU": "true"}


def is_main_process() -> bool:
    """Whether this process is the main one of its launch: rank 0 as torch.distributed.run, DeepSpeed or an MPI
    launcher numbers it (``RANK``, ...); a process that no launch numbered is."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value) == 0
    return True


REPORT_GRACE_S = 30.0  # how long another process of a launch waits for the launcher to end it (see report)


def report(error: CLIError) -> None:
    """Print ``error``'s line once for a launch whose processes all meet it (the trainer's dataset check): the main
    process prints it at once; any other first waits ``REPORT_GRACE_S`` seconds, in which the launcher ends it
    once the main process has exited (torch.distributed.run, DeepSpeed and mpirun stop every process when one
    fails), so it prints only where the main process did not meet the error, and its exit cannot end the main
    process before that prints."""
    if not is_main_process():
        time.sleep(REPORT_GRACE_S)
    print(error, file=sys.stderr)


def needs_launch(launch_args: list[str]) -> bool:
    """Whether this process starts the run under ``accelerate launch``: there are launch arguments, and it is not
    itself one of the processes a launch started."""
    return bool(launch_args) and os.environ.get(_LAUNCHED) != "1"


def _exit_status(error: BaseException) -> int | None:
    """The exit status of the launched process whose failure ``error`` (the launcher's) reports first."""
    if isinstance(error, subprocess.CalledProcessError):
        return error.returncode
    return error.get_first_failure()[1].exitcode


def launch(accelerate_args, launch_env: dict[str, str]) -> None:
    """Start the run as ``plan_launch`` planned it: ``accelerate launch`` with ``launch_env`` set. Where the
    launched run stopped at a ``CLIError`` (status 2), which its main process printed, this process exits with
    status 2 too, without the launcher's traceback under that line."""
    from accelerate.commands.launch import launch_command
    from accelerate.utils import patch_environment
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ[_LAUNCHED] = "1"
    try:
        with patch_environment(**launch_env):
            launch_command(accelerate_args)
    except (ChildFailedError, subprocess.CalledProcessError) as error:
        if _exit_status(error) == CLIError.status:
            raise SystemExit(CLIError.status) from None
        raise


def _exit_without_finalizers() -> None:
    """End the process as Python's own exit does, but for its last stage: join the non-daemon Python threads (and
    run ``threading``'s exit hooks, e.g. ``concurrent.futures``' pools), run the ``atexit`` handlers (a tracker's
    final sync such as ``wandb.finish``, ``logging.shutdown``, ``weakref.finalize`` callbacks), flush stdout and
    stderr, then ``os._exit(0)``: no garbage collection, so no object is freed and no ``__del__`` runs (the
    trainer, still referenced by the caller, is never freed). The threads and handlers run while the trainer is
    alive, before anything is torn down."""
    import atexit
    import threading

    try:
        shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx runs first (CPython's, private)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()  # then this: every handler, in reverse order; errors are printed, not raised
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
