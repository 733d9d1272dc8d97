"""What a checkpoint or a saved model of ``DPPOTrainer`` says about itself: the model card names DPPO, its paper
and this package (TRL's card, with ``_name`` and ``_paper`` DPPO's), and a section lists DPPO's settings of the run; the
completions table (``log_completions``) gets each completion's keep decision and weight.

Reads of the host trainer: ``args``, ``_logs`` (TRL's completions table), ``create_model_card`` (TRL's)."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

from trl import GRPOConfig, GRPOTrainer

from .._version import __version__
from .generation_batch import GenerationBatch

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


def dppo_card_section(args, version: str) -> str:
    """The model card's DPPO section: what was trained, the package, the settings and GRPO's citation."""
    rows = "\n".join(f"| `{name}` | `{value!r}` |" for name, value in dppo_settings(args).items())
    return (
        "\n## DPPO\n\n"
        f"Trained with dppo-trl {version} (`DPPOTrainer`): DPPO, Dynamic Pruning Policy Optimization "
        "([arXiv 2603.04135](https://arxiv.org/abs/2603.04135)). Its objective is GRPO's (TRL's `GRPOTrainer`). "
        "Each step trains on a random subset of the completions, each kept one weighted by 1 / its keep "
        "probability (Horvitz-Thompson), so the expected gradient is GRPO's.\n\n"
        f"| setting | value |\n|---|---|\n{rows}\n\n"
        f"Cite GRPO, whose objective DPPO estimates, as:\n\n```bibtex\n{GRPOTrainer._paper['citation']}\n```\n"
    )


class DPPOModelCard:
    """Mixed into ``DPPOTrainer``."""

    _name = "DPPO"
    _paper = PAPER

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card (it names DPPO and its paper), with the DPPO section appended."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        with open(path, "a", encoding="utf-8") as card:
            card.write(dppo_card_section(self.args, __version__))

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
