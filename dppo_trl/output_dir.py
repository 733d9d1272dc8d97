"""A user's files in ``output_dir`` are left alone: before a run writes there, the entries a save would overwrite
(a model's files, its tokenizer, the model card, ``checkpoint-*`` folders that checkpoint rotation would delete or
a save of the same step would overwrite) are refused unless this package wrote them, which it records in
``OUTPUTS_RECORD`` when it writes them (after each save; ``completions/`` after each log that writes it), or the run
resumes from one of that folder's checkpoints. No TRL import."""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

from .preflight import PreflightError

OUTPUTS_RECORD = ".dppo-trl-outputs.json"  # what dppo-trl wrote into this folder, by name
SUMMARY_FILE = "dppo_summary.json"  # the run's summary (``host.summary``), written at the end of training

# What a save writes at the top of a folder (transformers, PEFT, tokenizers, processors, TRL's card and table).
SAVED_NAMES = (
    "README.md", "config.json", "generation_config.json", "training_args.bin",
    "model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json",
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "completions", SUMMARY_FILE,
)
CHECKPOINT_PATTERN = "checkpoint-*"


def at_risk(name: str, saves_checkpoints: bool) -> bool:
    """Whether a save of this run can overwrite or delete the entry ``name`` at the top of ``output_dir``."""
    if fnmatch.fnmatch(name, CHECKPOINT_PATTERN):
        return saves_checkpoints
    return any(fnmatch.fnmatch(name, pattern) for pattern in SAVED_NAMES)


def recorded_outputs(output_dir: str | os.PathLike) -> set[str]:
    """The names this package recorded as its own saves in ``output_dir`` (empty without a record)."""
    path = Path(output_dir) / OUTPUTS_RECORD
    try:
        names = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    return {name for name in names if isinstance(name, str)} if isinstance(names, list) else set()


def resumes_within(output_dir: str | os.PathLike, resume_from_checkpoint) -> bool:
    """Whether the run resumes from a checkpoint of ``output_dir``: ``True`` (its last one) or a path in it."""
    if resume_from_checkpoint is True:
        return True
    if not resume_from_checkpoint or not isinstance(resume_from_checkpoint, (str, os.PathLike)):
        return False
    folder, checkpoint = Path(output_dir).resolve(), Path(resume_from_checkpoint).resolve()
    return folder in checkpoint.parents


def _empty_folder(path: Path) -> bool:
    """An empty folder: nothing in it to overwrite or delete (TRL makes ``completions/`` when it is built)."""
    return path.is_dir() and next(path.iterdir(), None) is None


def foreign_outputs(output_dir, resume_from_checkpoint=None, saves_checkpoints: bool = True) -> list[str]:
    """The entries of ``output_dir`` that a save of this run would overwrite or delete and that this package did
    not write, sorted; none where the run resumes from one of the folder's checkpoints."""
    folder = Path(output_dir)
    if not folder.is_dir() or resumes_within(folder, resume_from_checkpoint):
        return []
    ours = recorded_outputs(folder)
    names = [entry.name + ("/" if entry.is_dir() else "") for entry in folder.iterdir()
             if at_risk(entry.name, saves_checkpoints) and entry.name not in ours and not _empty_folder(entry)]
    return sorted(names)


def check_output_dir(output_dir, resume_from_checkpoint=None, saves_checkpoints: bool = True) -> None:
    """Refuse, with one line (a ``PreflightError``, a ``ValueError``), an ``output_dir`` that holds entries a save
    would overwrite or delete and that this package did not write (``foreign_outputs``)."""
    foreign = foreign_outputs(output_dir, resume_from_checkpoint, saves_checkpoints)
    if not foreign:
        return
    shown = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
    has_checkpoints = any(fnmatch.fnmatch(entry.name, CHECKPOINT_PATTERN) for entry in Path(output_dir).iterdir())
    resume = ", or resume from one of its checkpoints (resume_from_checkpoint)" if has_checkpoints else ""
    raise PreflightError(
        f"output_dir={str(output_dir)!r} holds {shown}, which this run's saves would overwrite or delete and which "
        f"dppo-trl did not write. Choose a new or empty output_dir or move those files away{resume}."
    )


def record_outputs(output_dir, since: float) -> None:
    """Record, as this package's own, the entries of ``output_dir`` a save writes that changed at or after
    ``since`` (the run's start, ``time.time()``): what this run's saves and logs wrote, not a user's file it left
    alone."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return
    written = {entry.name for entry in folder.iterdir() if at_risk(entry.name, True) and entry.stat().st_mtime >= since}
    names = {name for name in recorded_outputs(folder) | written if (folder / name).exists()}
    (folder / OUTPUTS_RECORD).write_text(json.dumps(sorted(names), indent=1))
