"""``GenerationBatch``: what DPPO decides about one generation batch, built once while the batch is scored and
passed as an argument to every pass that uses it (the keep draw, the rank exchange, the deferred log-prob passes,
the micro-batch plan, the audit). Plain data: a test can build one by hand."""

from __future__ import annotations

import dataclasses

import torch

# The key under which ``_generate_and_score_completions`` hands the batch to ``_prepare_inputs`` (popped there).
BATCH_KEY = "dppo_generation_batch"

# The key under which each row carries its weight in each iteration, (rows, num_iterations), 0 where that iteration
# does not keep it: popped by ``_prepare_inputs``.
ITERATION_WEIGHTS_KEY = "dppo_iteration_weights"

# The key under which a micro-batch carries the tokens of its TRL micro-batch's rows that were not kept (the entropy
# filter's quantile is over them too): popped by ``_compute_loss``.
UNKEPT_ROWS_KEY = "dppo_unkept_rows"


@dataclasses.dataclass
class AuditReference:
    """The audited batch's rows as GRPO has them (empty when the batch has no signal), what the batch is
    (``host.audit``'s kinds), the seconds building it took, and the seconds GRPO's log-prob passes over every
    row would take (measured on the rows forwarded, scaled to all of them)."""

    rows: dict
    kind: str
    seconds: float
    grpo_logps_seconds: float = 0.0
    counted: bool = True  # False: the speed check's batch, only timed


@dataclasses.dataclass
class GenerationBatch:
    """One generation batch's DPPO state, over every rank's rows (``N`` rows, ``world`` ranks).

    Args:
        deferred_calls: the models of the log-prob passes TRL asked for while scoring (run later, on kept rows).
        rewards_per_func: (N, F) TRL's rewards per reward function (NaN where a function gave None).
        row_tokens: (N, 3) long: each row's prompt, completion and loss tokens.
        padded_widths: (world, 2) long: each rank's padded prompt and completion widths.
        widths_per_rank: each rank's padded sequence width (every rank's the widest once rows move).
        kept_rows_per_rank: per rank, the rows it trains, in order (indices into the ``N`` rows; row //
            num_generations is the row's group): with ``num_iterations`` > 1, the rows some iteration trains.
        keep: (N,) bool: the rows some iteration trains (their log-prob passes run), the same on every rank.
        iteration_weights: (num_iterations, N) float64: each iteration's Horvitz-Thompson weights (times the prompt
            weights), 0 where that iteration does not keep the row: one independent draw per iteration.
        keep_probabilities: (N,) float64 ``pi``, None for the deterministic designs.
        prune_summary: ``(keep rate, estimated pruning error)``, None without ``pi``.
        trl_split_rng_state: the CPU RNG state TRL's shuffle of this batch draws from.
        audit: GRPO's version of this rank's rows when the batch is audited, else None.
        generation_seconds: TRL's generation and scoring of the batch on this rank (audited batches; else 0).
        logps_seconds: DPPO's deferred log-prob passes over the kept rows on this rank (audited batches; else 0).
        cut: prompt pruning's cut of the step's candidates (``components.prompt_cut.PromptCut``), or None.
    """

    deferred_calls: list = dataclasses.field(default_factory=list)
    rewards_per_func: torch.Tensor | None = None
    row_tokens: torch.Tensor | None = None
    padded_widths: torch.Tensor | None = None
    widths_per_rank: list[int] = dataclasses.field(default_factory=list)
    kept_rows_per_rank: list[list[int]] = dataclasses.field(default_factory=list)
    keep: torch.Tensor | None = None
    iteration_weights: torch.Tensor | None = None
    keep_probabilities: torch.Tensor | None = None
    prune_summary: tuple[float, float] | None = None
    trl_split_rng_state: torch.Tensor | None = None
    audit: AuditReference | None = None
    generation_seconds: float = 0.0
    logps_seconds: float = 0.0
    cut: object | None = None

    @property
    def weights(self) -> torch.Tensor:
        """(N,) float64: the first iteration's weights (with ``num_iterations`` 1, the batch's)."""
        return self.iteration_weights[0]

    def iteration(self, k: int) -> GenerationBatch:
        """Iteration ``k``'s decision as a batch of one iteration: the rows it keeps (``keep``, each rank's
        ``kept_rows_per_rank`` in order) and their weights; everything else shared."""
        weights = self.iteration_weights[k]
        kept = weights > 0
        flags = kept.tolist()
        return dataclasses.replace(
            self, keep=kept, iteration_weights=weights[None],
            kept_rows_per_rank=[[r for r in rows if flags[r]] for rows in self.kept_rows_per_rank],
        )

    @property
    def kept_token_fraction(self) -> float:
        """The share of the batch's completion tokens in the rows ``keep`` holds."""
        completion = self.row_tokens[:, 1].double()
        return float(completion[self.keep].sum() / completion.sum().clamp(min=1))

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """(N,) each row's prompt plus completion tokens."""
        return self.row_tokens[:, :2].sum(1)

    @property
    def kept_lengths_per_rank(self) -> list[list[int]]:
        """Per rank, the sequence lengths of the rows it trains, in the order of ``kept_rows_per_rank``."""
        lengths = self.sequence_lengths
        return [lengths[rows].tolist() for rows in self.kept_rows_per_rank]

    @property
    def loss_tokens(self) -> torch.Tensor:
        """(N,) each row's loss tokens."""
        return self.row_tokens[:, 2]
