"""What changes at run time for TRL's GRPO training script, each for the length of a ``with`` block and undone
after it: ``trl.GRPOTrainer`` builds DPPOTrainer, and ``datasets.load_dataset`` gives a ``reasoning_gym_task``'s
rows (``dppo_trl.tasks.reasoning_gym``) for the dataset name the script loads; and the line an interrupted run
ends with (``interruption_line``)."""

from __future__ import annotations

import contextlib
import functools
import os
import shlex


def training_set_name(script_args) -> str | None:
    """The training set as the model card names it: a reasoning-gym task or a local dataset in words, a Hub
    dataset by its id; None for a mixture of ``datasets``."""
    if script_args.reasoning_gym_task is not None:
        return f"the reasoning-gym task `{script_args.reasoning_gym_task}`"
    name = script_args.dataset_name
    if name and os.path.exists(name):
        return f"the local dataset `{name}`"
    return name


@contextlib.contextmanager
def _dppo_in_place_of_grpo(made: list, dataset: str | None = None):
    """TRL's training script builds `trl.GRPOTrainer`; let it build DPPOTrainer instead, each one appended to
    ``made`` (which keeps it alive after the script returns), its model card naming ``dataset``
    (``training_set_name``). A mistake the trainer finds in its inputs before the model loads
    (``dppo_trl.preflight``) is a CLIError."""
    import trl

    from ..preflight import PreflightError
    from ..trainer import DPPOTrainer
    from .arguments import CLIError

    def build(*args, **kwargs):
        try:
            made.append(DPPOTrainer(*args, **kwargs))
            made[-1].model_card_dataset = dataset
        except PreflightError as error:  # e.g. the loaded dataset has no prompt column: found before the model loads
            raise CLIError(str(error)) from None
        return made[-1]

    original = trl.GRPOTrainer
    trl.GRPOTrainer = build
    try:
        yield
    finally:
        trl.GRPOTrainer = original


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

    from ..tasks.reasoning_gym import reasoning_gym_dataset

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


def interruption_line(trainer, output_dir: str | None, argv: list[str]) -> str:
    """The one line a run stopped by Ctrl-C ends with: the step it reached (where the trainer was built), the last
    checkpoint kept in ``output_dir`` and the command that resumes from it (``argv`` with
    ``--resume_from_checkpoint true``), or that there is none to resume from."""
    from transformers.trainer_utils import get_last_checkpoint

    reached = ""
    if trainer is not None:
        reached = f" at step {trainer.state.global_step} of {trainer.state.max_steps or trainer.args.max_steps}"
    if output_dir is None:  # interrupted before the command line was read
        return "dppo-trl: interrupted."
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        return f"dppo-trl: interrupted{reached}; no checkpoint was saved in {output_dir}: there is none to resume from."
    resume, i = [], 0
    while i < len(argv):  # argv without an earlier --resume_from_checkpoint
        if argv[i] == "--resume_from_checkpoint":
            i += 2
            continue
        if not argv[i].startswith("--resume_from_checkpoint="):
            resume.append(argv[i])
        i += 1
    command = shlex.join(["dppo-trl", *resume, "--resume_from_checkpoint", "true"])
    return (f"dppo-trl: interrupted{reached}; the checkpoints in {output_dir} are kept (the last: "
            f"{os.path.basename(last)}). Resume with: {command}")
