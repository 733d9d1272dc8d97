"""Prompt-level pruning before rollout: per-prompt history, acceptance probabilities, and the training sampler.

No TRL import. The sampler replaces TRL's ``RepeatSampler`` in training and yields the same layout: each
generation batch is ``prompts_per_batch`` prompts, each repeated ``group_size`` times, and the whole batch
repeated ``repeat_count`` times. It walks the same shuffled order as ``RepeatSampler`` (one ``torch.randperm``
per epoch from a generator seeded with ``seed``) and accepts each candidate prompt ``j`` with probability
``q_j`` (1 for a prompt never seen), drawn when the epoch is planned.

What holds (``docs/prompt_pruning.md``), given the history when data epoch ``e`` is planned (it fixes ``q``,
``q_bar``, the mean of ``q`` over the dataset, and the token normalizer ``D_e``, ``estimator.expected_batch_tokens``)
and each prompt's gradient term ``g_j``: every prompt is a candidate once and accepted with probability ``q_j``,
an accepted prompt carries the weight ``q_bar / q_j`` and the normalizer ``D_e``, and trains exactly once (the
accepted prompts that do not fill a last batch head the next epoch's first batch, with their own weights and
normalizer), so ``E[sum of the epoch's weighted terms] = q_bar x sum_j g_j`` and ``E[accepted] = q_bar x M``
exactly. The only prompts that never train are the run's final leftover, fewer than ``prompts_per_batch``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler

from .estimator import expected_batch_tokens
from .pruning import keep_probabilities, refuse_taken_name


def prompt_acceptance_probabilities(
    scores: torch.Tensor, seen: torch.Tensor, keep_rate: float, keep_floor: float
) -> torch.Tensor:
    """``q = clip(score / tau_q, keep_floor, 1)`` on seen prompts with ``mean(q[seen]) = keep_rate`` (more
    when the floor forces it), ``q = 1`` on prompts never seen (``seen``: those with a score).

    Args:
        scores: (M,) each prompt's predicted score (a prompt score of ``register_prompt_score``).
        seen: (M,) bool, the prompts that have a score.
    """
    q = torch.ones_like(scores, dtype=torch.float64)
    if seen.any():
        q[seen], _ = keep_probabilities(scores[seen], keep_rate, keep_floor, zero_score_contributes=True)
    return q


# What a prompt's last group looked like: its rewards flat or spread, times where its mean reward lies in the run's
# range of group mean rewards (REWARD_BINS equal bins). The calibrated score predicts from this cell.
REWARD_BINS = 4
NUM_CELLS = 2 * REWARD_BINS
CALIBRATION_DECAY = 0.8  # weight of the old value in a cell's moving average of the next visit's mean |A|


def history_cell(mean_abs_advantage: float, mean_reward: float, reward_low: float, reward_high: float) -> int:
    """The cell of one observed group: ``2 x bin + flat``, ``bin`` the position of its mean reward in
    ``[reward_low, reward_high]`` cut into ``REWARD_BINS`` equal bins (0 when the range is empty or the reward
    is NaN), ``flat`` 1 when its mean |A| is 0 (every completion got the same reward)."""
    width = reward_high - reward_low
    position = (mean_reward - reward_low) / width if width > 0 and mean_reward == mean_reward else 0.0
    reward_bin = min(max(int(position * REWARD_BINS), 0), REWARD_BINS - 1)
    return 2 * reward_bin + int(mean_abs_advantage == 0.0)


PromptScore = Callable[["PromptPruningSampler"], "tuple[torch.Tensor, torch.Tensor]"]
_PROMPT_SCORES: dict[str, PromptScore] = {}


def register_prompt_score(name: str):
    """Register ``fn(sampler) -> (scores, known)`` as the prompt score ``name``: per prompt, the predicted mean
    |A| of its next group, from the history alone (fixed before the epoch's acceptance draw, which keeps the
    weights ``q_bar / q`` exact), and whether there is a prediction (a prompt without one gets ``q = 1``, like a
    prompt never seen). A taken name is refused (``pruning.refuse_taken_name``)."""

    def decorate(fn: PromptScore) -> PromptScore:
        refuse_taken_name("register_prompt_score", name, _PROMPT_SCORES.get(name), fn, _PROMPT_SCORES)
        _PROMPT_SCORES[name] = fn
        return fn

    return decorate


def prompt_scores() -> tuple[str, ...]:
    return tuple(_PROMPT_SCORES)


@register_prompt_score("ema")
def _ema_score(sampler: PromptPruningSampler) -> tuple[torch.Tensor, torch.Tensor]:
    """The moving average of the prompt's own groups' mean |A| (``prompt_history_decay``)."""
    return sampler.scores, sampler.seen


@register_prompt_score("calibrated")
def _calibrated_score(sampler: PromptPruningSampler) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean |A| that prompts seen in the same cell (``history_cell``) of their last group got at their next
    visit, a moving average over the run's revisits (``CALIBRATION_DECAY``). A policy that learns fast moves a
    prompt from cell to cell between visits (a group spread at one visit is often solved at the next); the cell's
    measured outcome follows that, where the prompt's own last score would not."""
    cells = sampler.cells.clamp(min=0)
    known = sampler.seen & (sampler.cells >= 0) & sampler.calibration_seen[cells]
    return torch.where(known, sampler.calibration[cells], 0.0), known


def update_history(scores: torch.Tensor, seen: torch.Tensor, indices, values, decay: float) -> None:
    """Exponential moving average, in place: ``score = decay * score + (1 - decay) * value``; the first value a
    prompt gets is taken as is."""
    for index, value in zip(indices, values):
        scores[index] = decay * scores[index] + (1.0 - decay) * value if seen[index] else value
        seen[index] = True


def cut_into_batches(
    carried: list, accepted: list, epoch_length: int, size: int, walk_owed: int
) -> tuple[list[dict], list, int]:
    """One epoch's batches: ``carried`` (``[prompt, weight, normalizer]`` accepted in an earlier epoch, not yet
    trained) then ``accepted`` (``[prompt, weight, normalizer, position in the epoch's order]``), cut into full
    batches of ``size``. Returns the batches (``prompts``, ``weights``, ``normalizers``, ``walked``), the entries
    left over (carried into the next epoch: every accepted prompt trains once) and the walk still owed.

    ``walked`` counts the epoch's candidates a batch walks past, up to its last prompt; the last batch also takes
    the epoch's tail, and the first the walk owed by earlier epochs that filled no batch: over the batches the
    walks sum to the candidates walked, so data progress follows the data (``walk_owed`` is what is not yet
    attributed when no batch is cut)."""
    entries = [[*entry, -1] for entry in carried] + [list(entry) for entry in accepted]
    count = len(entries) // size
    batches, walked_to = [], 0
    for b in range(count):
        chunk = entries[b * size : (b + 1) * size]
        end = epoch_length if b == count - 1 else chunk[-1][3] + 1
        walked = end - walked_to + (walk_owed if b == 0 else 0)
        batches.append({"prompts": [e[0] for e in chunk], "weights": [e[1] for e in chunk],
                        "normalizers": [e[2] for e in chunk], "walked": walked})
        walked_to = end
    leftover = [entry[:3] for entry in entries[count * size :]]
    return batches, leftover, 0 if count else walk_owed + epoch_length


class PromptPruningSampler(Sampler[int]):
    """TRL's repeat layout over prompts accepted with probability ``q`` (see the module docstring).

    Each data epoch is planned when it starts: ``q`` and the token normalizer ``D`` from the history at that
    time, one acceptance draw per prompt in the shuffled order, the prompts carried over from the previous
    epoch then the accepted ones cut into full batches (``cut_into_batches``: an incomplete last batch is carried
    into the next epoch, not dropped). Every planned batch is numbered and kept in ``decisions`` (prompts,
    weights, normalizers) until the trainer takes it with ``pop_decision``; the trainer feeds the history back
    with ``update``.

    ``__len__`` is the unpruned epoch length, which keeps the HF Trainer's step arithmetic (epochs, resume
    skipping) that of GRPO. With ``max_epochs`` (epoch-based runs) one iteration is one data epoch (or more, when
    one is too short to fill a batch), which ends early when pruned. Without it (``max_steps`` runs) one
    iteration yields exactly ``__len__`` indices, walking on into the next data epochs as needed, so the Trainer
    takes exactly ``max_steps`` steps. After ``load_state_dict`` the next iteration first yields ``skip_units()``
    placeholder units (the Trainer's resume logic discards that many batches), then goes on from the first batch
    not yet taken.
    """

    def __init__(
        self,
        num_prompts: int,
        group_size: int,
        prompts_per_batch: int,
        repeat_count: int,
        keep_rate: float,
        keep_floor: float,
        history_decay: float,
        shuffle: bool = True,
        seed: int = 0,
        accept_seed: int = 0,
        max_epochs: int | None = None,
        score: str = "ema",
    ):
        if score not in _PROMPT_SCORES:
            raise ValueError(f"prompt_score={score!r} is invalid: it must be one of {list(_PROMPT_SCORES)}.")
        self.num_prompts = num_prompts
        self.group_size = group_size
        self.prompts_per_batch = prompts_per_batch
        self.repeat_count = repeat_count
        self.keep_rate = keep_rate
        self.keep_floor = keep_floor
        self.history_decay = history_decay
        self.shuffle = shuffle
        self.seed = seed
        self.max_epochs = max_epochs
        self.scores = torch.zeros(num_prompts, dtype=torch.float64)  # moving average of the group's mean |A|
        self.lengths = torch.zeros(num_prompts, dtype=torch.float64)  # ... of its loss tokens per completion
        self.seen = torch.zeros(num_prompts, dtype=torch.bool)
        self.score = score
        self.cells = torch.full((num_prompts,), -1, dtype=torch.long)  # history_cell of the last group; -1: none
        self.calibration = torch.zeros(NUM_CELLS, dtype=torch.float64)  # per cell: the next visit's mean |A|
        self.calibration_seen = torch.zeros(NUM_CELLS, dtype=torch.bool)
        self.reward_range: list[float] | None = None  # [lowest, highest] group mean reward seen (NaN ones left out)
        self.epoch = 0  # data epochs planned so far
        self.batches_planned = 0
        self.plan: list[dict] = []  # the current data epoch's batches
        self.carry: list = []  # [prompt, weight, normalizer] accepted, not in a planned batch yet
        self.walk_owed = 0  # candidates walked by epochs that filled no batch
        self.next_batch = 0  # number of the next planned batch to yield
        self.decisions: dict[int, dict] = {}
        self.generator = torch.Generator().manual_seed(accept_seed)
        self.order_generator = torch.Generator().manual_seed(seed)
        self.skip_units = lambda: 0
        # The trainer sets ``share`` to send the main process's value to every rank: each epoch's float inputs
        # (q, its mean, D) are then the main process's on every rank, whatever the last bits of its own history.
        self.share = lambda value: value
        self._resume_from: int | None = None

    def _next_order(self) -> list[int]:
        """The order TRL's RepeatSampler walks in the next epoch: one randperm per epoch from a generator
        seeded with ``seed``."""
        if not self.shuffle:
            return list(range(self.num_prompts))
        return torch.randperm(self.num_prompts, generator=self.order_generator).tolist()

    def acceptance(self) -> torch.Tensor:
        scores, known = _PROMPT_SCORES[self.score](self)
        return prompt_acceptance_probabilities(scores, known, self.keep_rate, self.keep_floor)

    def normalizer(self) -> float | None:
        """``D`` of the next planned epoch (``estimator.expected_batch_tokens`` of the history); None while no
        prompt is seen."""
        return expected_batch_tokens(self.lengths, self.seen, self.prompts_per_batch, self.group_size)

    def _accepted(self, order: list[int], q: torch.Tensor) -> list[bool]:
        """One independent draw per candidate: accepted with probability ``q``."""
        draws = torch.rand(len(order), generator=self.generator, dtype=torch.float64)
        return [u < float(q[i]) for i, u in zip(order, draws.tolist())]

    def _plan_epoch(self) -> list[dict]:
        q = self.acceptance()
        q, q_bar, normalizer = self.share((q, float(q.mean()), self.normalizer()))
        order = self._next_order()
        accepted = [[i, q_bar / float(q[i]), normalizer, pos]
                    for pos, (i, a) in enumerate(zip(order, self._accepted(order, q))) if a]
        plan, self.carry, self.walk_owed = cut_into_batches(
            self.carry, accepted, len(order), self.prompts_per_batch, self.walk_owed
        )
        for batch in plan:
            batch.update(number=self.batches_planned, epoch=self.epoch, normalizer=normalizer, q_bar=q_bar,
                         accepted_fraction=len(accepted) / max(len(order), 1))
            self.batches_planned += 1
        self.epoch += 1
        return plan

    def _expand(self, prompts: list[int]) -> Iterator[int]:
        for _ in range(self.repeat_count):
            for index in prompts:
                yield from [index] * self.group_size

    def __iter__(self) -> Iterator[int]:
        units = self.num_prompts // self.prompts_per_batch  # generation batches in an unpruned epoch
        if self._resume_from is not None:
            self.next_batch, self._resume_from = self._resume_from, None
            placeholder = self.plan[0]["prompts"] if self.plan else list(range(self.prompts_per_batch))
            skipped = self.skip_units()
            for _ in range(skipped):
                for index in placeholder:
                    yield from [index] * self.group_size
            units -= -(-skipped // self.repeat_count)  # a placeholder stands for one of a unit's repeats
        elif self.max_epochs is not None:
            plan = []
            while not plan and self.epoch < self.max_epochs:  # an epoch too short for a batch carries into the next
                plan = self._plan_epoch()
            if not plan:
                return
            self.plan = plan
        empty_epochs = 0
        while units > 0:
            pending = [b for b in self.plan if b["number"] >= self.next_batch]
            if not pending:
                if self.max_epochs is not None or empty_epochs > 100:  # epoch-based, or nothing is ever accepted
                    return
                self.plan = self._plan_epoch()
                empty_epochs = 0 if self.plan else empty_epochs + 1
                continue
            batch = pending[0]
            self.decisions[batch["number"]] = batch
            self.next_batch = batch["number"] + 1
            units -= 1
            yield from self._expand(batch["prompts"])

    def __len__(self) -> int:
        return (
            (self.num_prompts // self.prompts_per_batch) * self.prompts_per_batch * self.group_size * self.repeat_count
        )

    def pop_decision(self, number: int) -> dict:
        """The planned batch ``number`` (its prompts, weights and normalizers); older ones are forgotten."""
        for stale in [n for n in self.decisions if n < number]:
            del self.decisions[stale]
        return self.decisions.pop(number)

    def update(self, prompts, mean_abs_advantages, mean_loss_tokens, mean_rewards=None) -> None:
        """Feed back one generation batch: per prompt, its group's mean |A|, mean loss tokens per completion and
        mean reward (None: unknown, NaN)."""
        prompts = list(prompts)
        mean_rewards = [math.nan] * len(prompts) if mean_rewards is None else list(mean_rewards)
        self._update_calibration(prompts, list(mean_abs_advantages), mean_rewards)
        update_history(self.lengths, self.seen.clone(), prompts, mean_loss_tokens, self.history_decay)
        update_history(self.scores, self.seen, prompts, mean_abs_advantages, self.history_decay)

    def _update_calibration(self, prompts: list, mean_abs_advantages: list, mean_rewards: list) -> None:
        """A revisited prompt's mean |A| goes into the moving average of the cell of its previous group; then each
        prompt's cell becomes its new group's."""
        observed = [float(r) for r in mean_rewards if r == r] + (self.reward_range or [])
        if observed:
            self.reward_range = [min(observed), max(observed)]
        low, high = self.reward_range or [0.0, 0.0]
        for index, score, reward in zip(prompts, mean_abs_advantages, mean_rewards):
            previous = int(self.cells[index])
            if previous >= 0:
                update_history(self.calibration, self.calibration_seen, [previous], [score], CALIBRATION_DECAY)
            self.cells[index] = history_cell(score, reward, low, high)

    def state_dict(self) -> dict:
        return {
            "scores": self.scores.tolist(),
            "lengths": self.lengths.tolist(),
            "seen": self.seen.tolist(),
            "cells": self.cells.tolist(),
            "calibration": self.calibration.tolist(),
            "calibration_seen": self.calibration_seen.tolist(),
            "reward_range": self.reward_range,
            "epoch": self.epoch,
            "batches_planned": self.batches_planned,
            "plan": self.plan,
            "carry": self.carry,
            "walk_owed": self.walk_owed,
            "generator": self.generator.get_state().tolist(),
            "order_generator": self.order_generator.get_state().tolist(),
        }

    def load_state_dict(self, state: dict, next_batch: int) -> None:
        """Restore, and resume at planned batch ``next_batch`` (the first one the trainer has not taken)."""
        self.scores = torch.tensor(state["scores"], dtype=torch.float64)
        self.lengths = torch.tensor(state["lengths"], dtype=torch.float64)
        self.seen = torch.tensor(state["seen"], dtype=torch.bool)
        if "cells" in state:  # checkpoints before the calibrated score have none of it
            self.cells = torch.tensor(state["cells"], dtype=torch.long)
            self.calibration = torch.tensor(state["calibration"], dtype=torch.float64)
            self.calibration_seen = torch.tensor(state["calibration_seen"], dtype=torch.bool)
            self.reward_range = state["reward_range"]
        self.epoch = state["epoch"]
        self.batches_planned = state["batches_planned"]
        self.plan = list(state["plan"])
        self.carry = [list(entry) for entry in state["carry"]]
        self.walk_owed = state["walk_owed"]
        self.decisions = {}
        self.next_batch = next_batch
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        self.order_generator.set_state(torch.tensor(state["order_generator"], dtype=torch.uint8))
        self._resume_from = next_batch
