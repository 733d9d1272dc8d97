"""What ``dppo-trl --help`` shows: DPPO's options first, in the groups of ``DPPOConfig``'s docstring, then the
launch options and the reasoning-gym keys, and one line on how to see the rest.
``--help-all`` adds every option of TRL's GRPO script, of ``GRPOConfig``, of transformers' ``TrainingArguments``,
of ``ModelConfig`` and of ``DatasetMixtureConfig``, a section each. Only the help is laid out here: what parses
is the parser's own actions, unchanged (``arguments.make_parser``)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import textwrap

HELP_ALL = ("--help-all", "--help_all")  # the flag of the full help, with dashes and, as every HF flag, underscores

# Launch options shown with their help text; the other `accelerate launch` options are listed by name.
COMMON_LAUNCH_OPTIONS = (
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

# Where an installed user reads more: nothing here may point into the repository (a wheel holds no docs/).
_DPPO_TEXT = (
    "DPPO's options, by what they control. Each is a flag or a YAML key. The full explanation of each is in "
    "Python's help(dppo_trl.DPPOConfig); complete examples are the recipes in {recipes}."
)
_LAUNCH_TEXT = (
    "Flags or YAML keys; any of them starts the run under `accelerate launch`, as `trl grpo` does. "
    "--num_processes N > 1 on the CPU starts N processes (torch.distributed.run, gloo); on GPUs where accelerate "
    "would start one process, it is refused."
)
_REASONING_GYM_TEXT = "dppo-trl's own keys: a reasoning-gym task as the training set, in place of dataset_name."
_DASHES = (
    "Every option also takes dashes (--completion-keep-rate); a switch that defaults to true also takes "
    "--no_NAME (--no_packing)."
)


class HelpAll(argparse.Action):
    """``--help-all``: print the full help and exit, as ``-h`` does for the short one."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_full_help(), sys.stdout)
        parser.exit()


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the option help (as TRL's); the help column at 32, where most DPPO flags and their metavar end;
    lines broken between words only (not in ``log-prob`` or a dotted name); a text's indented lines (the
    description's examples) kept as written."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32)

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text, width, indent):
        lines = []
        for line in text.splitlines():
            if line.startswith(" ") or not line:
                lines.append(indent + line)
            else:
                lines += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent,
                                       break_on_hyphens=False, break_long_words=False)
        return "\n".join(lines)


_TYPE_METAVARS = {"int": "INT", "float": "FLOAT", "str": "TEXT", "string_to_bool": "BOOL"}


def _metavar(action):
    """A metavar by the option's type (``FLOAT``) in place of HF's (the field's name in capitals); ``NAME`` for a
    long list of choices that the help names one by one; argparse's own otherwise (short choices, a switch)."""
    if action.nargs == 0:
        return action.metavar
    if action.choices:
        names = [str(c) for c in action.choices]
        listed = action.help and all(name in action.help for name in names)
        return "NAME" if listed and len(",".join(names)) > 24 else action.metavar
    return _TYPE_METAVARS.get(getattr(action.type, "__name__", None), action.metavar)


def shown(action):
    """``action`` as the help shows it: its flags without their twins (``--keep_floor``, not also ``--keep-floor``,
    which parses all the same) and a short metavar. A copy: the parser's action is unchanged."""
    out, kept = copy.copy(action), []
    for flag in action.option_strings:
        if {"--" + flag[2:].replace("-", "_"), "--" + flag[2:].replace("_", "-")}.isdisjoint(kept):
            kept.append(flag)
    out.option_strings, out.metavar = kept, _metavar(action)
    return out


def dppo_groups() -> dict[str, list[str]]:
    """DPPOConfig's groups (``"completion pruning"``), in the docstring's order, each with its fields."""
    from ..config_reference import field_docs

    groups: dict[str, list[str]] = {}
    for doc in field_docs()[1]:
        groups.setdefault(doc.group, []).append(doc.name)
    return groups


def _trl_sections() -> list[tuple[str, set[str]]]:
    """The sections of the options that are not DPPO's, by the class that declares each field."""
    from transformers import TrainingArguments
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    def names(cls, without=()):
        return {f.name for f in dataclasses.fields(cls)} - set(without)

    training = names(TrainingArguments)
    return [
        ("TRL's GRPO script (GRPOScriptArguments)", names(GRPOScriptArguments)),
        ("TRL's GRPOConfig", names(GRPOConfig, training)),
        ("transformers' TrainingArguments (with GRPOConfig's defaults)", training),
        ("TRL's ModelConfig", names(ModelConfig)),
        ("TRL's DatasetMixtureConfig", names(DatasetMixtureConfig)),
    ]


def _by_dest(parser) -> dict[str, list]:
    """The parser's training options by field name (a switch that defaults to true has two: --x and --no_x)."""
    actions: dict[str, list] = {}
    for action in parser._actions:
        if action.dest != argparse.SUPPRESS and action.dest != "help":
            actions.setdefault(action.dest, []).append(action)
    return actions


def _section(formatter, title: str, actions, text=None, after=None, defaults: bool = True) -> None:
    """A section of ``actions`` as ``shown``, between ``text`` and ``after``; ``defaults=False``: without the
    "(default: ...)" of each option (accelerate's own help has none)."""
    formatter.start_section(title)
    if text:
        formatter.add_text(text)
    items = [shown(a) for a in actions]
    if not defaults:
        for item in items:
            item.default = argparse.SUPPRESS
    formatter.add_arguments(items)
    if after:
        formatter.add_text(after)
    formatter.end_section()


def _head(parser, formatter) -> None:
    """The usage, the description, and the help flags and --config."""
    formatter.add_usage(parser.usage, [], [])
    formatter.add_text(parser.description)
    top = [a for a in parser._actions if a.dest in ("help", argparse.SUPPRESS)]
    _section(formatter, "options", top)


def _dppo(formatter, by_dest: dict[str, list], short: bool) -> None:
    """DPPO's groups; the short help leaves out the --no_x twin of a switch (its help says what False does)."""
    from .recipes import recipes_dir

    formatter.add_text(_DPPO_TEXT.format(recipes=recipes_dir()))
    for group, fields in dppo_groups().items():
        actions = [a for name in fields for a in by_dest[name] if not (short and a.nargs == 0)]
        _section(formatter, group, actions)


def _launch(formatter, parser, launch_actions: list, short: bool) -> None:
    scratch = argparse.ArgumentParser(add_help=False)
    scratch.add_argument(
        "--accelerate_config",
        metavar="NAME_OR_FILE",
        help="An accelerate config: one that TRL ships (zero1, zero2, zero3, fsdp1, fsdp2, multi_gpu) "
        "or a file. It becomes accelerate's --config_file.",
    )
    training = {action.dest for action in parser._actions}
    common, others = list(scratch._actions), []
    for action in launch_actions:
        if action.dest in training:  # e.g. gradient_accumulation_steps: the training argument takes it
            continue
        if action.dest in COMMON_LAUNCH_OPTIONS:
            common.append(action)
        else:
            others.append(next(o for o in action.option_strings if o.startswith("--")))
    if short:
        text = f"Every other `accelerate launch` option ({len(others)} more, e.g. --zero_stage) is taken as well."
    else:
        text = "Every other `accelerate launch` option is taken as well: " + ", ".join(others) + "."
    _section(formatter, "launch options", common, _LAUNCH_TEXT, text, defaults=False)


def _reasoning_gym(formatter, by_dest: dict[str, list], script_keys: list[str]) -> None:
    actions = [a for name in script_keys for a in by_dest[name]]
    _section(formatter, "reasoning-gym dataset", actions, _REASONING_GYM_TEXT)


def _rest(by_dest: dict[str, list], shown_names: set[str]) -> tuple[list[tuple[str, list]], int]:
    """The sections of every option not shown in the short help, and how many options (fields) they hold."""
    sections, left = [], {name: actions for name, actions in by_dest.items() if name not in shown_names}
    for title, names in _trl_sections():
        actions = [a for name in list(left) if name in names for a in left.pop(name)]
        if actions:
            sections.append((title, actions))
    if left:  # a field of none of those classes (none today): still listed
        sections.append(("other options", [a for actions in left.values() for a in actions]))
    return sections, sum(len({a.dest for a in actions}) for _, actions in sections)


def _compose(parser, launch_actions: list, script_keys: list[str], full: bool) -> str:
    formatter = _Formatter(parser.prog)
    by_dest = _by_dest(parser)
    dppo = {name for fields in dppo_groups().values() for name in fields}
    mine = dppo | set(script_keys)
    _head(parser, formatter)
    _dppo(formatter, by_dest, short=not full)
    _launch(formatter, parser, launch_actions, short=not full)
    _reasoning_gym(formatter, by_dest, script_keys)
    sections, count = _rest(by_dest, mine)
    if full:
        for title, actions in sections:
            _section(formatter, title, actions)
        formatter.add_text(_DASHES)
    else:
        formatter.add_text(
            f"Not shown: {count} options of TRL and transformers (the GRPO script's, GRPOConfig, TrainingArguments, "
            "ModelConfig, DatasetMixtureConfig: --model_name_or_path, --dataset_name, --reward_funcs, "
            f"--learning_rate, ...) and the other launch options. {_DASHES}\n"
            f"To see every option: {parser.prog} {HELP_ALL[0]}"
        )
    return formatter.format_help()


def short_help(parser, launch_actions: list, script_keys: list[str]) -> str:
    """``dppo-trl --help``: DPPO's options, the launch options and the reasoning-gym keys (``script_keys``: the
    script arguments' fields that TRL's lack)."""
    return _compose(parser, launch_actions, script_keys, full=False)


def full_help(parser, launch_actions: list, script_keys: list[str]) -> str:
    """``dppo-trl --help-all``: the short help's sections, then every other option, a section per class."""
    return _compose(parser, launch_actions, script_keys, full=True)
