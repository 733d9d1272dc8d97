"""``dppo-trl``: the ``trl grpo`` command line with DPPO.

Every argument and YAML key of ``trl grpo`` (TRL's ``GRPOScriptArguments``, ``GRPOConfig``, ``ModelConfig``,
``DatasetMixtureConfig``, the ``env:`` mapping, the ``accelerate launch`` options such as ``--num_processes``
and ``--accelerate_config``), plus every ``DPPOConfig`` field, with the same precedence (flags over YAML). It is
built on TRL's own parser and training script: TRL's ``grpo.main`` runs with ``DPPOTrainer`` in place of
``GRPOTrainer``. Unlike ``trl grpo``, an unknown key stops it before anything is loaded, naming the closest
valid key.

    dppo-trl --config recipes/qwen3-4b-math-lora.yaml
    dppo-trl --config recipes/qwen3-4b-math.yaml --num_processes 8 --accelerate_config zero2
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys


def make_parser(prog: str = "dppo-trl"):
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    from .config import DPPOConfig

    return TrlParser(
        (GRPOScriptArguments, DPPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog, allow_abbrev=False
    )


def _launch_options() -> dict[str, bool]:
    """``accelerate launch`` option names (without dashes) -> whether the option takes a value."""
    from accelerate.commands.launch import launch_command_parser

    options = {"accelerate_config": True}
    for action in launch_command_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                options[flag[2:].replace("-", "_")] = action.nargs != 0
    return options


def split_launch_args(remaining: list[str], parser) -> list[str]:
    """The ``accelerate launch`` arguments among the strings the training parser did not take; any other
    string is an error that names it and, where there is one, the closest valid key."""
    options = _launch_options()
    launch, i = [], 0
    while i < len(remaining):
        item = remaining[i]
        name = item[2:].split("=", 1)[0].replace("-", "_") if item.startswith("--") else None
        if name not in options:
            known = [a.dest for a in parser._actions if a.dest != "help"] + list(options)
            close = difflib.get_close_matches(name or item, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SystemExit(f"dppo-trl: unknown argument or YAML key {item!r}.{hint}")
        launch.append(item)
        if options[name] and "=" not in item and i + 1 < len(remaining):
            launch.append(remaining[i + 1])
            i += 1
        i += 1
    return launch


def parse(argv: list[str]):
    """(script_args, training_args, model_args, dataset_args, launch_args, training_argv): every value
    validated, nothing loaded; ``training_argv`` is ``argv`` without the launch arguments."""
    parser = make_parser()
    *dataclasses_, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    launch_args = split_launch_args([str(x) for x in config_remaining + cli_remaining], parser)
    training_argv, pending = [], list(cli_remaining)
    for item in argv:  # argv minus the ordered subsequence the parser left over
        if pending and item == pending[0]:
            pending.pop(0)
        else:
            training_argv.append(item)
    return (*dataclasses_, launch_args, training_argv)


@contextlib.contextmanager
def _dppo_in_place_of_grpo():
    """TRL's training script builds `trl.GRPOTrainer`; let it build DPPOTrainer instead."""
    import trl

    from .trainer import DPPOTrainer

    original = trl.GRPOTrainer
    trl.GRPOTrainer = DPPOTrainer
    try:
        yield
    finally:
        trl.GRPOTrainer = original


def run(script_args, training_args, model_args, dataset_args) -> None:
    from trl.scripts.grpo import main as grpo_main

    with _dppo_in_place_of_grpo():
        grpo_main(script_args, training_args, model_args, dataset_args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        script_args, training_args, model_args, dataset_args, launch_args, training_argv = parse(argv)
    except ValueError as error:  # a bad value, from DPPOConfig / GRPOConfig validation
        raise SystemExit(f"dppo-trl: {error}") from None
    if launch_args and os.environ.get("DPPO_TRL_LAUNCHED") != "1":
        from accelerate.commands.launch import launch_command, launch_command_parser
        from trl.cli.accelerate_config import resolve_accelerate_config_argument

        accelerate_args = launch_command_parser().parse_args(
            resolve_accelerate_config_argument(launch_args) + ["--module", "dppo_trl"] + training_argv
        )
        os.environ["DPPO_TRL_LAUNCHED"] = "1"  # the launched processes run the training, not another launch
        launch_command(accelerate_args)
        return 0
    run(script_args, training_args, model_args, dataset_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
