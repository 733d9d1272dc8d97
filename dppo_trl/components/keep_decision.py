"""The keep decision of a generation batch: the pruning scores (every rank's advantages, exactly 0 where A is 0 in
exact arithmetic), the sampling design's mask and keep probabilities, the Horvitz-Thompson weights, the same on
every rank, and the ``dppo/*`` metrics of the decision. The math is in ``dppo_trl.core.pruning`` and
``dppo_trl.core.estimator``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..core.batch import loss_mask
from ..core.estimator import effective_sample_size, horvitz_thompson_weights
from ..core.pruning import PruneProblem, adaptive_keep_rate, get_design, pruning_relative_error, unbiased_designs
from .generation_batch import GenerationBatch
from .view import TrainerView


class KeepDecision:
    """Which rows of each generation batch train, with what weight, in each of ``num_iterations`` iterations.

    Args:
        config: the run's ``DPPOConfig``.
        rewards: the TRL trainer's reward form (``adapters.grpo.GRPORewards``): aggregated rewards and the rows
            whose advantage is exactly 0.
        view: the trainer (``components.view.TrainerView``).
        zero_score_contributes: whether a row with A == 0 still contributes (a KL or an entropy-bonus term), as
            the trainer's settings stand at the draw.
        error_scale: how much the measured pruning error exceeded the model's (the audit's; 1 without one).
    """

    def __init__(self, config, rewards, view: TrainerView, zero_score_contributes: Callable[[], bool],
                 error_scale: Callable[[], float] = lambda: 1.0):
        self.config, self.rewards, self.view = config, rewards, view
        self.zero_score_contributes, self.error_scale = zero_score_contributes, error_scale
        self.last_keep: torch.Tensor | None = None  # the last batch's rows some iteration keeps, on every rank

    def scores(self, advantages: torch.Tensor, batch: GenerationBatch) -> torch.Tensor:
        """(N,) every rank's advantages, gathered (a fixed-size gather), one per row: the advantage itself, or the
        largest |A| of the row where a trainer gives per-token advantages; exactly 0 on the rows whose A is 0 in
        exact arithmetic (``rewards.zero_advantage_rows``)."""
        advantages = self.view.gather(advantages.detach()).float().cpu()
        scores = advantages.abs().amax(dim=1) if advantages.dim() > 1 else advantages
        return torch.where(self.rewards.zero_advantage_rows(batch.rewards_per_func), 0.0, scores)

    def draw(self, output: dict, batch: GenerationBatch, scores: torch.Tensor) -> None:
        """The global keep decision, the main process's on every rank, into ``batch``: each iteration's weights,
        the rows some iteration keeps, ``keep_probabilities`` and ``prune_summary`` over every rank's rows, with
        the rows' token counts and every rank's kept rows, from which each rank derives the common micro-batch
        row counts and forward calls."""
        local_rows = output["advantages"].size(0)
        self.gather_row_tokens(output, batch)
        keeps, batch.keep_probabilities, batch.prune_summary = self.view.same_on_every_rank(self.decide(scores, batch))
        pi = batch.keep_probabilities
        batch.iteration_weights = keeps.double() if pi is None else horvitz_thompson_weights(pi, keeps)
        batch.keep = self.last_keep = keep = keeps.any(0)
        rows_per_rank = torch.arange(keep.numel()).view(self.view.world_size, local_rows)
        batch.kept_rows_per_rank = [rows[keep[rows]].tolist() for rows in rows_per_rank]

    def decide(self, scores: torch.Tensor, batch: GenerationBatch) -> tuple:
        """``(keeps, pi, summary)`` of the generation batch: ``keeps`` (num_iterations, N), one independent draw of
        the design per iteration, each seeded by the position where its iteration starts (an iteration that reused
        an earlier one's mask would start from parameters that depend on it: its expected gradient would not be
        GRPO's); the keep probabilities (the same for every iteration: the advantages are; None for the
        deterministic designs) and ``(keep rate, estimated pruning error)`` (None without ``pi``)."""
        iterations = self.config.num_iterations
        if not self.config.completion_pruning:  # packing only: every row, weight 1
            return torch.ones(iterations, scores.numel(), dtype=torch.bool), None, None
        problem = self.problem(scores, batch)
        design = get_design(self.config.prune_sampling)
        draws = [design(problem, torch.Generator().manual_seed(self.view.seed("keep", k))) for k in range(iterations)]
        pi = draws[0][1]
        summary = None if pi is None else (problem.keep_rate, pruning_relative_error(pi, problem.scores))
        return torch.stack([keep for keep, _ in draws]), pi, summary

    def problem(self, scores: torch.Tensor, batch: GenerationBatch) -> PruneProblem:
        """What the design sees of the generation batch; with ``adaptive_keep_error``, at the batch's own rate."""
        # A row with A == 0 contributes exactly zero unless a term without A (KL, entropy bonus) is on; a row
        # without loss tokens (e.g. masked as truncated) contributes nothing at all.
        config = self.config
        problem = PruneProblem(
            advantages=scores,  # signed where TRL's advantages are one per row
            costs=batch.sequence_lengths,
            groups=torch.arange(scores.numel()) // self.rewards.group_size,
            rewards=None if batch.rewards_per_func is None else self.rewards.aggregate(batch.rewards_per_func),
            keep_rate=config.completion_keep_rate * completion_budget_scale(batch),
            keep_floor=config.keep_floor,
            zero_score_contributes=self.zero_score_contributes(),
            contributes_nothing=batch.loss_tokens == 0,
            budget_in_tokens=config.keep_budget == "tokens",
            length_exponent=config.length_exponent,
        )
        if config.adaptive_keep_error is None or config.prune_sampling not in unbiased_designs():
            return problem
        # With adaptive_keep_error_source='audit', the target on the model-based error is scaled by how much the
        # measured error exceeded it on earlier audited batches (never this batch's draw).
        target = config.adaptive_keep_error / self.error_scale()
        return dataclasses.replace(problem, keep_rate=adaptive_keep_rate(problem, target))

    def gather_row_tokens(self, output: dict, batch: GenerationBatch) -> None:
        """Every rank's per-row token counts (prompt, completion, loss tokens) and padded widths (prompt, completion
        per rank), in two gathers, into ``batch``."""
        counts = [output["prompt_mask"].sum(1), output["completion_mask"].sum(1), loss_mask(output).sum(1)]
        batch.row_tokens = self.view.gather(torch.stack([c.long() for c in counts], 1)).cpu()
        widths = torch.tensor([[output["prompt_mask"].size(1), output["completion_mask"].size(1)]])
        batch.padded_widths = self.view.gather(widths.to(self.view.device)).cpu()
        batch.widths_per_rank = batch.padded_widths.sum(1).tolist()

    def log_metrics(self, batch: GenerationBatch, scores: torch.Tensor) -> None:
        """The ``dppo/*`` metrics of the global decision, one entry per iteration (TRL's log averages them); with
        ``num_iterations`` > 1 also ``dppo/logps_row_fraction``, the rows some iteration keeps (their log-prob
        passes run once)."""
        if self.config.num_iterations > 1:
            self.view.log_metric("dppo/logps_row_fraction", float(batch.keep.float().mean()))
        for k in range(batch.iteration_weights.size(0)):
            self._log_iteration(batch.iteration(k), scores)

    def _log_iteration(self, batch: GenerationBatch, scores: torch.Tensor) -> None:
        """The ``dppo/*`` metrics of one iteration's decision; ``batch.weights`` include the prompt weights."""
        log = self.view.log_metric
        keep, weights, pi = batch.keep, batch.weights, batch.keep_probabilities
        sequence = batch.sequence_lengths.double()
        n = keep.numel()
        log("dppo/kept_fraction", float(keep.float().mean()))
        log("dppo/kept_prompt_fraction", float(keep.view(-1, self.rewards.group_size).any(1).float().mean()))
        log("dppo/kept_token_fraction", batch.kept_token_fraction)
        log("dppo/zero_advantage_fraction", float((scores == 0).float().mean()))
        log("dppo/ess", effective_sample_size(weights[keep]))
        log("dppo/weight_max", float(weights.max()) if n else 0.0)
        if pi is not None:
            log("dppo/expected_keep_fraction", float(pi.sum()) / n)
        if batch.prune_summary is not None:
            log("dppo/keep_rate", batch.prune_summary[0])
            log("dppo/pruning_error", batch.prune_summary[1])
        # Work of the log-prob and loss passes scales with the sequence tokens they see.
        log("dppo/compute_saved", 1.0 - float(sequence[keep].sum() / sequence.sum().clamp(min=1)))


def completion_budget_scale(batch: GenerationBatch) -> float:
    """Under prompt pruning's cut, ``completion_keep_rate`` is a fraction of GRPO's batch (every candidate's rows),
    not of the accepted rows: the cut saves generation and leaves the trained rows' budget DPPO's. A function of
    counts fixed before the draw (``m`` of ``P`` on every rank)."""
    cut = batch.cut
    return 1.0 if cut is None else cut.accepted.numel() / max(int(cut.accepted.sum()), 1)
