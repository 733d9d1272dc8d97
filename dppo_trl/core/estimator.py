"""The estimator's math: Horvitz-Thompson weights and the loss normalizers, for completion and prompt pruning.

No TRL import. A pruned batch's loss is ``sum_n w_n l_n / Z``: ``w`` the row weights (``1 / pi`` of the kept rows
times the prompt weights), ``Z`` a normalizer that must not depend on the pruning draw, so that an unbiased
numerator over ``Z`` stays unbiased. Completion pruning takes ``Z`` from the full generation batch, counted
before the keep draw (``full_batch_normalizer``). Prompt pruning cannot count the batch GRPO would have drawn
(it is never generated): its token count is fixed before the step's acceptance draw
(``prompts.expected_candidate_tokens``; ``docs/prompt_pruning.md``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LossType:
    """What DPPO needs to know of one of TRL's loss types (TRL 1.16's ``_compute_loss``; re-check on upgrade).

    Args:
        name: TRL's ``loss_type``.
        row_term: ``"token_mean"`` (a row contributes the mean over its loss tokens) or ``"token_sum"``.
        normalizer: what TRL divides a micro-batch's summed terms by: ``"rows"``, ``"rows_x_max_length"`` (rows x
            ``max_completion_length``), ``"microbatch_tokens"`` (the micro-batch's loss tokens) or
            ``"generation_tokens"`` (the generation batch's loss tokens per micro-step).
        clip_metric: the clip statistics TRL logs: ``"ppo"`` (``clip_ratio/*``), ``"cispo"``, ``"vespo"`` or None.
    """

    name: str
    row_term: str
    normalizer: str
    clip_metric: str | None

    @property
    def counts_tokens(self) -> bool:
        """Normalized by a count of loss tokens (else by a count of rows)."""
        return self.normalizer in ("microbatch_tokens", "generation_tokens")

    @property
    def policy_loss_scale_is_accumulation(self) -> bool:
        """TRL logs ``policy_loss`` before its division by the accumulation steps (all but the generation-token
        normalized types, whose normalizer already holds them)."""
        return self.normalizer != "generation_tokens"


LOSS_TYPES: dict[str, LossType] = {
    record.name: record
    for record in (
        LossType("grpo", "token_mean", "rows", "ppo"),
        LossType("bnpo", "token_sum", "microbatch_tokens", "ppo"),
        LossType("dr_grpo", "token_sum", "rows_x_max_length", "ppo"),
        LossType("dapo", "token_sum", "generation_tokens", "ppo"),
        LossType("cispo", "token_sum", "generation_tokens", "cispo"),
        LossType("sapo", "token_mean", "rows", None),
        LossType("vespo", "token_sum", "generation_tokens", "vespo"),
        LossType("luspo", "token_sum", "rows", "ppo"),
    )
}
SUPPORTED_LOSS_TYPES = tuple(LOSS_TYPES)
SEQUENCE_MEAN_LOSS_TYPES = tuple(name for name, t in LOSS_TYPES.items() if t.row_term == "token_mean")
TOKEN_MEAN_LOSS_TYPES = tuple(name for name, t in LOSS_TYPES.items() if t.counts_tokens)


def loss_type_record(loss_type: str) -> LossType:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; expected one of {SUPPORTED_LOSS_TYPES}")
    return LOSS_TYPES[loss_type]


def horvitz_thompson_weights(pi: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``1 / pi`` on kept rows, 0 elsewhere."""
    pi = pi.detach().to(torch.float64)
    keep = keep & (pi > 0)
    safe = torch.where(keep, pi, torch.ones_like(pi))
    return torch.where(keep, 1.0 / safe, torch.zeros_like(pi))


def effective_sample_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2`` of the kept rows' weights (0 when none)."""
    w = weights.detach().to(torch.float64)
    sq = float((w * w).sum())
    return float(w.sum()) ** 2 / sq if sq > 0 else 0.0


def full_batch_normalizer(
    loss_type: str,
    rows_per_microbatch: int,
    max_completion_length: int,
    loss_tokens_in_generation_batch: float,
    num_processes: int,
    steps_per_generation: int,
    accumulation_steps: int,
) -> float:
    """The normalizer ``Z`` of one micro-batch's loss, fixed by the FULL generation batch, never by the mask.

    Summed over the ``steps_per_generation`` micro-batches of every rank (and averaged over ranks, as DDP
    does), ``sum_n l_n / Z`` is TRL's full-batch loss: rows x ``GA`` (``grpo``, ``sapo``, ``luspo``: the mean
    over rows), rows x ``max_completion_length`` x ``GA`` (``dr_grpo``), or the generation batch's loss tokens
    ``/ P x GA / spg`` (``bnpo``, ``dapo``, ``cispo``, ``vespo``: the mean over tokens; under prompt pruning
    the count fixed before the draw, ``prompts.expected_candidate_tokens``).
    """
    normalizer = loss_type_record(loss_type).normalizer
    if normalizer == "rows":
        return float(rows_per_microbatch * accumulation_steps)
    if normalizer == "rows_x_max_length":
        return float(rows_per_microbatch * max_completion_length * accumulation_steps)
    return loss_token_normalizer(
        loss_tokens_in_generation_batch, num_processes, steps_per_generation, accumulation_steps
    )


def loss_token_normalizer(
    loss_tokens_in_generation_batch: float, num_processes: int, steps_per_generation: int, accumulation_steps: int
) -> float:
    """The generation batch's loss tokens per rank and micro-step, times the accumulation steps: the full-batch
    normalizer of the loss types that count tokens, and of the entropy bonus (a token mean)."""
    tokens = max(float(loss_tokens_in_generation_batch), 1.0)
    return tokens / num_processes * accumulation_steps / steps_per_generation


def trl_microbatch_normalizer(
    loss_type: str,
    rows_in_microbatch: int,
    loss_tokens_in_microbatch: float,
    max_completion_length: int,
    loss_tokens_in_generation_batch: float,
    num_processes: int,
    steps_per_generation: int,
    accumulation_steps: int,
) -> float:
    """The normalizer TRL 1.16's ``_compute_loss`` applies to a micro-batch in train mode: it counts the rows
    (or, for ``bnpo``, the loss tokens) of THAT micro-batch, so after pruning it must be replaced."""
    if loss_type_record(loss_type).normalizer == "microbatch_tokens":
        return max(float(loss_tokens_in_microbatch), 1.0) * accumulation_steps
    # The other types count the micro-batch's rows where the full-batch normalizer counts a full micro-batch.
    return full_batch_normalizer(
        loss_type,
        rows_in_microbatch,
        max_completion_length,
        loss_tokens_in_generation_batch,
        num_processes,
        steps_per_generation,
        accumulation_steps,
    )


def trl_microbatch_token_scale(trl_microbatch_tokens: torch.Tensor, mean_microbatch_tokens: float) -> torch.Tensor:
    """Per row, ``mean / T_n``: TRL normalizes ``bnpo``'s loss and the entropy bonus by the loss tokens ``T_n`` of
    the micro-batch the row is in (its rank's share of its random split, at least 1); DPPO's full-batch
    normalizer is the mean micro-batch's count. Scaling row ``n``'s term by this factor makes it TRL's, wherever
    the row trains. ``T_n`` is counted over every row of that micro-batch, kept or not, before the keep draw, so
    the Horvitz-Thompson sum over the kept rows stays unbiased. A count of 0 gives 1: a row of a micro-batch
    without loss tokens contributes nothing anyway, a filler row weighs 0, and a row that TRL's split leaves out
    (a remainder, which TRL drops) keeps the full-batch normalizer.

    Args:
        trl_microbatch_tokens: (B,) each row's TRL micro-batch's loss-token count.
        mean_microbatch_tokens: the generation batch's loss tokens per rank and micro-batch.

    Returns:
        (B,) float64.
    """
    tokens = trl_microbatch_tokens.detach().to(torch.float64)
    return torch.where(tokens > 0, mean_microbatch_tokens / tokens.clamp(min=1.0), 1.0)
