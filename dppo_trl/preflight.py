"""The mistakes that are not config values, found before anything loads: a reward function that does not import, a
model path that does not exist, a dataset whose rows have no ``prompt``, a tracker in ``report_to`` that is not
installed. Each is a ``PreflightError`` (a
``ValueError``) of one line that names the field and what to fix. ``dppo-trl`` checks the reward functions and the
model paths when it parses its command line (``cli.arguments.check_inputs``); ``DPPOTrainer`` checks its own inputs
(``check_trainer_inputs``) before ``GRPOTrainer.__init__`` loads the model. Nothing here imports TRL or reaches the
Hub: a Hub model id is left to the Hub, except offline, where it must be in the local cache."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

# The names `trl grpo` reads in reward_funcs besides dotted paths: the registry in `trl.scripts.grpo.main` (a local
# variable there; tests/test_preflight.py reads it from TRL's source, so a change in TRL fails that test).
TRL_REWARD_FUNCS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)


class PreflightError(ValueError):
    """A mistake found before anything loads: one line that names the field and what to fix."""


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


@contextlib.contextmanager
def _cwd_on_path():
    """The current directory first on ``sys.path`` for the block, as TRL's script puts it before it imports a reward
    function's module."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def _import_module(module_name: str, path: str, field: str):
    """The module of the reward function ``path``, imported as TRL's script imports it."""
    with _cwd_on_path():
        try:
            return importlib.import_module(module_name)
        except Exception as error:
            missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
            if missing and f"{module_name}.".startswith(f"{missing}."):
                raise PreflightError(
                    f"{field} {path!r}: there is no module {missing!r} in {os.getcwd()} or among the installed "
                    "packages: fix the dotted path, or run from the folder that holds the module."
                ) from None
            raise PreflightError(
                f"{field} {path!r}: importing {module_name!r} failed: {type(error).__name__}: {_one_line(error)}"
            ) from None


def _check_dotted_path(path: str, field: str) -> None:
    """``path`` (``module.function``) names a callable of a module that imports."""
    module_name, attribute = path.rsplit(".", 1)
    module = _import_module(module_name, path, field)
    if not hasattr(module, attribute):
        public = [name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name, None))]
        raise PreflightError(
            f"{field} {path!r}: module {module_name!r} ({getattr(module, '__file__', None) or 'built in'}) has no "
            f"{attribute!r}.{_did_you_mean(attribute, public)}"
        )
    if not callable(getattr(module, attribute)):
        kind = type(getattr(module, attribute)).__name__
        raise PreflightError(f"{field} {path!r} is not callable (it is of type {kind}): name a reward function.")


def check_reward_funcs(names, field: str = "reward_funcs") -> None:
    """Each of ``names`` (``trl grpo``'s ``reward_funcs``) is what TRL's script can load: a name of its registry
    (``TRL_REWARD_FUNCS``) or the dotted import path of a callable (the module imported, as TRL does, with the
    current directory first on ``sys.path``)."""
    for name in names or ():
        if name in TRL_REWARD_FUNCS:
            continue
        if "." not in name:
            raise PreflightError(
                f"{field} {name!r} is neither one of TRL's reward functions ({', '.join(TRL_REWARD_FUNCS)}) nor a "
                f"dotted import path (my_module.my_reward).{_did_you_mean(name, TRL_REWARD_FUNCS)}"
            )
        _check_dotted_path(name, field)


def _is_hub_id(name: str) -> bool:
    """Whether ``name`` can be a Hub model id (``name`` or ``org/name``); anything else can only be a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_cache_holds(name: str, cache_dir: str | None) -> bool:
    """Whether the local Hub cache holds a snapshot of the model ``name``."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    snapshots = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=name, repo_type="model")
    snapshots = snapshots / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def check_model_path(name: str, field: str = "model_name_or_path", cache_dir: str | None = None) -> None:
    """``name`` is a model that loading can find: an existing folder, or a Hub model id. A name that can only be a
    path (absolute, ``./``, ``../``, ``~/``, or not a valid Hub id such as ``runs/a/b``) must exist. A Hub id while
    the Hub is off (``HF_HUB_OFFLINE=1``) must be in the local cache (``cache_dir``, else the Hub's default); online
    it is left to the Hub."""
    from huggingface_hub import constants

    path = Path(name)  # as transformers reads it: no ~ expanded (dppo-trl expands it when it parses)
    if path.is_file():
        raise PreflightError(f"{field} {name!r} is a file: pass the folder that holds the model (its config.json).")
    if path.is_dir():
        return
    if not _is_hub_id(name):
        raise PreflightError(
            f"{field} {name!r} does not exist (no folder {path.absolute()}): fix the path, or pass a Hub model id."
        )
    if constants.is_offline_mode() and not _hub_cache_holds(name, cache_dir):
        raise PreflightError(
            f"{field} {name!r} is neither a folder in {os.getcwd()} nor in the local Hugging Face cache "
            f"({cache_dir or constants.HF_HUB_CACHE}), and the Hub is off (HF_HUB_OFFLINE=1): download it where the "
            f"Hub is reachable (hf download {name}), or pass a local folder."
        )


def yielded_columns(dataset) -> list[str] | None:
    """The columns of ``dataset``'s rows as the trainer reads them, or ``None`` where that cannot be told. A
    ``datasets.Dataset``'s are its first row's keys (a transform, ``with_transform`` or ``set_transform``, or a
    format may build or hide columns), the stored ones where it has no row and no transform; any other dataset's
    are its stored columns where it names them (a streamed one may not)."""
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, list):
        return None
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        return columns
    if len(dataset) == 0:
        return None if dataset.format["type"] == "custom" else columns
    try:
        row = dataset[0]
    except Exception:  # e.g. a transform that fails: the trainer meets it and says so
        return None
    return list(row) if isinstance(row, Mapping) else None


def check_prompt_column(dataset, field: str) -> None:
    """``dataset`` (a ``datasets.Dataset`` or ``IterableDataset``) yields rows with a ``prompt``, which GRPO
    generates from (``yielded_columns``). A dataset whose rows' columns cannot be told, or no dataset, is not
    checked."""
    columns = yielded_columns(dataset)
    if columns is None or "prompt" in columns:
        return
    raise PreflightError(
        f"{field} has no 'prompt' column (its columns: {', '.join(columns) or 'none'}): GRPO generates from each "
        "row's prompt; rename the column that holds it (Dataset.rename_column(NAME, 'prompt')) or map the rows to one."
    )


def _check_reward_object(func, field: str, cache_dir: str | None) -> None:
    """A reward function as ``GRPOTrainer`` takes it: a callable (a function or a model), or a string, which it loads
    as a reward model (so TRL's registry names, which only its script reads, are refused here)."""
    if isinstance(func, str):
        if func in TRL_REWARD_FUNCS:
            raise PreflightError(
                f"{field} {func!r} is a name only `trl grpo` and `dppo-trl` read; the trainer loads a string as a "
                f"reward model: pass the function itself (from trl.rewards import {func})."
            )
        check_model_path(func, field, cache_dir)
    elif not callable(func):
        raise PreflightError(
            f"{field} is not callable (it is of type {type(func).__name__}): pass a function, a reward model or its "
            "path."
        )


# The trackers `report_to` names whose installed package transformers detects
# (`get_available_reporting_integrations`), with the pip package each needs.
TRACKER_PACKAGES = {
    "clearml": "clearml", "codecarbon": "codecarbon", "comet_ml": "comet_ml", "dagshub": "dagshub",
    "dvclive": "dvclive", "kubeflow": "kubeflow", "mlflow": "mlflow", "neptune": "neptune", "swanlab": "swanlab",
    "tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb",
}


def check_report_to(report_to, field: str = "report_to") -> None:
    """Each tracker ``report_to`` names is one transformers knows, and its package is installed (else transformers
    stops with a traceback once the model has loaded): one line with the pip command."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = [name for name in names if name not in ("none", "all")]
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            raise PreflightError(f"{field}={name!r} is not a tracker transformers reports to; one of "
                                 f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}, 'all' or 'none'."
                                 f"{_did_you_mean(name, INTEGRATION_TO_CALLBACK)}")
    available = set(get_available_reporting_integrations())
    missing = [name for name in names if name in TRACKER_PACKAGES and name not in available]
    if missing:
        packages = " ".join(TRACKER_PACKAGES[name] for name in missing)
        raise PreflightError(f"{field} names {', '.join(missing)}, which is not installed: `pip install {packages}`, "
                             "or leave it out of report_to (report_to='none' reports to no tracker).")


def check_trainer_inputs(model, reward_funcs, train_dataset, eval_dataset, args, environment_factory=None) -> None:
    """``DPPOTrainer``'s inputs that ``GRPOTrainer`` would otherwise refuse only after loading the model: the
    trackers of ``report_to``, a model path, the reward functions, and a ``prompt`` column in each dataset (not
    needed with an ``environment_factory``, whose ``reset()`` may give the prompt). ``args``: the config, whose
    ``model_init_kwargs`` may name a ``cache_dir``."""
    init_kwargs = args.model_init_kwargs if isinstance(args.model_init_kwargs, dict) else {}
    cache_dir = init_kwargs.get("cache_dir")
    check_report_to(args.report_to)
    if isinstance(model, str):
        check_model_path(model, "model", cache_dir)
    funcs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    for i, func in enumerate(funcs):
        _check_reward_object(func, f"reward_funcs[{i}]", cache_dir)
    if environment_factory is not None:
        return
    check_prompt_column(train_dataset, "train_dataset")
    evals = eval_dataset.items() if isinstance(eval_dataset, Mapping) else [(None, eval_dataset)]
    for key, dataset in evals:
        check_prompt_column(dataset, "eval_dataset" if key is None else f"eval_dataset[{key!r}]")
