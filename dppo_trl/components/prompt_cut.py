"""Prompt pruning's cut (``prompt_keep_rate < 1``): the step's candidates are the prompts TRL's own sampler yields;
a fixed-size draw accepts ``m`` of each rank's candidates, from their scores (the history of earlier steps, or a
probe of a few completions each); only the accepted groups are generated, scored and trained, weighted ``1 / pi``.
The math is in ``dppo_trl.core.prompts``; the probe's generation is the host's (``host.prompt_probe``)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..core.prompts import (
    CutInputs,
    PromptHistory,
    accepted_per_rank,
    cut_decision,
    expected_candidate_tokens,
    prompt_score,
    spread_groups,
)
from .generation_batch import GenerationBatch
from .view import TrainerView

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Probe:
    """The probe of one step: ``k`` completions of every candidate, generated and scored before the draw.

    Args:
        rewards: (C, k) every rank's candidates' weighted reward sums (NaN where every function gave None).
        loss_tokens: (C, k) their loss tokens.
        completion_ids: this rank's candidates' completions, ``k`` token lists each.
        logprobs: this rank's candidates' sampling log-probs (``k`` lists each), or None.
    """

    k: int
    rewards: torch.Tensor
    loss_tokens: torch.Tensor
    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]] | None


@dataclasses.dataclass
class PromptCut:
    """One step's cut over every rank's candidates (``C = ranks x P``, rank-major).

    Args:
        keys: the candidates' prompt keys.
        pi: (C,) float64 inclusion probabilities (``sum = m`` on each rank).
        accepted: (C,) bool.
        normalizer: the token count a token-mean loss divides by, fixed before the draw; None when every candidate
            is accepted (the batch's own count is GRPO's).
        ranks: the processes.
        probe: this rank's probe (not sent between ranks), or None.
    """

    keys: list[str]
    pi: torch.Tensor
    accepted: torch.Tensor
    normalizer: float | None
    ranks: int
    probe: Probe | None = None

    def local(self, rank: int) -> torch.Tensor:
        """(P,) bool: rank ``rank``'s accepted candidates."""
        per_rank = self.accepted.numel() // self.ranks
        return self.accepted[rank * per_rank : (rank + 1) * per_rank]


class PromptCutter:
    """Which candidates of each step are generated, with what weight; owns the history of earlier steps.

    Args:
        config: the run's ``DPPOConfig``.
        rewards: the TRL trainer's reward form (``adapters.grpo.GRPORewards``).
        view: the trainer (``components.view.TrainerView``).
    """

    def __init__(self, config, rewards, view: TrainerView):
        self.config, self.rewards, self.view = config, rewards, view
        self.history: PromptHistory | None = None  # made at the first cut (a run without one saves none)

    def candidates(self, inputs: list[dict]) -> list[dict]:
        """The step's candidates of this rank: one of TRL's rows per group (``inputs``: ``P`` prompts, ``G`` rows
        each)."""
        group = self.rewards.group_size
        if any(key in x for x in inputs for key in ("image", "images")):
            raise NotImplementedError(
                "DPPO's prompt pruning does not support multimodal batches yet; set prompt_keep_rate=1.0."
            )
        if len(inputs) % group:
            raise ValueError(
                f"prompt_keep_rate={self.config.prompt_keep_rate!r} needs whole groups on every rank: each process's "
                f"generation batch (per_device_train_batch_size x steps_per_generation = {len(inputs)} rows) must be "
                f"a multiple of num_generations={group}."
            )
        return [inputs[i] for i in range(0, len(inputs), group)]

    def accepted_rows(self, inputs: list[dict], cut: PromptCut) -> list[dict]:
        """This rank's rows of the accepted candidates, in order."""
        group = self.rewards.group_size
        local = cut.local(self.view.rank).tolist()
        return [row for j, taken in enumerate(local) if taken for row in inputs[j * group : (j + 1) * group]]

    def decide(self, keys: list[str], probe: Probe | None, candidates_per_rank: int) -> PromptCut:
        """Scores, inclusion probabilities, the draw and the normalizer, from what is known before the draw."""
        config = self.config
        history = self._history()
        lengths = probe.loss_tokens.double().mean(1) if probe is not None else history.lengths(keys)
        ranks = self.view.world_size
        accepted = accepted_per_rank(config.prompt_keep_rate, candidates_per_rank)
        # Nothing known of any candidate, or m = P: every candidate is accepted and the step is GRPO's.
        if lengths is None or accepted == candidates_per_rank:
            ones = torch.ones(len(keys), dtype=torch.float64)
            return PromptCut(keys, ones, ones.bool(), None, ranks)
        probe_rewards = None if probe is None else probe.rewards
        scores = prompt_score(config.prompt_score)(CutInputs(keys, history, probe_rewards))
        generator = torch.Generator().manual_seed(self.view.seed("prompt_cut"))
        pi, keep = cut_decision(scores, ranks, accepted, config.prompt_keep_floor, generator)
        return PromptCut(keys, pi, keep, expected_candidate_tokens(lengths, self.rewards.group_size), ranks)

    def spliced(self, cut: PromptCut, prompt_ids, generate, group: int):
        """``(completion_ids, logprobs)`` of the accepted rows (``group`` a prompt): the probe's ``k`` completions of
        each accepted candidate, then ``group - k`` generated now by ``generate(prompt_ids, count)``."""
        probe, k = cut.probe, cut.probe.k
        mine = [j for j, taken in enumerate(cut.local(self.view.rank).tolist()) if taken]
        rest = [ids for g in range(len(mine)) for ids in prompt_ids[g * group + k : (g + 1) * group]]
        new_ids, new_logprobs = generate(rest, group - k)
        completion_ids, logprobs = [], None if new_logprobs is None or probe.logprobs is None else []
        for g, j in enumerate(mine):
            completion_ids += probe.completion_ids[j] + list(new_ids[g * (group - k) : (g + 1) * (group - k)])
            if logprobs is not None:
                logprobs += probe.logprobs[j] + list(new_logprobs[g * (group - k) : (g + 1) * (group - k)])
        return completion_ids, logprobs

    def take_decision(self, scores: torch.Tensor, batch: GenerationBatch) -> tuple[torch.Tensor, float | None]:
        """The accepted rows' prompt weights ``1 / pi`` (every rank's rows) and the token normalizer fixed before
        the draw (None when every candidate was accepted: the batch's own count, TRL's, stands); feeds the groups
        back to the history."""
        cut, group = batch.cut, self.rewards.group_size
        weights = (1.0 / cut.pi[cut.accepted]).repeat_interleave(group)
        loss_tokens = batch.loss_tokens.double()
        normalizer = float(loss_tokens.sum()) if cut.normalizer is None else cut.normalizer
        keys = [key for key, taken in zip(cut.keys, cut.accepted.tolist()) if taken]
        group_rewards = self.rewards.aggregate(batch.rewards_per_func).double().view(-1, group)
        self._history().update(keys, scores.abs().view(-1, group).mean(1).tolist(),
                               loss_tokens.view(-1, group).mean(1).tolist(), group_rewards.nanmean(1).tolist())
        self._log_metrics(cut, weights, loss_tokens, normalizer, group_rewards)
        return weights, cut.normalizer

    def _log_metrics(self, cut: PromptCut, weights, loss_tokens, normalizer: float, group_rewards) -> None:
        log, group = self.view.log_metric, self.rewards.group_size
        candidates, accepted = cut.accepted.numel(), int(cut.accepted.sum())
        k = 0 if cut.probe is None else cut.probe.k
        generated = candidates * k + accepted * (group - k)
        log("dppo/prompt_accepted_fraction", accepted / candidates)
        log("dppo/prompt_generated_fraction", generated / (candidates * group))
        spread = spread_groups(group_rewards.flatten(), group).double()
        log("dppo/prompt_flat_fraction", 1.0 - float(spread.mean()) if accepted else 0.0)
        log("dppo/prompt_weight_max", float(weights.max()) if weights.numel() else 0.0)
        # Its mean over steps estimates E[T] / D, the scale of the fixed normalizer (1 when D is exact).
        log("dppo/prompt_token_scale", float((loss_tokens * weights).sum()) / max(normalizer, 1.0))

    def _history(self) -> PromptHistory:
        if self.history is None:
            self.history = PromptHistory(self.config.prompt_history_decay)
        return self.history

    def state_dict(self) -> dict | None:
        return None if self.history is None else {"history": self.history.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "history" not in state:
            logger.warning("DPPO: this checkpoint holds the prompt sampler of an earlier version (its history was per "
                           "dataset row); prompt pruning goes on with an empty history.")
            return
        self._history().load_state_dict(state["history"])
