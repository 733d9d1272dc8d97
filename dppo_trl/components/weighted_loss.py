"""DPPO's loss of a kept, weighted micro-batch, as terms around TRL's: each row's advantage scaled by its weight,
TRL's policy loss rescaled to the full-batch normalizer, and the weighted KL, entropy bonus and router-loss terms
the host adds back after switching TRL's off (``host.loss``). The math is in ``dppo_trl.core.estimator`` (the
loss-type table, the normalizers)."""

from __future__ import annotations

import dataclasses

import torch

from ..core.estimator import (
    full_batch_normalizer,
    loss_token_normalizer,
    loss_type_record,
    trl_microbatch_normalizer,
    trl_microbatch_token_scale,
)
from ..core.trl_formulas import k3_kl, sequence_log_ratio
from .view import TrainerView


@dataclasses.dataclass
class LossPass:
    """One call of TRL's loss inside DPPO's: what TRL's terms were before they were switched off, the rows'
    weights, the entropies and loss mask of the rows of TRL's micro-batch that were not kept (``unkept``, None when
    there are none to take), the forward's outputs as TRL computed them, and the entropy filter's mask of the kept
    rows with the count of the tokens it keeps in the rows that were not kept."""

    row_weights: torch.Tensor
    beta: float
    entropy_bonus: bool
    aux_loss: bool
    unkept: tuple[torch.Tensor, torch.Tensor] | None = None
    captured: list = dataclasses.field(default_factory=list)  # (logps, entropies, aux_loss) of the loss forward
    entropy_mask: torch.Tensor | None = None
    unkept_filtered_tokens: float = 0.0

    def with_unkept(self, entropies: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(entropies, mask)`` of the kept rows (B, T), followed by those of the rows that were not kept."""
        if self.unkept is None:
            return entropies, mask
        unkept_entropies, unkept_mask = self.unkept
        return (torch.cat([entropies, unkept_entropies.to(entropies.dtype)]),
                torch.cat([mask, unkept_mask.to(mask.dtype)]))

    def record_entropy_mask(self, every_mask: torch.Tensor) -> torch.Tensor:
        """Keep the kept rows' part of the filter's mask over ``with_unkept``'s rows (returned) and count the tokens
        it keeps in the others."""
        kept_rows = self.row_weights.size(0)
        self.entropy_mask = every_mask[:kept_rows]
        self.unkept_filtered_tokens = float(every_mask[kept_rows:].sum())
        return self.entropy_mask


@dataclasses.dataclass(frozen=True)
class LossScales:
    """A micro-batch's normalizers: ``full_z`` (the full generation batch's, ``estimator.full_batch_normalizer``),
    ``per_microbatch`` (per row, the scale to its TRL micro-batch's token count) and ``policy_weight`` (per row,
    the factor of its policy and KL terms: the weight, times ``per_microbatch`` where TRL counts a micro-batch's
    tokens)."""

    norm_args: dict
    full_z: float
    per_microbatch: torch.Tensor
    policy_weight: torch.Tensor

    @property
    def token_normalizer(self) -> float:
        """TRL's token normalizer of a micro-batch of the full batch's mean size."""
        return token_normalizer(self.norm_args)


def token_normalizer(norm_args: dict) -> float:
    """``estimator.loss_token_normalizer`` of a micro-batch's ``norm_args``."""
    return loss_token_normalizer(norm_args["loss_tokens_in_generation_batch"], norm_args["num_processes"],
                                 norm_args["steps_per_generation"], norm_args["accumulation_steps"])


class WeightedLoss:
    """The weighted terms of DPPO's loss.

    Args:
        config: the run's ``DPPOConfig``.
        loss_type: TRL's ``loss_type``.
        max_completion_length: TRL's (``dr_grpo``'s normalizer).
        view: the trainer (``components.view.TrainerView``).
    """

    def __init__(self, config, loss_type: str, max_completion_length: int, view: TrainerView):
        self.config, self.loss_type, self.view = config, loss_type, view
        self.max_completion_length = max_completion_length
        self.record = loss_type_record(loss_type)

    def scales(self, inputs: dict, weight: torch.Tensor, accumulation_steps: int) -> LossScales:
        """The micro-batch's ``LossScales`` (pops ``dppo_trl_microbatch_tokens`` from ``inputs``)."""
        norm_args = dict(
            max_completion_length=self.max_completion_length,
            loss_tokens_in_generation_batch=float(inputs["num_items_in_batch"]),
            num_processes=self.view.world_size,
            steps_per_generation=self.config.steps_per_generation,
            accumulation_steps=accumulation_steps,
        )
        full_z = full_batch_normalizer(self.loss_type, self.config.per_device_train_batch_size, **norm_args)
        tokens = inputs.pop("dppo_trl_microbatch_tokens")
        if self.config.prompt_pruning:  # its token count is planned: the batch GRPO would have drawn is never made
            per_microbatch = torch.ones_like(tokens)
        else:  # TRL's bnpo and entropy bonus divide by the row's own micro-batch's tokens in TRL's random split
            per_microbatch = trl_microbatch_token_scale(tokens, token_normalizer(norm_args) / accumulation_steps)
        counts_microbatch = self.record.normalizer == "microbatch_tokens"
        return LossScales(norm_args, full_z, per_microbatch, weight * per_microbatch if counts_microbatch else weight)

    @staticmethod
    def weighted_advantages(advantages: torch.Tensor, policy_weight: torch.Tensor) -> torch.Tensor:
        # Every TRL loss_type is positively homogeneous in A per row (clipping, SAPO/VESPO gates depend on
        # sign(A) only), so A * w scales the row's policy term by w exactly, in value and gradient.
        row_weight = policy_weight.to(advantages.dtype)
        return advantages * (row_weight if advantages.dim() == 1 else row_weight.unsqueeze(1))

    def on_full_batch_scale(self, loss: torch.Tensor, mask: torch.Tensor, scales: LossScales) -> torch.Tensor:
        """TRL's policy loss of the micro-batch (normalized as TRL normalizes it) on the full batch's normalizer."""
        trl_z = trl_microbatch_normalizer(self.loss_type, mask.size(0), float(mask.sum()), **scales.norm_args)
        return loss * (trl_z / scales.full_z)

    def kl_sum(self, per_token_logps, inputs, mask, weight, scales: LossScales, importance_sampling_level: str):
        """``sum_n policy_weight_n * kl_n`` over the micro-batch (the term is ``beta`` times it over ``full_z``;
        kl_n: TRL's k3 estimator, token mean or sum per row, times TRL's bias correction where on); TRL's ``kl``
        metric weighted by ``weight``, the Horvitz-Thompson estimate of the full batch's token mean."""
        # Masked positions (fillers, padding) get ref = logp there, hence kl = 0: no overflow times a zero mask.
        ref = torch.where(mask.bool(), inputs["ref_per_token_logps"], per_token_logps.detach())
        per_token_kl = k3_kl(ref, per_token_logps)
        if self.config.use_bias_correction_kl:
            old = inputs.get("old_per_token_logps")
            log_ratio = per_token_logps - (per_token_logps.detach() if old is None else old)
            if importance_sampling_level == "sequence":
                log_ratio = sequence_log_ratio(log_ratio, mask)
            per_token_kl = per_token_kl * torch.exp(log_ratio)
        row_kl = (per_token_kl * mask).sum(-1)
        if self.record.row_term == "token_mean":
            row_kl = row_kl / mask.sum(-1).clamp(min=1.0)
        w = weight.to(row_kl.dtype)
        stats = torch.stack([(per_token_kl.detach() * mask * w.unsqueeze(1)).sum(), (mask * w.unsqueeze(1)).sum()])
        stats = self.view.reduce_sum(stats)
        self.view.log_metric("kl", (stats[0] / stats[1].clamp(min=1e-12)).item())
        return (row_kl * scales.policy_weight.to(row_kl.dtype)).sum()

    def entropy_token_weights(self, mask, weight, scales: LossScales, loss_pass: LossPass, accumulation_steps: int,
                              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normalized, weighted)`` (B, T): each token's factor in TRL's entropy bonus as a Horvitz-Thompson sum
        over the kept rows (the bonus is ``coef x sum(entropies x normalized)``), and the weighted tokens it acts on
        (the adaptive controller's window). Each row's tokens over the loss tokens of the row's micro-batch in TRL's
        split (counted before the keep draw, so unbiased); under the entropy filter (where micro-batches are TRL's
        split) over TRL's count of its micro-batch's filtered tokens, the rows that were not kept included."""
        entropy_mask = loss_pass.entropy_mask
        effective = mask if entropy_mask is None else mask * entropy_mask
        weighted = effective * weight.to(dtype).unsqueeze(1)
        if entropy_mask is None:
            per_row = scales.per_microbatch / scales.token_normalizer
            return weighted * per_row.to(dtype).unsqueeze(1), weighted
        count = max(float(effective.detach().sum()) + loss_pass.unkept_filtered_tokens, 1.0)  # clamped as TRL
        return weighted / (count * accumulation_steps), weighted

    def log_policy_loss(self, loss: torch.Tensor, accumulation_steps: int) -> None:
        """TRL's ``policy_loss`` metric (the loss before the entropy bonus, on TRL's scale: before the division by
        the accumulation steps for the row- and micro-batch-normalized loss types), here the Horvitz-Thompson
        estimate of GRPO's."""
        scale = accumulation_steps if self.record.policy_loss_scale_is_accumulation else 1
        policy_loss = (loss.detach() * scale).reshape(1)
        self.view.log_metric("policy_loss", self.view.gather(policy_loss).nanmean().item())
