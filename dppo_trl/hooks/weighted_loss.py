"""DPPO's loss of a kept, weighted micro-batch: TRL's policy loss with each row's advantage scaled by its weight and
rescaled to the full-batch normalizer, with TRL's batch-normalized terms (KL, entropy bonus, MoE router loss)
switched off around it (``_trl_batch_terms_off``) and added back weighted; the entropy filter's quantile over every row
of TRL's micro-batch, the rows that were not kept forwarded without gradient (``_unkept_entropies``).
The math is in ``dppo_trl.core.estimator`` (the loss-type table, the normalizers) and ``dppo_trl.core.metrics``.

Reads of the host trainer: ``args``, ``accelerator``, ``loss_type``, ``max_completion_length``,
``current_gradient_accumulation_steps``, ``importance_sampling_level``, ``router_aux_loss_coef``, ``_metrics``;
writes TRL's ``beta``, ``_entropy_bonus_enabled``, ``aux_loss_enabled`` (restored) and its adaptive entropy state
(``entropy_coef``, ``_last_world_entropy``, ``_entropy_window_stats``), as TRL's own loss does."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from trl.extras.profiling import profiling_decorator

from ..core.batch import TOKEN_KEYS, filler_row, loss_mask
from ..core.estimator import (
    full_batch_normalizer,
    loss_token_normalizer,
    loss_type_record,
    trl_microbatch_normalizer,
    trl_microbatch_token_scale,
)
from ..core.trl_formulas import adaptive_entropy_coef, k3_kl, sequence_log_ratio


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


class WeightedLoss:
    """Mixed into ``DPPOTrainer``."""

    @contextlib.contextmanager
    def _trl_batch_terms_off(self, row_weights: torch.Tensor, unkept=None):
        """Around ``GRPOTrainer._compute_loss`` on a kept micro-batch: TRL normalizes its KL (``beta``), entropy
        bonus and MoE router loss per micro-batch, which pruning would bias, so they are off inside (``beta`` 0,
        the bonus and the router loss disabled) and DPPO adds weighted ones after. Yields the ``LossPass`` that
        the forward inside fills (``_get_per_token_logps_and_entropies``, ``get_high_entropy_mask``); restores
        TRL's settings on exit, also on an exception. ``unkept``: ``_unkept_entropies``'s result."""
        saved = (self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled)
        loss_pass = LossPass(row_weights, beta=saved[0], entropy_bonus=saved[1], aux_loss=saved[2], unkept=unkept)
        self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = 0.0, False, False
        self._loss_pass = loss_pass
        try:
            yield loss_pass
        finally:
            self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = saved
            self._loss_pass = None

    @profiling_decorator
    @torch.no_grad()
    def _unkept_entropies(self, model, unkept: dict | None, inputs: dict):
        """``(entropies, loss mask)`` (P, T) of the rows of this micro-batch's TRL micro-batch that were not kept
        (``unkept``, from ``_kept_microbatches`` under the entropy filter with completion pruning), forwarded without
        gradient; None when there is nothing to take. A rank with no such row forwards a one-token filler row of
        ``inputs`` (no loss token), so every rank makes the same forward calls (ZeRO-3, FSDP)."""
        if unkept is None:
            return None
        if unkept["prompt_ids"].size(0) == 0:
            filler = filler_row(inputs)
            unkept = {key: filler[key] for key in TOKEN_KEYS if key in filler}
        input_ids = torch.cat([unkept["prompt_ids"], unkept["completion_ids"]], dim=1)
        attention_mask = torch.cat([unkept["prompt_mask"], unkept["completion_mask"]], dim=1)
        _, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, unkept["completion_ids"].size(1), compute_entropy=True
        )
        return entropies, loss_mask(unkept)

    def _loss_scales(self, inputs: dict, weight: torch.Tensor) -> LossScales:
        norm_args = dict(
            max_completion_length=self.max_completion_length,
            loss_tokens_in_generation_batch=float(inputs["num_items_in_batch"]),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
            accumulation_steps=self.current_gradient_accumulation_steps,
        )
        full_z = full_batch_normalizer(self.loss_type, self.args.per_device_train_batch_size, **norm_args)
        per_microbatch = self._trl_microbatch_scale(inputs.pop("dppo_trl_microbatch_tokens"), norm_args)
        counts_microbatch = loss_type_record(self.loss_type).normalizer == "microbatch_tokens"
        policy_weight = weight * per_microbatch if counts_microbatch else weight
        return LossScales(norm_args, full_z, per_microbatch, policy_weight)

    @staticmethod
    def _token_normalizer(norm_args: dict) -> float:
        return loss_token_normalizer(
            norm_args["loss_tokens_in_generation_batch"], norm_args["num_processes"],
            norm_args["steps_per_generation"], norm_args["accumulation_steps"],
        )

    def _trl_microbatch_scale(self, trl_microbatch_tokens, norm_args) -> torch.Tensor:
        """Per row, the factor that turns the token normalizer of a full-batch-mean micro-batch into the one of the
        row's own micro-batch in TRL's random split (``estimator.trl_microbatch_token_scale``): what ``bnpo`` and
        the entropy bonus divide by in TRL. 1 under prompt pruning, whose token count is planned (the batch GRPO
        would have drawn is never generated)."""
        if self.args.prompt_pruning:
            return torch.ones_like(trl_microbatch_tokens)
        mean = self._token_normalizer(norm_args) / norm_args["accumulation_steps"]
        return trl_microbatch_token_scale(trl_microbatch_tokens, mean)

    @staticmethod
    def _weighted_advantages(advantages: torch.Tensor, policy_weight: torch.Tensor) -> torch.Tensor:
        # Every TRL loss_type is positively homogeneous in A per row (clipping, SAPO/VESPO gates depend on
        # sign(A) only), so A * w scales the row's policy term by w exactly, in value and gradient.
        row_weight = policy_weight.to(advantages.dtype)
        return advantages * (row_weight if advantages.dim() == 1 else row_weight.unsqueeze(1))

    def _with_weighted_terms(self, loss, inputs, weight, scales: LossScales, loss_pass: LossPass):
        """TRL's policy loss of the micro-batch on the full-batch scale, plus the weighted KL, entropy bonus and
        router loss. Returns the loss and the forward's ``(logps, entropies)``."""
        mask = loss_mask(inputs)
        norm_args = scales.norm_args
        trl_z = trl_microbatch_normalizer(self.loss_type, mask.size(0), float(mask.sum()), **norm_args)
        loss = loss * (trl_z / scales.full_z)
        logps, entropies, aux_loss = loss_pass.captured[0]
        if loss_pass.beta != 0.0:
            kl = self._weighted_kl(logps, inputs, mask, weight, scales.policy_weight)
            loss = loss + loss_pass.beta * kl / scales.full_z
        if loss_pass.entropy_bonus:
            self._log_policy_loss(loss)
            per_row_normalizer = scales.per_microbatch / self._token_normalizer(norm_args)
            loss = loss - self._weighted_entropy_bonus(entropies, mask, weight, per_row_normalizer, loss_pass)
        if self.aux_loss_enabled:  # a regularizer of the rows forwarded, as GRPO's is of its micro-batch
            loss = loss + self.router_aux_loss_coef * aux_loss / self.current_gradient_accumulation_steps
            self._metrics["train"]["aux_loss"].append(self.accelerator.gather(aux_loss.detach()).mean().item())
        return loss, logps, entropies, mask

    def _log_policy_loss(self, loss) -> None:
        """TRL's ``policy_loss`` metric (the loss before the entropy bonus, on TRL's scale: before the division by
        the accumulation steps for the row- and micro-batch-normalized loss types), here the Horvitz-Thompson
        estimate of GRPO's."""
        scale = 1
        if loss_type_record(self.loss_type).policy_loss_scale_is_accumulation:
            scale = self.current_gradient_accumulation_steps
        policy_loss = (loss.detach() * scale).reshape(1)
        self._metrics["train"]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())

    def _weighted_kl(self, per_token_logps, inputs, mask, weight, loss_weight) -> torch.Tensor:
        """``sum_n loss_weight_n * kl_n`` over the micro-batch (kl_n: TRL's k3 estimator, token mean or sum per
        row; ``loss_weight``: the row weights ``weight`` times, under ``bnpo``, the TRL micro-batch scale); TRL's
        ``kl`` metric weighted by ``weight``."""
        # Masked positions (fillers, padding) get ref = logp there, hence kl = 0: no overflow times a zero mask.
        ref = torch.where(mask.bool(), inputs["ref_per_token_logps"], per_token_logps.detach())
        per_token_kl = k3_kl(ref, per_token_logps)
        if self.args.use_bias_correction_kl:
            old = inputs.get("old_per_token_logps")
            log_ratio = per_token_logps - (per_token_logps.detach() if old is None else old)
            if self.importance_sampling_level == "sequence":
                log_ratio = sequence_log_ratio(log_ratio, mask)
            per_token_kl = per_token_kl * torch.exp(log_ratio)
        row_kl = (per_token_kl * mask).sum(-1)
        if loss_type_record(self.loss_type).row_term == "token_mean":
            row_kl = row_kl / mask.sum(-1).clamp(min=1.0)
        w = weight.to(row_kl.dtype)
        # TRL's "kl" metric: the token mean, here the Horvitz-Thompson (weighted) estimate of the full batch's.
        stats = torch.stack([(per_token_kl.detach() * mask * w.unsqueeze(1)).sum(), (mask * w.unsqueeze(1)).sum()])
        stats = self.accelerator.reduce(stats, reduction="sum")
        self._metrics["train"]["kl"].append((stats[0] / stats[1].clamp(min=1e-12)).item())
        return (row_kl * loss_weight.to(row_kl.dtype)).sum()

    def _weighted_entropy_bonus(self, entropies, mask, weight, per_row_normalizer, loss_pass) -> torch.Tensor:
        """TRL's entropy bonus ``coef x`` token-mean entropy over the tokens it acts on, in TRL's micro-batches, as
        a Horvitz-Thompson sum over the kept rows: each row's tokens over the loss tokens of the row's micro-batch
        in TRL's split (``1 / per_row_normalizer``, counted before the keep draw, so unbiased); under the entropy
        filter (where micro-batches are TRL's split) over TRL's count of its micro-batch's filtered tokens, the
        rows that were not kept included (``LossPass.unkept_filtered_tokens``). The adaptive controller (TRL's rule
        and state) measures the weighted window entropy."""
        entropy_mask = loss_pass.entropy_mask
        effective = mask if entropy_mask is None else mask * entropy_mask
        weighted = effective * weight.to(entropies.dtype).unsqueeze(1)
        if entropy_mask is None:
            normalized = weighted * per_row_normalizer.to(entropies.dtype).unsqueeze(1)
        else:
            count = max(float(effective.detach().sum()) + loss_pass.unkept_filtered_tokens, 1.0)  # clamped as TRL
            normalized = weighted / (count * self.current_gradient_accumulation_steps)
        apply_coef = self.entropy_coef
        if self.use_adaptive_entropy:  # the coefficient of the previous step's end, for the whole window
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            self._update_adaptive_entropy(torch.stack([(entropies * weighted).sum(), weighted.sum()]).detach())
        if self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(self.entropy_coef)
        return apply_coef * (entropies * normalized).sum()

    def _update_adaptive_entropy(self, stats: torch.Tensor) -> None:
        """TRL's adaptive entropy controller on the weighted ``(entropy sum, token count)`` of the window."""
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world = (total[0] / total[1].clamp(min=1e-12)).item()
        a = self.args
        self.entropy_coef = adaptive_entropy_coef(
            self.entropy_coef, world, a.entropy_target, a.entropy_coef_delta, a.entropy_coef_min, a.entropy_coef_max
        )
        self._last_world_entropy, self._entropy_window_stats = world, None
