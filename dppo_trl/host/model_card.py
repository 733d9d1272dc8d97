"""What a checkpoint or a saved model of ``DPPOTrainer`` says about itself: the model card names DPPO, its paper
and this package (TRL's card, with ``_name`` and ``_paper`` DPPO's), and a section lists DPPO's settings of the run; the
completions table (``log_completions``) gets each completion's keep decision and weight.

Reads of the host trainer: ``args``, ``model``, ``_logs`` (TRL's completions table), ``create_model_card`` (TRL's),
``_summary`` (the run's summary, ``host.summary``)."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .._version import __version__
from ..components.generation_batch import GenerationBatch

PAPER = {
    "title": "Dynamic Pruning Policy Optimization",
    "id": "2603.04135",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @misc{dppo2026,
            title        = {{Dynamic Pruning Policy Optimization}},
            year         = 2026,
            eprint       = {arXiv:2603.04135},
        }"""),
}

# The GRPO settings a DPPO run's card repeats beside DPPO's own: what the estimate is an estimate of.
_GRPO_FIELDS = ("loss_type", "beta", "num_generations", "num_iterations", "steps_per_generation")


def dppo_settings(args) -> dict:
    """The fields ``DPPOConfig`` adds to ``GRPOConfig``, with the GRPO fields that define the objective."""
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in grpo}
    return {**{name: getattr(args, name) for name in _GRPO_FIELDS}, **own}


def run_card_lines(summary: dict) -> str:
    """The card's account of the run: its summary line's figures, as a table."""
    speed = summary.get("speed") or {}
    rows = [("steps", summary["steps"]), ("wall time", f"{summary['seconds']:.0f} s"),
            ("reward, first -> last log", " -> ".join("n/a" if summary.get(key) is None else f"{summary[key]:.3f}"
                                                      for key in ("reward_first_log", "reward_last_log")))]
    for key, label in (("kept_fraction", "completions kept"), ("prompt_accepted_fraction", "prompts accepted")):
        if key in summary:
            rows.append((label, f"{summary[key]:.3f}"))
    if speed:
        rows += [("step time / GRPO's (measured on this run)", f"{speed['step_time_ratio']:.2f}"),
                 ("projected time saved", f"{speed['projected_seconds_saved']:.0f} s of GRPO's "
                                          f"{speed['projected_grpo_seconds']:.0f} s (measuring's "
                                          f"{speed['measuring_seconds']:.0f} s counted against it)")]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return f"\n### This run\n\n| | |\n|---|---|\n{table}\n\n`{summary['line']}`\n"


def dppo_card_section(args, version: str, summary: dict | None = None) -> str:
    """The model card's DPPO section: what was trained, the package, the settings, the run's summary where it
    ended, and GRPO's citation."""
    rows = "\n".join(f"| `{name}` | `{value!r}` |" for name, value in dppo_settings(args).items())
    return (
        "\n## DPPO\n\n"
        f"Trained with dppo-trl {version} (`DPPOTrainer`): DPPO, Dynamic Pruning Policy Optimization "
        "([arXiv 2603.04135](https://arxiv.org/abs/2603.04135)). Its objective is GRPO's (TRL's `GRPOTrainer`). "
        "Each step trains on a random subset of the completions, each kept one weighted by 1 / its keep "
        "probability (Horvitz-Thompson), so the expected gradient is GRPO's.\n\n"
        f"| setting | value |\n|---|---|\n{rows}\n"
        f"{run_card_lines(summary) if summary else ''}\n"
        f"Cite GRPO, whose objective DPPO estimates, as:\n\n```bibtex\n{GRPOTrainer._paper['citation']}\n```\n"
    )


def name_training_set(card: str, dataset: str | None) -> str:
    """The card's first sentence names the training set: a Hub dataset by TRL's template (a link, passed to it as
    ``dataset_name``), anything else (a local dataset, a reasoning-gym task: ``dataset`` in words, with a space)
    appended here."""
    if not dataset or " " not in dataset:
        return card
    return card.replace(".\nIt has been trained using [TRL]", f" on {dataset}.\nIt has been trained using [TRL]", 1)


def name_local_model(card: str, model_path: str, output_dir: str) -> str:
    """TRL's card for a model loaded from a folder names no base model ("[None](https://huggingface.co/None)")
    and loads ``model="None"`` in its quick start: name the folder, and load the model from ``output_dir``."""
    card = card.replace("[None](https://huggingface.co/None)", f"the local model `{model_path}`")
    return card.replace('model="None"', f'model="{output_dir}"')


class DPPOModelCard:
    """Mixed into ``DPPOTrainer``."""

    _name = "DPPO"
    _paper = PAPER
    # The training set as the card names it, where known: a Hub dataset's id, or in words a local dataset or a
    # reasoning-gym task (``dppo-trl`` sets it from ``dataset_name`` or ``reasoning_gym_task``).
    model_card_dataset: str | None = None

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card (it names DPPO and its paper, and the training set where known), with the DPPO section
        appended."""
        named = dataset_name or self.model_card_dataset
        hub_id = named if named and " " not in named else None
        super().create_model_card(model_name=model_name, dataset_name=hub_id, tags=tags)
        if not self.is_world_process_zero():
            return
        path = Path(self.args.output_dir, "README.md")
        base = get_config_model_id(self.model.config) or "(built in memory, without a name)"
        card = name_local_model(path.read_text(encoding="utf-8"), base, self.args.output_dir)
        card = name_training_set(card, named)
        summary = self._summary.summary if "_summary" in self.__dict__ else None
        path.write_text(card + dppo_card_section(self.args, __version__, summary), encoding="utf-8")

    def _write_model_card(self) -> None:
        """The model card into ``output_dir``, named as TRL names it at a checkpoint (its ``_save_checkpoint``): the
        final save of the model writes it too, over the template card PEFT saves with an adapter."""
        name = self.args.hub_model_id.split("/")[-1] if self.args.hub_model_id else Path(self.args.output_dir).name
        self.create_model_card(model_name=name)

    def _log_keep_columns(self, batch: GenerationBatch) -> None:
        """Each completion's keep decision and weight into TRL's completions table, beside its advantage (the
        rows TRL logged for this batch, in the same order: every rank's, gathered)."""
        if not self.args.log_completions:
            return
        self._logs["extra"]["dppo_keep"].extend(batch.keep.tolist())
        self._logs["extra"]["dppo_weight"].extend(batch.weights.tolist())
