"""Prompt pruning before rollout: which of a step's candidate prompts are generated, and their weights.

No TRL import. A step's candidates are exactly the prompts GRPO's sampler yields for it, ``P`` on each rank. A
fixed-size design accepts ``m`` of each rank's ``P`` with inclusion probabilities ``pi_j`` (``sum pi = m`` per rank,
``pi_j >= floor``), so every rank generates the same number of groups. Only the accepted prompts are generated,
scored and trained, each group weighted ``1 / pi_j``. The probabilities are fixed before the draw, from what is known
then: the prompt's history (earlier groups of the same prompt) and a probe (``k`` completions of every candidate,
generated and scored first, kept in the group when the prompt is accepted). So for any per-group terms ``g_j``,
``E[sum_j accepted_j g_j / pi_j] = sum_j g_j`` exactly, for every rank and every probe outcome.

A normalizer that counts the batch's tokens is fixed before the draw too (``expected_candidate_tokens``): the
candidates' expected loss tokens, from the probe's lengths or the history. What holds per loss type is in
``docs/prompt_pruning.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

import torch

from .pruning import keep_probabilities, refuse_taken_name, zero_variance_mask


def prompt_key(prompt) -> str:
    """A stable key of a prompt (a string or chat messages): the history is kept per key, so it needs no dataset
    index and works with streaming datasets."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def accepted_per_rank(keep_rate: float, candidates_per_rank: int) -> int:
    """``m``: the prompts each rank accepts of its ``P`` candidates, ``round(keep_rate x P)``, at least 1."""
    return min(max(round(keep_rate * candidates_per_rank), 1), candidates_per_rank)


def cut_probabilities(scores: torch.Tensor, accepted: int, floor: float) -> torch.Tensor:
    """Inclusion probabilities of one rank's ``P`` candidates: ``clip(score / tau, floor, 1)`` with ``sum = m``
    (``accepted``), float64. Equal scores give ``m / P`` each. Needs ``floor x P <= m`` (else no ``pi`` sums to
    ``m``: refused).

    Args:
        scores: (P,) each candidate's predicted signal (a prompt score of ``register_prompt_score``), >= 0.
    """
    count = scores.numel()
    if accepted >= count:
        return torch.ones(count, dtype=torch.float64)
    if floor * count > accepted * (1 + 1e-12):
        raise ValueError(f"a floor of {floor!r} over {count} candidates sums past the {accepted} accepted: the "
                         "fixed-size draw could not accept each with its probability (DPPOConfig refuses this).")
    pi, _ = keep_probabilities(scores, accepted / count, floor, zero_score_contributes=True)
    return pi


def fixed_size_sample(pi: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """Systematic sampling over a random order: exactly ``size`` candidates (``sum(pi) == size``), candidate ``j``
    with probability exactly ``pi[j]``. The candidates' intervals of length ``pi`` are laid end to end in a random
    order, scaled to end exactly at ``size`` (float rounding of the sum), and the points ``u + i`` pick them.

    Args:
        pi: (P,) float64 inclusion probabilities, each in [0, 1], summing to ``size`` up to rounding.
    Returns:
        (P,) bool: the accepted candidates.
    """
    order = torch.randperm(pi.numel(), generator=generator)
    start = float(torch.rand((), generator=generator, dtype=torch.float64))
    return fixed_size_sample_at(pi, size, order, start)


def fixed_size_sample_at(pi: torch.Tensor, size: int, order: torch.Tensor, start: float) -> torch.Tensor:
    """``fixed_size_sample`` for a given order and start point (for enumerating its outcomes)."""
    p = pi.detach().to(torch.float64)[order]
    upper = torch.cumsum(p, 0)
    if upper.numel():
        upper = upper * (size / float(upper[-1])) if float(upper[-1]) > 0 else upper
    lower = torch.cat([upper.new_zeros(1), upper[:-1]])
    hit = (torch.ceil(upper - start) > torch.ceil(lower - start)) & (p > 0)
    accepted = torch.zeros(pi.numel(), dtype=torch.bool)
    accepted[order] = hit
    return accepted


def expected_candidate_tokens(predicted_lengths: torch.Tensor, group_size: int) -> float:
    """The token normalizer of a cut step: the loss tokens GRPO's batch of every candidate is expected to hold,
    ``group_size x`` the sum of each candidate's predicted loss tokens per completion. A function of what is known
    before the acceptance draw, so an unbiased weighted numerator over it stays unbiased.

    Args:
        predicted_lengths: (C,) per candidate of every rank, its predicted loss tokens per completion.
    """
    return max(float(group_size) * float(predicted_lengths.to(torch.float64).sum()), 1.0)


def spread_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(C,) bool: the groups of ``group_size`` consecutive rewards that are not all equal (NaN ignored)."""
    return zero_variance_mask(rewards, group_size).view(-1, group_size)[:, 0]


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


def moving_average(old: float | None, value: float, decay: float) -> float:
    """``decay x old + (1 - decay) x value``; the first value is taken as is."""
    return value if old is None else decay * old + (1.0 - decay) * value


class PromptHistory:
    """Per prompt key: the moving averages of its groups' mean |A| (``score``) and mean loss tokens per completion
    (``length``), and the cell of its last group; per cell, the mean |A| the prompts in it got at their next visit
    (the calibration). Plain floats, saved in checkpoints as JSON."""

    def __init__(self, decay: float):
        self.decay = decay
        self.prompts: dict[str, dict] = {}
        self.calibration: list[float | None] = [None] * NUM_CELLS
        self.reward_range: list[float] | None = None

    def update(self, keys: Sequence[str], mean_abs_advantages, mean_loss_tokens, mean_rewards) -> None:
        """Feed back the accepted groups: per group, its key, mean |A|, mean loss tokens and mean reward (NaN:
        unknown)."""
        observed = [float(r) for r in mean_rewards if r == r] + (self.reward_range or [])
        if observed:
            self.reward_range = [min(observed), max(observed)]
        low, high = self.reward_range or [0.0, 0.0]
        for key, score, length, reward in zip(keys, mean_abs_advantages, mean_loss_tokens, mean_rewards):
            entry = self.prompts.setdefault(key, {"score": None, "length": None, "cell": None})
            if entry["cell"] is not None:
                cell = entry["cell"]
                self.calibration[cell] = moving_average(self.calibration[cell], float(score), CALIBRATION_DECAY)
            entry["score"] = moving_average(entry["score"], float(score), self.decay)
            entry["length"] = moving_average(entry["length"], float(length), self.decay)
            entry["cell"] = history_cell(float(score), float(reward), low, high)

    def lengths(self, keys: Sequence[str]) -> torch.Tensor | None:
        """Each key's predicted loss tokens per completion (an unseen prompt: the mean over the seen ones); None
        while no prompt is seen."""
        seen = [e["length"] for e in self.prompts.values() if e["length"] is not None]
        if not seen:
            return None
        mean = sum(seen) / len(seen)
        return torch.tensor([self._get(k, "length", mean) for k in keys], dtype=torch.float64)

    def _get(self, key: str, field: str, default: float) -> float:
        entry = self.prompts.get(key)
        return default if entry is None or entry[field] is None else entry[field]

    def state_dict(self) -> dict:
        return {"prompts": self.prompts, "calibration": self.calibration, "reward_range": self.reward_range}

    def load_state_dict(self, state: dict) -> None:
        self.prompts = {key: dict(entry) for key, entry in state["prompts"].items()}
        self.calibration = list(state["calibration"])
        self.reward_range = state["reward_range"]


class CutInputs:
    """What a prompt score sees of a step's candidates (every rank's, in order): their keys, the history, and the
    probe's rewards (``(C, k)``, None without a probe)."""

    def __init__(self, keys: Sequence[str], history: PromptHistory, probe_rewards: torch.Tensor | None):
        self.keys, self.history, self.probe_rewards = list(keys), history, probe_rewards


PromptScore = Callable[[CutInputs], torch.Tensor]
_PROMPT_SCORES: dict[str, PromptScore] = {}
_PROBE_SCORES: set[str] = set()


def register_prompt_score(name: str, needs_probe: bool):
    """Register ``fn(inputs: CutInputs) -> (C,) scores >= 0`` as the prompt score ``name``: per candidate, its
    predicted signal, from what is known before the acceptance draw. A taken name is refused."""

    def decorate(fn: PromptScore) -> PromptScore:
        refuse_taken_name("register_prompt_score", name, _PROMPT_SCORES.get(name), fn, _PROMPT_SCORES)
        _PROMPT_SCORES[name] = fn
        if needs_probe:
            _PROBE_SCORES.add(name)
        return fn

    return decorate


def prompt_scores() -> tuple[str, ...]:
    return tuple(_PROMPT_SCORES)


def probe_scores() -> tuple[str, ...]:
    """The scores that need a probe (``prompt_probe_generations >= 2``)."""
    return tuple(name for name in _PROMPT_SCORES if name in _PROBE_SCORES)


def prompt_score(name: str) -> PromptScore:
    if name not in _PROMPT_SCORES:
        raise ValueError(f"prompt_score={name!r} is invalid: it must be one of {list(_PROMPT_SCORES)}.")
    return _PROMPT_SCORES[name]


def _history_fallback(values: list[float | None], pool: list[float | None]) -> torch.Tensor:
    """Known values as they are; unknown ones the mean of the known values of ``pool`` (every seen prompt's, or
    every measured cell's; all equal when none is known)."""
    known = [v for v in pool if v is not None]
    mean = sum(known) / len(known) if known else 1.0
    return torch.tensor([mean if v is None else v for v in values], dtype=torch.float64)


@register_prompt_score("probe", needs_probe=True)
def _probe_score(inputs: CutInputs) -> torch.Tensor:
    """1 where the probe's rewards differ (the group has signal), 0 where they agree: the flat probes share what
    the floor and the budget leave."""
    return spread_groups(inputs.probe_rewards.flatten(), inputs.probe_rewards.size(1)).double()


@register_prompt_score("ema", needs_probe=False)
def _ema_score(inputs: CutInputs) -> torch.Tensor:
    """The moving average of the prompt's own groups' mean |A| (an unseen prompt: the mean over every seen one)."""
    history = inputs.history
    pool = [entry["score"] for entry in history.prompts.values()]
    return _history_fallback([history._get(k, "score", None) for k in inputs.keys], pool)


@register_prompt_score("calibrated", needs_probe=False)
def _calibrated_score(inputs: CutInputs) -> torch.Tensor:
    """The mean |A| that prompts whose last group fell in the same cell (``history_cell``) got at their next visit,
    measured over the run (an unseen prompt, or a cell without a measure: the mean over the measured cells)."""
    history = inputs.history
    cells = [history._get(k, "cell", None) for k in inputs.keys]
    return _history_fallback([None if c is None else history.calibration[c] for c in cells], history.calibration)


def cut_decision(scores: torch.Tensor, ranks: int, accepted: int, floor: float, generator: torch.Generator):
    """Every rank's draw: ``(pi, accepted mask)`` over the ``ranks x P`` candidates (rank-major), ``m``
    (``accepted``) of each rank's ``P`` with ``cut_probabilities``.

    Args:
        scores: (ranks x P,) the candidates' scores.
    """
    per_rank = scores.to(torch.float64).view(ranks, -1)
    pi = torch.stack([cut_probabilities(s, accepted, floor) for s in per_rank])
    keep = torch.stack([fixed_size_sample(p, accepted, generator) for p in pi])
    return pi.flatten(), keep.flatten()
