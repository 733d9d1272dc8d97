"""The ``TrainerView`` (``components.view``) the host gives its components: the trainer's accelerator, its
training position and TRL's metric store, behind the few calls a component makes."""

from __future__ import annotations

import torch
from accelerate.utils import broadcast_object_list

from ..core.metrics import drop_last_entry
from ..core.seeds import derive_seed


class HostView:
    """A trainer (TRL's, with DPPO's host) as its components see it."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def rank(self) -> int:
        return self._trainer.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self._trainer.accelerator.num_processes

    @property
    def device(self) -> torch.device:
        return self._trainer.accelerator.device

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._trainer.accelerator.gather(tensor)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._trainer.accelerator.reduce(tensor, reduction="sum")

    def same_on_every_rank(self, value):
        """The main process's ``value``, sent to every rank (pickled, so bit for bit). Decisions that every rank
        must share (keep mask, prompt acceptance) are taken from it, never from each rank's own floats: the last
        bit of a float can differ between machines, and a design can be sensitive to it (a tie in a sort, a rank
        cut-off of ``balanced``'s SVD)."""
        if self.world_size == 1:
            return value
        return broadcast_object_list([value], from_process=0)[0]

    def training_position(self) -> int:
        """Micro-steps taken since the start of training, from the optimizer steps (so a resumed run counts on)."""
        trainer = self._trainer
        ga = trainer.args.gradient_accumulation_steps
        return trainer.state.global_step * ga + trainer._step % ga

    def seed(self, stream: str, iteration: int = 0) -> int:
        """This generation batch's seed of ``stream`` (``core.seeds``), indexed by the training position at which
        its ``iteration`` starts (``steps_per_generation`` micro-steps an iteration)."""
        args = self._trainer.args
        base = args.prune_seed if args.prune_seed is not None else args.seed
        return derive_seed(stream, base, self.training_position() + iteration * args.steps_per_generation)

    def log_metric(self, name: str, value: float) -> None:
        self._trainer._metrics["train"][name].append(value)

    def replace_metric(self, name: str, value: float) -> None:
        self._trainer._metrics["train"][name][-1] = value

    def drop_metric(self, name: str) -> None:
        drop_last_entry(self._trainer._metrics["train"], name)
