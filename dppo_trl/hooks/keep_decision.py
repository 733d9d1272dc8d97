"""The keep decision of a generation batch: the pruning scores (every rank's advantages, exactly 0 where A is 0 in
exact arithmetic), the sampling design's mask and keep probabilities, the Horvitz-Thompson weights, the same on
every rank, and the ``dppo/*`` metrics of the decision. The math is in ``dppo_trl.core.pruning`` and
``dppo_trl.core.estimator``.

Reads of the host trainer: ``args``, ``accelerator``, ``num_generations``, ``reward_weights``, ``beta``,
``_entropy_bonus_enabled``, ``state.global_step``, ``_step``, ``_metrics``; ``_measured_error_scale`` (the audit)."""

from __future__ import annotations

import dataclasses

import torch
from accelerate.utils import broadcast_object_list
from trl.extras.profiling import profiling_decorator

from ..core.batch import loss_mask
from ..core.estimator import effective_sample_size, horvitz_thompson_weights
from ..core.pruning import (
    PruneProblem,
    adaptive_keep_rate,
    get_design,
    pruning_relative_error,
    unbiased_designs,
    zero_spread_rows,
)
from ..core.seeds import derive_seed
from .generation_batch import GenerationBatch


class KeepDecision:
    """Mixed into ``DPPOTrainer``."""

    def _local(self, rows_per_rank: int) -> slice:
        """This rank's rows of a batch gathered from every rank (TRL's process slice)."""
        index = self.accelerator.process_index
        return slice(index * rows_per_rank, (index + 1) * rows_per_rank)

    def _global_scores(self, advantages: torch.Tensor, batch: GenerationBatch) -> torch.Tensor:
        """Every rank's advantages, gathered (a fixed-size gather), one per row: the advantage itself, or the
        largest |A| of the row where a subclass gives per-token advantages. A row whose A is 0 in exact
        arithmetic scores exactly 0 (TRL's float32 A can be 1e-4 there): under ``sum_then_normalize`` the rows of a
        group whose weighted reward sums have zero spread; under ``normalize_then_sum`` (each reward function
        normalized within its group, then summed; the batch mean of that sum is exactly 0) those of a group where
        every weighted reward function has zero spread."""
        advantages = self.accelerator.gather(advantages.detach()).float().cpu()
        scores = advantages.abs().amax(dim=1) if advantages.dim() > 1 else advantages
        return torch.where(self._zero_advantage_rows(batch), 0.0, scores)

    def _zero_advantage_rows(self, batch: GenerationBatch) -> torch.Tensor:
        """The rows (all ranks) whose advantage is exactly 0 in exact arithmetic, decided from the rewards."""
        if self.args.multi_objective_aggregation == "sum_then_normalize":
            return zero_spread_rows(self._aggregated_rewards(batch), self.num_generations)
        per_func = batch.rewards_per_func.cpu()
        weighted = [k for k, weight in enumerate(self.reward_weights.tolist()) if weight != 0.0]
        spreads = [zero_spread_rows(per_func[:, k], self.num_generations) for k in weighted]
        return torch.stack(spreads, 1).all(1) if spreads else torch.ones(per_func.size(0), dtype=torch.bool)

    def _aggregated_rewards(self, batch: GenerationBatch) -> torch.Tensor:
        """The generation batch's weighted reward sums (all ranks), NaN where every reward function gave None."""
        per_func = batch.rewards_per_func
        rewards = (per_func * self.reward_weights.to(per_func.device)).nansum(1)
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
        return rewards.cpu()

    def _training_position(self) -> int:
        """Micro-steps taken since the start of training, from the optimizer steps (so a resumed run counts on)."""
        ga = self.args.gradient_accumulation_steps
        return self.state.global_step * ga + self._step % ga

    def _seed_of(self, stream: str, iteration: int = 0) -> int:
        """This generation batch's seed of ``stream`` (``core.seeds``), indexed by the training position at which
        its ``iteration`` starts (``steps_per_generation`` micro-steps an iteration)."""
        base = self.args.prune_seed if self.args.prune_seed is not None else self.args.seed
        return derive_seed(stream, base, self._training_position() + iteration * self.args.steps_per_generation)

    @profiling_decorator
    def _draw_keep_mask(self, output: dict, batch: GenerationBatch, scores: torch.Tensor) -> None:
        """The global keep decision, the main process's on every rank (``_same_on_every_rank``), into ``batch``:
        each iteration's weights, the rows some iteration keeps, ``keep_probabilities`` and ``prune_summary`` over
        every rank's rows, with the rows' token counts and every rank's kept sequence lengths, from which each rank
        derives the common micro-batch row counts and forward calls."""
        local_rows = output["advantages"].size(0)
        self._gather_row_tokens(output, batch)
        decision = self._decide_keep(scores, batch)
        keeps, batch.keep_probabilities, batch.prune_summary = self._same_on_every_rank(decision)
        pi = batch.keep_probabilities
        batch.iteration_weights = keeps.double() if pi is None else horvitz_thompson_weights(pi, keeps)
        batch.keep = keep = keeps.any(0)
        self.last_global_keep = keep  # the rows of the whole generation batch some iteration keeps, on every rank
        rows_per_rank = torch.arange(keep.numel()).view(self.accelerator.num_processes, local_rows)
        batch.kept_rows_per_rank = [rows[keep[rows]].tolist() for rows in rows_per_rank]

    def _decide_keep(self, scores: torch.Tensor, batch: GenerationBatch) -> tuple:
        """``(keeps, pi, summary)`` of the generation batch: ``keeps`` (num_iterations, N), one independent draw of
        the design per iteration, each seeded by the position where its iteration starts (an iteration that reused
        an earlier one's mask would start from parameters that depend on it: its expected gradient would not be
        GRPO's); the keep probabilities (the same for every iteration: the advantages are; None for the
        deterministic designs) and ``(keep rate, estimated pruning error)`` (None without ``pi``)."""
        iterations = self.num_iterations
        if not self.args.completion_pruning:  # packing only: every row, weight 1
            return torch.ones(iterations, scores.numel(), dtype=torch.bool), None, None
        problem = self._prune_problem(scores, batch)
        design = get_design(self.args.prune_sampling)
        draws = [design(problem, torch.Generator().manual_seed(self._seed_of("keep", k))) for k in range(iterations)]
        pi = draws[0][1]
        summary = None if pi is None else (problem.keep_rate, pruning_relative_error(pi, problem.scores))
        return torch.stack([keep for keep, _ in draws]), pi, summary

    def _same_on_every_rank(self, value):
        """The main process's ``value``, sent to every rank (pickled, so bit for bit). Decisions that every rank
        must share (keep mask, prompt acceptance) are taken from it, never from each rank's own floats: the last
        bit of a float can differ between machines, and a design can be sensitive to it (a tie in a sort, a rank
        cut-off of ``balanced``'s SVD)."""
        if self.accelerator.num_processes == 1:
            return value
        return broadcast_object_list([value], from_process=0)[0]

    def _prune_problem(self, scores: torch.Tensor, batch: GenerationBatch) -> PruneProblem:
        """What the design sees of the generation batch; with ``adaptive_keep_error``, at the batch's own rate."""
        # A row with A == 0 contributes exactly zero unless a term without A (KL, entropy bonus) is on; a row
        # without loss tokens (e.g. masked as truncated) contributes nothing at all.
        problem = PruneProblem(
            advantages=scores,  # signed where TRL's advantages are one per row
            costs=batch.sequence_lengths,
            groups=torch.arange(scores.numel()) // self.num_generations,
            rewards=None if batch.rewards_per_func is None else self._aggregated_rewards(batch),
            keep_rate=self.args.completion_keep_rate * self._completion_budget_scale(batch),
            keep_floor=self.args.keep_floor,
            zero_score_contributes=self.beta != 0.0 or self._entropy_bonus_enabled,
            contributes_nothing=batch.loss_tokens == 0,
            budget_in_tokens=self.args.keep_budget == "tokens",
            length_exponent=self.args.length_exponent,
        )
        if self.args.adaptive_keep_error is None or self.args.prune_sampling not in unbiased_designs():
            return problem
        # With adaptive_keep_error_source='audit', the target on the model-based error is scaled by how much the
        # measured error exceeded it on earlier audited batches (never this batch's draw).
        target = self.args.adaptive_keep_error / self._measured_error_scale()
        return dataclasses.replace(problem, keep_rate=adaptive_keep_rate(problem, target))

    @staticmethod
    def _completion_budget_scale(batch: GenerationBatch) -> float:
        """Under prompt pruning's cut, ``completion_keep_rate`` is a fraction of GRPO's batch (every candidate's
        rows), not of the accepted rows: the cut saves generation and leaves the trained rows' budget DPPO's. A
        function of counts fixed before the draw (``m`` of ``P`` on every rank)."""
        cut = batch.cut
        return 1.0 if cut is None else cut.accepted.numel() / max(int(cut.accepted.sum()), 1)

    def _gather_row_tokens(self, output: dict, batch: GenerationBatch) -> None:
        """Every rank's per-row token counts (prompt, completion, loss tokens) and padded widths (prompt, completion
        per rank), in two gathers, into ``batch``."""
        counts = [output["prompt_mask"].sum(1), output["completion_mask"].sum(1), loss_mask(output).sum(1)]
        batch.row_tokens = self.accelerator.gather(torch.stack([c.long() for c in counts], 1)).cpu()
        widths = torch.tensor([[output["prompt_mask"].size(1), output["completion_mask"].size(1)]])
        batch.padded_widths = self.accelerator.gather(widths.to(self.accelerator.device)).cpu()
        batch.widths_per_rank = batch.padded_widths.sum(1).tolist()

    def _log_pruning_metrics(self, batch: GenerationBatch, scores: torch.Tensor) -> None:
        """The ``dppo/*`` metrics of the global decision, one entry per iteration (TRL's log averages them); with
        ``num_iterations`` > 1 also ``dppo/logps_row_fraction``, the rows some iteration keeps (their log-prob
        passes run once)."""
        if self.num_iterations > 1:
            self._metrics["train"]["dppo/logps_row_fraction"].append(float(batch.keep.float().mean()))
        for k in range(batch.iteration_weights.size(0)):
            self._log_iteration_metrics(batch.iteration(k), scores)

    def _log_iteration_metrics(self, batch: GenerationBatch, scores: torch.Tensor) -> None:
        """The ``dppo/*`` metrics of one iteration's decision; ``batch.weights`` include the prompt weights."""
        metrics = self._metrics["train"]
        keep, weights, pi = batch.keep, batch.weights, batch.keep_probabilities
        sequence = batch.sequence_lengths.double()
        n = keep.numel()
        metrics["dppo/kept_fraction"].append(float(keep.float().mean()))
        metrics["dppo/kept_prompt_fraction"].append(float(keep.view(-1, self.num_generations).any(1).float().mean()))
        metrics["dppo/kept_token_fraction"].append(batch.kept_token_fraction)
        metrics["dppo/zero_advantage_fraction"].append(float((scores == 0).float().mean()))
        metrics["dppo/ess"].append(effective_sample_size(weights[keep]))
        metrics["dppo/weight_max"].append(float(weights.max()) if n else 0.0)
        if pi is not None:
            metrics["dppo/expected_keep_fraction"].append(float(pi.sum()) / n)
        if batch.prune_summary is not None:
            metrics["dppo/keep_rate"].append(batch.prune_summary[0])
            metrics["dppo/pruning_error"].append(batch.prune_summary[1])
        # Work of the log-prob and loss passes scales with the sequence tokens they see.
        metrics["dppo/compute_saved"].append(1.0 - float(sequence[keep].sum() / sequence.sum().clamp(min=1)))
