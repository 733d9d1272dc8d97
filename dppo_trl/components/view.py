"""What a component sees of the trainer: the rank, agreement across ranks, the seeds, a metric sink. The host
implements it (``dppo_trl.host.view``); a test gives a component a fake (``SingleProcessView``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

import torch

from ..core.metrics import drop_last_entry
from ..core.seeds import derive_seed


class TrainerView(Protocol):
    """The trainer as a component sees it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated along dim 0 in rank order."""

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``tensor``."""

    def same_on_every_rank(self, value):
        """The main process's ``value`` on every rank, bit for bit."""

    def seed(self, stream: str, iteration: int = 0) -> int:
        """This generation batch's seed of ``stream`` (``core.seeds``) for its ``iteration``."""

    def log_metric(self, name: str, value: float) -> None:
        """One value of the train metric ``name`` (TRL's log averages a step's values)."""

    def replace_metric(self, name: str, value: float) -> None:
        """``value`` in place of the value last logged for ``name`` (TRL's, of the same pass)."""

    def drop_metric(self, name: str) -> None:
        """Remove the value last logged for ``name`` (no estimate of it), and the name once it holds none."""


def local_rows(view: TrainerView, rows_per_rank: int) -> slice:
    """This rank's rows of a batch gathered from every rank (TRL's process slice)."""
    return slice(view.rank * rows_per_rank, (view.rank + 1) * rows_per_rank)


class SingleProcessView:
    """A ``TrainerView`` of one process: its metrics in ``metrics``, its seeds from ``base_seed`` at ``position``
    (micro-steps; an iteration starts ``steps_per_generation`` after the previous one)."""

    rank, world_size, device = 0, 1, torch.device("cpu")

    def __init__(self, base_seed: int = 0, steps_per_generation: int = 1):
        self.base_seed, self.steps_per_generation, self.position = base_seed, steps_per_generation, 0
        self.metrics = defaultdict(list)

    def gather(self, tensor):
        return tensor

    def reduce_sum(self, tensor):
        return tensor

    def same_on_every_rank(self, value):
        return value

    def seed(self, stream, iteration=0):
        return derive_seed(stream, self.base_seed, self.position + iteration * self.steps_per_generation)

    def log_metric(self, name, value):
        self.metrics[name].append(value)

    def replace_metric(self, name, value):
        self.metrics[name][-1] = value

    def drop_metric(self, name):
        drop_last_entry(self.metrics, name)
