"""What changes at run time for TRL's GRPO training script, each for the length of a ``with`` block and undone
after it: ``trl.GRPOTrainer`` builds DPPOTrainer, and ``datasets.load_dataset`` gives a ``reasoning_gym_task``'s
rows (``dppo_trl.tasks.reasoning_gym``) for the dataset name the script loads."""

from __future__ import annotations

import contextlib
import functools


@contextlib.contextmanager
def _dppo_in_place_of_grpo(made: list):
    """TRL's training script builds `trl.GRPOTrainer`; let it build DPPOTrainer instead, each one appended to
    ``made`` (which keeps it alive after the script returns). A mistake the trainer finds in its inputs before the
    model loads (``dppo_trl.preflight``) is a CLIError."""
    import trl

    from ..preflight import PreflightError
    from ..trainer import DPPOTrainer
    from .arguments import CLIError

    def build(*args, **kwargs):
        try:
            made.append(DPPOTrainer(*args, **kwargs))
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
