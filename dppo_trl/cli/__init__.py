"""``dppo-trl``: the ``trl grpo`` command line with DPPO.

Every argument and YAML key of ``trl grpo`` (TRL's ``GRPOScriptArguments``, ``GRPOConfig``, ``ModelConfig``,
``DatasetMixtureConfig``, the ``env:`` mapping, the ``accelerate launch`` options such as ``--num_processes``
and ``--accelerate_config``), plus every ``DPPOConfig`` field, with the same precedence (flags over YAML). It is
built on TRL's own parser and training script: TRL's ``grpo.main`` runs with ``DPPOTrainer`` in place of
``GRPOTrainer``. Unlike ``trl grpo``, an unknown key stops it before anything is loaded, naming the closest
valid key. ``--config`` takes a YAML file or the name of a recipe shipped in the package (``recipes/`` of the
repository, ``dppo_trl/recipes`` once installed). ``--num_processes N`` > 1 on the CPU starts N processes
(torch.distributed.run, gloo), where ``accelerate launch`` would start one; on GPUs where it would start one,
it is refused (see ``launch.process_plan``).

    dppo-trl --config qwen3-4b-math-lora
    dppo-trl --config my.yaml --num_processes 8 --accelerate_config zero2

``dppo-trl --help`` shows DPPO's options, by group, and the launch options; ``dppo-trl --help-all`` shows every
option, TRL's and transformers' included.

The package, one idea a module: ``arguments`` (what a command line and its YAML mean, checked before anything
loads, the model paths and reward functions with ``dppo_trl.preflight``), ``keys`` (a misspelled key, found
before TRL loads, against the generated ``_known_keys``), ``help`` (what ``--help`` and
``--help-all`` show), ``recipes`` (the shipped recipes), ``launch`` (how a run with launch options gets its
processes), ``runtime`` (what TRL's training script gets in place of GRPOTrainer and of a dataset load). This
module composes them: ``main`` and ``run``.
"""

from __future__ import annotations

import sys

from .arguments import (
    CLIError,
    _check_demo_prepared,
    _expand_model_path,
    check_inputs,
    make_parser,
    parse,
    resolve_config,
    resolve_config_argument,
    script_arguments_class,
    split_launch_args,
    split_launch_keys,
)
from .launch import (
    _exit_without_finalizers,
    is_main_process,
    launch,
    needs_launch,
    plan_launch,
    process_plan,
    report,
)
from .recipes import bundled_recipes, recipes_dir
from .runtime import _dppo_in_place_of_grpo, _reasoning_gym_as_dataset, interruption_line, training_set_name

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (128 + SIGINT), as a shell reports it

__all__ = [
    "CLIError",
    "bundled_recipes",
    "main",
    "make_parser",
    "parse",
    "plan_launch",
    "process_plan",
    "recipes_dir",
    "resolve_config",
    "resolve_config_argument",
    "run",
    "script_arguments_class",
    "split_launch_args",
    "split_launch_keys",
]


def run(script_args, training_args, model_args, dataset_args, made: list | None = None) -> None:
    """TRL's GRPO training script with DPPOTrainer. A process of a group of CPU processes (gloo) ends right after
    the script (which saved the model and destroyed the process group), without freeing the trainer: freeing
    DDP's reducer frees its gloo process group, whose destructor joins gloo's worker thread while holding the
    GIL, and that thread may still need the GIL to free the last collective's tensors, so a finished rank hangs
    at exit (a torch race, pytorch/pytorch#56297; measured: 1 two-process run in 6). It ends through
    ``_exit_without_finalizers``: the exit handlers run (a tracker's final sync), only the finalizers do not."""
    from trl.scripts.grpo import main as grpo_main

    made = [] if made is None else made  # the trainer TRL's script builds, appended when it is built
    evaluates = training_args.eval_strategy != "no"
    dataset = training_set_name(script_args)  # before a reasoning-gym task is given a dataset name
    with _dppo_in_place_of_grpo(made, dataset), _reasoning_gym_as_dataset(script_args, evaluates):
        grpo_main(script_args, training_args, model_args, dataset_args)
    accelerator = made[-1].accelerator if made else None
    if accelerator is not None and accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        _exit_without_finalizers()


def main(argv: list[str] | None = None) -> int:
    """``dppo-trl ARGV``: every check, then the launch or the run. A ``CLIError`` (from the checks, or from the
    trainer's own checks of what TRL's script loaded) is printed as its one line before it exits; under a launch
    of several processes, each of which meets it, once (``launch.report``). Ctrl-C ends it with one line
    (``interruption_line``) and status 130."""
    from .keys import check_known_keys  # here, so that `python -m dppo_trl.cli.keys` runs it as __main__

    argv = list(sys.argv[1:] if argv is None else argv)
    made, output_dir, plan = [], None, None
    try:
        check_known_keys(argv)  # a typo found before torch and TRL load
        script_args, training_args, model_args, dataset_args, launch_args, training_argv = parse(argv)
        output_dir = training_args.output_dir
        _expand_model_path(model_args)
        _check_demo_prepared(script_args, model_args)
        plan = plan_launch(launch_args, training_argv, training_args.use_cpu) if needs_launch(launch_args) else None
        check_inputs(script_args, training_args, model_args)
        if plan is not None:
            launch(*plan)
        else:
            run(script_args, training_args, model_args, dataset_args, made)
    except CLIError as error:
        report(error)
        raise
    except KeyboardInterrupt:
        if plan is None and is_main_process():  # under a launch, its main process says it
            line = interruption_line(made[-1] if made else None, output_dir, argv)
            print(f"\n{line}", file=sys.stderr, flush=True)  # on a line of its own, after a progress bar's
        return INTERRUPTED
    return 0
